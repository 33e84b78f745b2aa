"""Published results as checks on the derived formulas (never as code)."""
import pytest
import sympy as sp

import symmem as sm
from symmem.symbols import B_a, B_g, B_m, B_o, B_w, L, V, a, b, h, s, s_max


def test_korthikanti_per_layer_activations():
    """Korthikanti et al. 2022 (eq. 2): a transformer layer saves s*b*h*(34 + 5*a*s/h) bytes
    with 2-byte activations and 1-byte dropout masks. symmem's fp32-policy formula keeps
    the activation bytes as the symbol B_a; on CUDA masks are 1 byte. With B_a = 2 the
    per-layer term (the coefficient of L) is exactly theirs plus the layer-norm statistics
    they leave out: mean and rstd, float32, for 2 layer norms: 2 * 2 * 4 * s*b = 16*s*b."""
    g = sm.models.build_gpt2(sm.models.GPT2Config(activation_function="gelu"))
    act = sm.estimate(g, sm.Policy("fp32", "adam", "cuda", attention="eager")).components["activations"]
    per_layer = sp.expand(act).coeff(L)
    assert sp.expand(per_layer.subs(B_a, 2) - (s * b * h * (34 + 5 * a * s / h) + 16 * s * b)) == 0
    # In B_a: 16 tensors of s*b*h (two layer-norm inputs, QKV input, Q, K, V, attention
    # output, MLP input, 4h GELU input, 4h GELU output), 2 of a*s*s*b (softmax output,
    # dropout output) and the 1-byte masks: 2*s*b*h + a*s*s*b.
    assert sp.expand(per_layer - (16 * B_a * s * b * h + 2 * B_a * a * s**2 * b
                                  + 2 * s * b * h + a * s**2 * b + 16 * s * b)) == 0


def test_hf_gelu_new_saves_more_than_korthikanti():
    """GPT-2's default activation in transformers (``gelu_new``) is written in Python and
    saves three more 4h-wide tensors per layer (tanh, 0.5*x, 1 + tanh): 3 * 4 * s*b*h * B_a."""
    exact = sm.estimate(sm.models.build_gpt2(sm.models.GPT2Config(activation_function="gelu")),
                        sm.Policy("fp32", "adam", "cuda", attention="eager")).components["activations"]
    new = sm.estimate(sm.models.build_gpt2(sm.models.GPT2Config()),
                      sm.Policy("fp32", "adam", "cuda", attention="eager")).components["activations"]
    assert sp.expand((new - exact).coeff(L) - 12 * B_a * s * b * h) == 0


def test_zero_paper_16_bytes_per_parameter():
    """ZeRO (Rajbhandari et al. 2020, sec. 3.1): mixed-precision Adam keeps 2 + 2 + 12 = 16
    bytes per parameter (fp16 weights and gradients; fp32 master weights, momentum and
    variance). symmem's model states are N*(B_w + B_g + B_m + 2*B_o) with a master copy."""
    g = sm.models.preset("gpt2")
    est = sm.estimate(g, sm.Policy("bf16-master", "adam", "cuda", attention="eager"))
    c = est.components
    N = g.param_count()
    states = sp.expand(c["params"] + c["grads"] + c["master"] + c["optimizer"])
    assert sp.expand(states - N * (B_w + B_g + B_m + 2 * B_o)) == 0
    priced = states.subs({B_w: 2, B_g: 2, B_m: 4, B_o: 4})
    assert sp.expand(priced - 16 * N) == 0
    # and the policy's own prices give the same number for GPT-2 small: 16 * 124,439,808
    bound = est.at(b=1, s=1).bytes
    assert bound["params"] + bound["grads"] + bound["master"] + bound["optimizer"] == 16 * 124_439_808


# Hugging Face's published parameter counts (tied lm_head counted once).
PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
             "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_gpt2_parameter_counts(name):
    g = sm.models.preset(name)
    assert g.param_count().xreplace(g.bindings) == PUBLISHED[name]


def test_parameter_formula():
    """N = 12*L*h^2 + 13*L*h + (V + s_max)*h + 2*h: per layer 4 weight matrices of 12h^2 in
    all, biases 3h + h + 4h + h = 9h, two layer norms 4h; embeddings; the final layer norm."""
    N = sm.models.preset("gpt2").param_count()
    assert sp.expand(N - (12 * L * h**2 + 13 * L * h + (V + s_max) * h + 2 * h)) == 0


def test_gpt3_175b():
    """Brown et al. 2020 report 175.0B; the GPT-2 architecture at h=12288, L=96, V=50257,
    n_ctx=2048 has 12*96*12288^2 + 13*96*12288 + (50257 + 2048)*12288 + 2*12288
    = 173,946,175,488 + 15,335,424 + 642,723,840 + 24,576 = 174,604,259,328 (174.6B): the
    paper's figure is rounded (the sparse attention layers add no parameters)."""
    g = sm.models.preset("gpt3-175b")
    assert g.param_count().xreplace(g.bindings) == 174_604_259_328


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_counts_equal_hugging_face(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = sm.models.PRESETS[name]
    hf = transformers.GPT2Config(n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(hf)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
