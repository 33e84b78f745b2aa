"""Llama against Hugging Face's own ``LlamaForCausalLM`` on the CPU: random weights from small
configs (no download), multi-head, grouped-query and multi-query attention, eager and SDPA,
float32, bfloat16 autocast and a bfloat16 model; parameters and buffers, bytes saved for
backward, the training step's peak, its phase and every phase's maximum, to the byte.
"""
import json
import warnings

import pytest
import sympy as sp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError, UnknownName  # noqa: E402
from symmem.measure import param_bytes  # noqa: E402
from helpers import assert_hf_step_exact, enable_checkpointing  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, f, a, k, L, V): MHA (k = a), GQA (k < a), MQA (k = 1)
POINTS = [
    (2, 16, 32, 64, 4, 4, 2, 100),
    (2, 8, 128, 512, 4, 2, 3, 20),      # wide layers, a small vocabulary: peaks inside the layers
    (3, 8, 128, 384, 8, 1, 2, 20),
    (1, 16, 32, 64, 4, 2, 2, 100),      # b = 1
]


def hf_llama(point, attention, **extra):
    b, s, h, f, a, k, L, V = point
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=k,
                                   num_hidden_layers=L, vocab_size=V, max_position_embeddings=64,
                                   attn_implementation=attention, use_cache=False, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=None, **extra)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return cfg, model


def graph_of(cfg):
    return sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation})


CASES = [
    # point, attention, precision, optimizer, implementation
    (POINTS[0], "eager", "fp32", "adamw", "for-loop"),
    (POINTS[0], "sdpa", "bf16-mixed", "adamw", "foreach"),
    (POINTS[0], "eager", "bf16", "sgd-momentum", "for-loop"),
    (POINTS[1], "eager", "fp32", "sgd", "for-loop"),
    (POINTS[1], "sdpa", "bf16", "sgd", "for-loop"),
    (POINTS[1], "eager", "bf16-mixed", "adamw", "for-loop"),
    (POINTS[2], "sdpa", "fp32", "adam", "foreach"),
    (POINTS[2], "eager", "bf16-mixed", "sgd", "for-loop"),
    (POINTS[3], "eager", "fp32", "adamw", "for-loop"),
    (POINTS[3], "sdpa", "bf16", "sgd", "for-loop"),
]


@pytest.mark.parametrize("point,attention,precision,opt,impl", CASES,
                         ids=[f"b{p[0]}-h{p[2]}-a{p[4]}-k{p[5]}-{at}-{pr}-{o}-{i}" for p, at, pr, o, i in CASES])
def test_llama_exact(point, attention, precision, opt, impl):
    """Parameters and the rotary buffers (inv_freq and its copy, d/2 each, in the model's
    dtype), saved bytes, the peak, its phase and every phase's maximum."""
    b, s, h, f, a, k, L, V = point
    cfg, model = hf_llama(point, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", impl))
    if b == 1:
        est = est.at_one
    ev = est.at(b=b, s=s)
    buffers = sum(t.untyped_storage().nbytes() for t in model.buffers())
    assert (ev.bytes["params"], ev.bytes["buffers"]) == (param_bytes(model), buffers)
    ids = torch.randint(0, V, (b, s))
    assert_hf_step_exact(est, model, ids, precision, opt, b, s, impl=impl)


RECOMPUTED = [
    (POINTS[1], "eager", "fp32", "sgd", "full"),
    (POINTS[1], "sdpa", "bf16", "sgd", "full"),
    (POINTS[1], "sdpa", "bf16", "adamw", "last:1"),
    (POINTS[2], "eager", "bf16-mixed", "sgd", "last:1"),
    ((2, 16, 64, 128, 4, 4, 2, 50), "sdpa", "bf16-mixed", "sgd", "full"),
]


@pytest.mark.parametrize("point,attention,precision,opt,spec", RECOMPUTED,
                         ids=[f"{sp_}-h{p[2]}-k{p[5]}-{at}-{pr}-{o}" for p, at, pr, o, sp_ in RECOMPUTED])
def test_llama_recomputed_exact(point, attention, precision, opt, spec):
    """Hugging Face's gradient checkpointing (``gradient_checkpointing_enable()``, non-reentrant;
    ``last:N``: switched off on the last N layers). A layer's checkpoint keeps its input;
    transformers binds the position ids, the mask and the rotary tables with
    ``functools.partial``, which keeps them without saving them."""
    b, s, h, f, a, k, L, V = point
    cfg, model = hf_llama(point, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # an alias in transformers 5
        enable_checkpointing(model)
    if spec.startswith("last:"):
        for layer in list(model.model.layers)[L - int(spec[5:]):]:
            layer.gradient_checkpointing = False
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", "for-loop", recompute=spec))
    ids = torch.randint(0, V, (b, s))
    assert_hf_step_exact(est, model, ids, precision, opt, b, s)


def test_biases_head_dim_and_tied_head_exact():
    """attention_bias, mlp_bias, a head_dim other than h/a (the symbol d_h) and a tied head."""
    point = (2, 8, 64, 128, 4, 2, 2, 50)
    b, s, h, f, a, k, L, V = point
    cfg, model = hf_llama(point, "eager", attention_bias=True, mlp_bias=True, head_dim=24, tie_word_embeddings=True)
    g = graph_of(cfg)
    est = sm.estimate(g, sm.Policy("fp32", "adamw", "cpu", "for-loop"))
    assert sm.symbols.d_h in est.components["activations"].free_symbols
    assert est.at(b=b, s=s).bytes["params"] == param_bytes(model)
    assert_hf_step_exact(est, model, torch.randint(0, V, (b, s)), "fp32", "adamw", b, s)


# ----------------------------------------------------------------------------- presets

#: parameters of Meta's checkpoints, as transformers counts them (sum of numel over
#: LlamaForCausalLM's parameters) and as the model cards publish them
PUBLISHED = {
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    """Llama 2 7B: embeddings and head 2*32000*4096 = 262,144,000, 32 layers of
    4*4096^2 + 3*4096*11008 + 2*4096 = 202,383,360, the final norm 4096: 6,738,415,616."""
    est = sm.estimate(name, sm.Policy("fp32", "sgd"))
    assert est.at(b=1, s=128).bytes["params"] == 4 * PUBLISHED[name]


def test_preset_counts_match_transformers():
    """The preset's config built by transformers on the meta device: the same count."""
    cfg = sm.models.PRESETS["llama-2-7b"]
    hf = transformers.LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                  num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                                  num_key_value_heads=cfg.kv_heads, vocab_size=cfg.vocab_size)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED["llama-2-7b"]


def test_hugging_face_ids_offline():
    assert sm.models.preset("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert sm.models.preset("META-LLAMA/LLAMA-3.1-8B").name == "llama-3.1-8b"


def test_config_json_and_symbols(tmp_path):
    """A config.json as Meta ships it: the formula keeps k (kv heads) and f; L stays a symbol."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                                "max_position_embeddings": 8192, "rope_scaling": None, "torch_dtype": "bfloat16",
                                "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000,
                                "eos_token_id": 128001, "hidden_act": "silu", "tie_word_embeddings": False}))
    est = sm.estimate(sm.models.from_hf_config(path), sm.Policy("bf16-mixed", "adamw"))
    free = est.components["activations"].free_symbols
    assert {sm.symbols.k, sm.symbols.f, sm.symbols.L} <= free
    assert est.at(b=1, s=128).bytes["params"] == 4 * PUBLISHED["llama-3-8b"]
    # per layer q and o (h^2 each), k and v (h*k*d = h^2 k/a each), gate, up, down (3fh), two
    # norms (2h); the embeddings and the untied head (2Vh) and the final norm (h)
    B_w, V, h, f, a, k, L = (sm.symbols.B_w, sm.symbols.V, sm.symbols.h, sm.symbols.f, sm.symbols.a,
                             sm.symbols.k, sm.symbols.L)
    expected = B_w * (2 * V * h + h + L * (2 * h**2 + 2 * h**2 * k / a + 3 * f * h + 2 * h))
    assert sp.expand(est.components["params"] - expected) == 0


@pytest.mark.parametrize("changes,words", [
    ({"num_key_value_heads": 3}, "num_key_value_heads = 3 is not valid: expected a divisor of the number of "
                                 "attention heads (4)"),
    ({"hidden_size": 30}, "hidden_size = 30 is not valid: expected a multiple of the number of attention heads (4)"),
    ({"hidden_act": "gelu"}, "unknown hidden_act 'gelu'"),
    ({"attention_dropout": 1.5}, "attention_dropout = 1.5 is not valid"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing = True is not valid"),
])
def test_bad_llama_config_is_refused(changes, words):
    base = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100}
    with pytest.raises((ConfigError, UnknownName)) as e:
        sm.models.from_hf_config({**base, **changes})
    assert words in str(e.value)


@pytest.mark.parametrize("precision,attention", [("fp32", "eager"), ("bf16", "sdpa"), ("bf16-mixed", "sdpa")])
def test_llama_lora_exact(precision, attention):
    """peft's default targets for Llama (q_proj, v_proj) at rank 4, every other weight frozen:
    the frozen norms save only what x's gradient needs, and the first layer's norm, whose
    input (the frozen embedding's output) needs none, saves nothing."""
    peft = pytest.importorskip("peft")
    point = POINTS[1]
    b, s, h, f, a, k, L, V = point
    cfg, model = hf_llama(point, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0))
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "adamw", "cpu", "for-loop", lora=4))
    ev = est.at(b=b, s=s)
    assert ev.bytes["params"] == param_bytes(model)
    ids = torch.randint(0, V, (b, s))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert_hf_step_exact(est, model, ids, precision, "adamw", b, s, params=trainable)


# ----------------------------------------------------------------------------- Mistral, Qwen2

KIN = [
    # family, point, attention, precision, optimizer
    ("mistral", POINTS[1], "sdpa", "bf16", "adamw"),
    ("mistral", POINTS[0], "eager", "bf16-mixed", "sgd"),
    ("qwen2", POINTS[1], "eager", "fp32", "sgd"),
    ("qwen2", POINTS[2], "sdpa", "bf16-mixed", "adamw"),
]


@pytest.mark.parametrize("family,point,attention,precision,opt", KIN,
                         ids=[f"{fam}-h{p[2]}-k{p[5]}-{at}-{pr}-{o}" for fam, p, at, pr, o in KIN])
def test_mistral_and_qwen2_exact(family, point, attention, precision, opt):
    """Mistral (no biases, a sliding window of 64 beyond the sequence) and Qwen2 (q, k, v
    biases) as transformers builds them: parameters, saved bytes and the whole step exact."""
    b, s, h, f, a, k, L, V = point
    torch.manual_seed(0)
    common = dict(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=k,
                  num_hidden_layers=L, vocab_size=V, attn_implementation=attention, use_cache=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if family == "mistral":
        cfg = transformers.MistralConfig(sliding_window=64, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    model.train()
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", "for-loop"))
    ev = est.at(b=b, s=s)
    assert ev.bytes["params"] == param_bytes(model)
    ids = torch.randint(0, V, (b, s))
    assert_hf_step_exact(est, model, ids, precision, opt, b, s)


@pytest.mark.parametrize("name,count", [("mistral-7b", 7_241_732_096), ("mistral-7b-v0.3", 7_248_023_552),
                                        ("qwen2-0.5b", 494_032_768), ("qwen2-7b", 7_615_616_512),
                                        ("qwen2-72b", 72_706_203_648)])
def test_mistral_and_qwen2_preset_counts(name, count):
    """Qwen2 7B: embeddings and head 2*152064*3584 = 1,089,994,752; 28 layers of q and o
    (2*3584^2), k and v (2*3584*512), their biases (3584 + 2*512), the MLP (3*3584*18944) and
    two norms: 233,057,792 each; the final norm 3584: 7,615,616,512."""
    assert sm.estimate(name, sm.Policy("fp32", "sgd")).at(b=1, s=128).bytes["params"] == 4 * count


def test_a_sequence_from_the_sliding_window_on_is_its_own_region_with_sdpa():
    """Mistral 7B v0.1's window is 4096 tokens: from s = 4096 on transformers materialises the
    window's mask for SDPA (a float copy saved, k and v repeated), the estimate's past_window
    region, which ``at`` uses by itself (measured in tests/test_window_measured.py); eager
    attention builds the same mask either way."""
    est = sm.estimate("mistral-7b", sm.Policy("bf16-mixed"))
    assert est.at(b=1, s=4096).peak > est.at(b=1, s=4095).peak
    assert est.at(b=1, s=4096).bytes == est.past_window.at(b=1, s=4096).bytes
    with pytest.raises(sm.errors.SymmemError) as e:
        est.check(est._subs({"b": 1}) | {sm.symbols.s: 4096})
    assert "sliding window (4096)" in str(e.value) and "past_window" in str(e.value)
    assert sm.estimate("mistral-7b", sm.Policy("bf16-mixed", attention="eager")).at(b=1, s=8192).peak > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_mistral_eager_beyond_its_window_exact(precision):
    """A window of 8 under a sequence of 16, grouped-query, eager: transformers' mask is the same
    (2, 1, 16, 16) float tensor as the causal one, with the window's values; the whole step exact."""
    b, s, h, f, a, k, L, V = POINTS[0][:5] + (2,) + POINTS[0][6:]
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=k,
                                     num_hidden_layers=L, vocab_size=V, attn_implementation="eager", use_cache=False,
                                     sliding_window=8, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = transformers.MistralForCausalLM(cfg)
    model.train()
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "adamw", "cpu", "for-loop"))
    ids = torch.randint(0, V, (b, s))
    assert_hf_step_exact(est, model, ids, precision, "adamw", b, s)


# ----------------------------------------------------------------------------- Qwen2's sliding window

def hf_qwen2(m, attention, L=3, window=8, k=2, h=32, f=64, a=4, V=100, **extra):
    """Qwen2 with ``use_sliding_window``: layers m to L - 1 slide (``max_window_layers`` m)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=k,
                                   num_hidden_layers=L, vocab_size=V, attn_implementation=attention, use_cache=False,
                                   use_sliding_window=True, sliding_window=window, max_window_layers=m,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=None, **extra)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.train()
    return cfg, model


WINDOWED = [
    # max_window_layers (of L = 3), attention, s (window 8), precision, optimizer
    (0, "eager", 16, "fp32", "adamw"),         # every layer slides; eager beyond the window
    (0, "eager", 16, "bf16-mixed", "sgd"),
    (1, "eager", 16, "fp32", "sgd"),           # mixed: one full layer, two sliding ones
    (1, "eager", 12, "bf16-mixed", "adamw"),
    (2, "eager", 16, "bf16", "sgd"),
    (0, "sdpa", 7, "fp32", "sgd"),             # SDPA below the window: is_causal, no mask
    (1, "sdpa", 7, "bf16-mixed", "adamw"),
    (0, "sdpa", 12, "fp32", "sgd"),            # SDPA from the window on (past_window)
    (1, "sdpa", 8, "fp32", "adamw"),
    (2, "sdpa", 12, "bf16-mixed", "sgd"),
]


@pytest.mark.parametrize("m,attention,s,precision,opt", WINDOWED,
                         ids=[f"m{c[0]}-{c[1]}-s{c[2]}-{c[3]}-{c[4]}" for c in WINDOWED])
def test_qwen2_sliding_window_exact(m, attention, s, precision, opt):
    """Qwen2's use_sliding_window with every layer sliding (max_window_layers 0) and mixed
    layers (1 or 2 full ones first, the block split there): parameters, saved bytes and the
    whole step exact, eager beyond the window and SDPA on either side of it (from s = 8 on,
    the sliding layers get the window's boolean mask and the full ones keep is_causal)."""
    b = 2
    cfg, model = hf_qwen2(m, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", "for-loop"))
    part = est.past_window if s >= 8 else est
    assert (part is est) == (attention == "eager" or s < 8)
    assert est.at(b=b, s=s).bytes == part.at(b=b, s=s).bytes
    assert est.at(b=b, s=s).bytes["params"] == param_bytes(model)
    assert_hf_step_exact(part, model, torch.randint(0, 100, (b, s)), precision, opt, b, s)


def test_qwen2_two_eager_masks_exact():
    """A long sequence, a narrow MLP and a tiny vocabulary, so that the forward's maximum sits
    in the last layer's attention, where eager's two masks are alive (create_causal_mask's and
    the window's, 2 * 1 * 48 * 48 * 4 = 18,432 bytes each in float32): measured exact, and one
    mask's bytes above the same model without sliding layers (max_window_layers = L), whose
    estimate is plain Qwen2's."""
    b, s = 2, 48
    cfg, model = hf_qwen2(0, "eager", L=2, window=40, h=32, f=16, V=8)
    est = sm.estimate(graph_of(cfg), sm.Policy("fp32", "sgd", "cpu", "for-loop"))
    assert_hf_step_exact(est, model, torch.randint(0, 8, (b, s)), "fp32", "sgd", b, s)
    plain_cfg, _ = hf_qwen2(2, "eager", L=2, window=40, h=32, f=16, V=8)
    plain = sm.estimate(graph_of(plain_cfg), sm.Policy("fp32", "sgd", "cpu", "for-loop"))


    def forward_max(e):
        subs = e._subs({"b": b, "s": s})
        return max(int(p.total.xreplace(subs)) for p in e.timeline if p.phase == "forward")
    assert forward_max(est) - forward_max(plain) == 2 * 48 * 48 * 4


def test_qwen2_without_sliding_layers_is_plain_qwen2():
    """use_sliding_window with max_window_layers >= L (transformers' default 28 over 3 layers),
    with layer_types all full_attention or with sliding_window null (Qwen2Config then makes every
    layer full_attention), and max_window_layers without use_sliding_window: no sliding layer,
    no window's mask; the same
    graph's formulas as without use_sliding_window, under eager and SDPA."""
    base = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    for attention in ("eager", "sdpa"):
        policy = sm.Policy("bf16-mixed", "adamw", "cpu", attention=attention)
        plain = sm.estimate(sm.models.from_hf_config(base), policy)
        for extra in ({"use_sliding_window": True, "sliding_window": 8},
                      {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
                      {"use_sliding_window": True, "layer_types": ["full_attention"] * 3},
                      {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
                      {"use_sliding_window": False, "max_window_layers": 0}):
            est = sm.estimate(sm.models.from_hf_config({**base, **extra}), policy)
            assert est.totals == plain.totals and est.past_window is est
    # with sliding layers the formulas differ (eager: the window's mask beside the full one)
    eager = sm.Policy("fp32", "sgd", "cpu", attention="eager")
    slid = sm.estimate(sm.models.from_hf_config({**base, "use_sliding_window": True, "sliding_window": 8,
                                                 "max_window_layers": 0}), eager)
    assert slid.totals != sm.estimate(sm.models.from_hf_config(base), eager).totals


def test_qwen2_layer_types_as_max_window_layers():
    """An explicit layer_types, as Qwen2Config.to_dict() writes it, gives the same graph as the
    max_window_layers it stands for."""
    base = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "use_sliding_window": True,
            "sliding_window": 8}
    kinds = ["full_attention", "sliding_attention", "sliding_attention"]
    policy = sm.Policy("fp32", "sgd", "cpu", attention="sdpa")
    a_ = sm.estimate(sm.models.from_hf_config({**base, "layer_types": kinds, "max_window_layers": 28}), policy)
    b_ = sm.estimate(sm.models.from_hf_config({**base, "max_window_layers": 1}), policy)
    assert a_.totals == b_.totals and a_.past_window.totals == b_.past_window.totals


@pytest.mark.parametrize("changes,words", [
    ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     "expected full_attention layers first, then sliding_attention ones (the pattern max_window_layers gives). "
     "symmem models one split of the layers"),
    ({"layer_types": ["full_attention", "sliding_attention"]},
     "expected 3 entries (num_hidden_layers), each full_attention or sliding_attention"),
    ({"use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
     "expected full_attention only without a sliding window"),
    ({"sliding_window": None, "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
     "expected full_attention only without a sliding window (use_sliding_window true and a sliding_window)"),
    ({"max_window_layers": -1}, "max_window_layers = -1 is not valid: expected a whole number of layers, 0 or more"),
    ({"use_sliding_window": "yes"}, "use_sliding_window = 'yes' is not valid: expected true or false"),
])
def test_bad_qwen2_window_config_is_refused(changes, words):
    base = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "use_sliding_window": True,
            "sliding_window": 8, "max_window_layers": 1}
    with pytest.raises(ConfigError) as e:
        sm.models.from_hf_config({**base, **changes})
    assert words in str(e.value)


def test_qwen2_mixed_layers_refuse_ranges_and_stages():
    """Mixed layers (two blocks): recompute modes other than full (layer ranges, groups of
    layers) and pipeline stages are refused with what to do; all-sliding layers take them."""
    base = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "use_sliding_window": True,
            "sliding_window": 8}
    mixed = sm.models.from_hf_config({**base, "max_window_layers": 1})
    for spec in ("last:1", "last:2", "every:2", "nth:2", "selective"):
        with pytest.raises(ConfigError) as e:
            sm.estimate(mixed, sm.Policy("fp32", "sgd", "cpu", recompute=spec))
        assert (f"recompute = '{spec}' is not valid: expected full or none for 'qwen2': its first 1 layers attend "
                "to every position and the others through a sliding window") in str(e.value)
        assert "Use --recompute full" in str(e.value)
    with pytest.raises(ConfigError) as e:
        sm.estimate(mixed, sm.Policy("fp32", "sgd", "cpu", parallel="pp=2"))
    assert "pp = 2 is not valid: expected 1 for qwen2: stages are cut from one repeated block" in str(e.value)
    slid = sm.models.from_hf_config({**base, "max_window_layers": 0})
    for spec in ("last:1", "every:2", "selective"):
        assert sm.estimate(slid, sm.Policy("fp32", "sgd", "cpu", recompute=spec)).at(b=2, s=4).peak > 0


RECOMPUTED_WINDOW = [
    # max_window_layers (of L = 3), attention, s (window 8), precision
    (0, "eager", 12, "fp32"),
    (0, "sdpa", 12, "bf16-mixed"),
    (0, "sdpa", 7, "fp32"),
    (1, "eager", 16, "fp32"),          # mixed: each layer's checkpoint keeps its own mask
    (1, "sdpa", 12, "bf16-mixed"),     # the sliding layers' boolean mask; the full ones none
    (2, "eager", 12, "bf16-mixed"),
]


@pytest.mark.parametrize("m,attention,s,precision", RECOMPUTED_WINDOW,
                         ids=[f"m{c[0]}-{c[1]}-s{c[2]}-{c[3]}" for c in RECOMPUTED_WINDOW])
def test_qwen2_sliding_window_recomputed_exact(m, attention, s, precision):
    """Every layer checkpointed (transformers' gradient checkpointing): each layer's checkpoint
    keeps the mask it was given (its keyword argument: the window's for a sliding layer, SDPA's
    boolean one from the window on; create_causal_mask's for a full one) until its backward; a
    mask no layer is given (every layer sliding: the full one) dies with the forward."""
    b = 2
    cfg, model = hf_qwen2(m, attention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_checkpointing(model)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "sgd", "cpu", "for-loop", recompute="full"))
    part = est.past_window if s >= 8 else est
    assert_hf_step_exact(part, model, torch.randint(0, 100, (b, s)), precision, "sgd", b, s)
