"""Attention kernels against Hugging Face's GPT-2 with ``attn_implementation="sdpa"`` on the
CPU: what ``scaled_dot_product_attention`` runs there (its flash kernel without dropout, the
math fallback with it), bytes saved for backward and the training step's peak, exact.

On the CPU, SDPA's flash kernel does not take dropout, so the default GPT-2 (attn_pdrop
0.1) runs the math fallback in training; with ``attn_pdrop=0`` it runs flash. The CUDA
kernels (flash, mem-efficient, cuDNN) cannot run here: ``test_cuda_kernels_documented``
states their layout with the arithmetic.
"""
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import saved_bytes, training_step  # noqa: E402
from helpers import assert_step_exact, enable_checkpointing  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, a, L, V, n_positions, attn_pdrop)
POINTS = [
    (2, 16, 32, 4, 2, 100, 32, 0.1),
    (2, 16, 32, 4, 2, 100, 32, 0.0),
    (3, 24, 48, 6, 2, 300, 32, 0.1),
    (4, 32, 64, 4, 1, 500, 64, 0.0),
    # s^2 terms above everything else: the forward's largest moment is inside the attention
    (2, 128, 32, 4, 1, 50, 128, 0.1),
    (2, 128, 32, 4, 1, 50, 128, 0.0),
]


def hf_model(h, a, L, V, P, pdrop, attn="sdpa"):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=h, n_head=a, n_layer=L, vocab_size=V, n_positions=P,
                                  attn_pdrop=pdrop, attn_implementation=attn, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    return cfg, model


def loss_fn(model, ids, precision):
    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            return model(ids, labels=ids).loss
    return fwd


def ident(p):
    return "b{}-s{}-h{}-a{}-L{}-V{}-p{}".format(*p[:6], p[7])


@pytest.mark.parametrize("point", POINTS, ids=ident)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_sdpa_saved_bytes_exact(point, precision):
    b, s, h, a, L, V, P, pdrop = point
    cfg, model = hf_model(h, a, L, V, P, pdrop)
    est = sm.estimate(sm.models.from_hf_config(cfg.to_dict()), sm.Policy(precision, "sgd", "cpu", attention="sdpa"))
    ids = torch.randint(0, V, (b, s))
    measured = saved_bytes(loss_fn(model, ids, precision), exclude=model)
    assert est.at(b=b, s=s).bytes["activations"] == measured.total


@pytest.mark.parametrize("point", POINTS, ids=ident)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_sdpa_training_step_peak_exact(point, precision):
    b, s, h, a, L, V, P, pdrop = point
    cfg, model = hf_model(h, a, L, V, P, pdrop)
    est = sm.estimate(sm.models.from_hf_config(cfg.to_dict()), sm.Policy(precision, "adamw", "cpu", attention="sdpa"))
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, precision)
    report = training_step(model, lambda m: fwd(), torch.optim.AdamW(model.parameters(), foreach=False),
                           extra=(ids,))
    assert_step_exact(est, report, b, s)


@pytest.mark.parametrize("point", POINTS[:2], ids=ident)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_sdpa_with_full_recomputation_exact(point, precision):
    """Hugging Face's gradient_checkpointing_enable() (non-reentrant) over SDPA: the math
    kernel's held locals and the flash kernel's log-sum-exp are recomputed like any op."""
    b, s, h, a, L, V, P, pdrop = point
    cfg, model = hf_model(h, a, L, V, P, pdrop)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # an alias in transformers 5
        enable_checkpointing(model)
    est = sm.estimate(sm.models.from_hf_config(cfg.to_dict()),
                      sm.Policy(precision, "sgd", "cpu", attention="sdpa", recompute="full"))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, precision)
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), torch.optim.SGD(model.parameters(), lr=0.1, foreach=False),
                           extra=(ids,))
    assert (ev.peak, ev.peak_point.phase) == (report.peak, report.peak_phase), (ev.peak_point.where, report.peak_op)


# ----------------------------------------------------------------------------- CUDA, as documented

def _kernel_footprint(kernel, device="cuda", b=2, a=4, s=100, d=64, dropout=0.1):
    from symmem.rules import Ctx, DType, TensorInfo, get_rule
    from symmem.symbols import B_a
    ctx = Ctx(autocast=True, device=device, act=DType("compute", B_a, 2), act_name="bfloat16")
    x = TensorInfo((b, a, s, d), ctx.act, False)

    class Node:
        name, op, params = "attn", "sdpa_kernel", ()

        def attr(self, key, default=None):
            return {"kernel": kernel, "dropout": dropout}.get(key, default)
    return get_rule("sdpa_kernel")(Node(), [x, x, x], ctx)


def _new_bytes(fp):
    return {sv.label: int(sv.nbytes) for sv in fp.saved if sv.ref == "new"}


def test_cuda_kernels_documented():
    """What each CUDA kernel keeps and its backward scratch, at b=2, a=4, s=100, d=64 (s not a
    multiple of 32 or 128, so every rounding shows). Sources: PyTorch 2.13's
    ``derivatives.yaml`` (the saved tensors), ``_meta_registrations.py`` (their shapes),
    ``flash_api.cpp`` (``mha_fwd``/``mha_bwd``) and ``attention.cu``."""
    flash = _kernel_footprint("flash")
    # q, k, v and the output are the inputs' and output's storages (nothing new);
    # softmax_lse (b, a, s) float32: 4*2*4*100 = 3,200; rng_state (2,) + unused () uint64: 24
    assert _new_bytes(flash) == {"log-sum-exp": 3_200, "RNG state": 24}
    # mha_bwd: dq_accum (b, 128*ceil(s/128), a, 32*ceil(d/32)) float32 = 4*2*128*4*64 = 262,144
    #          softmax_d (b, a, 128*ceil(s/128)) float32 = 4*2*4*128 = 4,096
    assert flash.bwd_temp == 262_144 + 4_096
    assert flash.out.seq_major           # out = empty_like(q) in q's (b, s, a, d) memory
    eff = _kernel_footprint("mem-efficient")
    # log_sumexp (b, a, 32*ceil(s/32)) = 4*2*4*128 = 4,096; philox seed and offset: host tensors
    assert _new_bytes(eff) == {"log-sum-exp": 4_096}
    # delta (b, a, s) float32 = 3,200; the workspace's float32 dQ accumulator (b, a, s, d) = 204,800
    assert eff.bwd_temp == 3_200 + 204_800
    cudnn = _kernel_footprint("cudnn")
    # stats (b, a, s, 1) float32 = 3,200; seed and offset, 0-dim int64 on the GPU: 16
    assert _new_bytes(cudnn) == {"log-sum-exp": 3_200, "RNG state": 16}
    assert cudnn.bwd_temp == 0           # its workspace is sized by cuDNN at run time: not counted
    cpu = _kernel_footprint("flash", device="cpu", dropout=0.0)
    assert _new_bytes(cpu) == {"log-sum-exp": 3_200} and cpu.bwd_temp == 0


@pytest.mark.parametrize("precision,device,p,kernel", [
    ("bf16-mixed", "cuda", 0.1, "flash"), ("fp16-mixed", "cuda", 0.1, "flash"),
    ("fp32", "cuda", 0.1, "mem-efficient"), ("fp32", "cpu", 0.1, "math"), ("fp32", "cpu", 0.0, "flash"),
    ("bf16-mixed", "cpu", 0.1, "math"), ("bf16-mixed", "cpu", 0.0, "flash"),
])
def test_sdpa_picks_its_kernel_per_device(precision, device, p, kernel):
    g = sm.models.build_gpt2(sm.models.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=100,
                                                  n_positions=32, attn_pdrop=p))
    est = sm.estimate(g, sm.Policy(precision, "sgd", device))
    assert est.policy.attention == "sdpa" and est.kernels == (kernel,)
    assert f"attention sdpa ({kernel})" in est.describe()


@pytest.mark.parametrize("h,a,kernel", [(64, 4, "flash"), (1024, 4, "flash"), (2048, 4, "mem-efficient"),
                                        (48, 4, "math")])
def test_sdpa_on_cuda_follows_the_head_dimension(h, a, kernel):
    """d = 16 and 256: flash; 512 > 256: mem-efficient; 12 (not a multiple of 8, which both
    half-precision fused kernels need): math."""
    g = sm.models.build_gpt2(sm.models.GPT2Config(n_embd=h, n_head=a, n_layer=1, vocab_size=100, n_positions=32))
    assert sm.estimate(g, sm.Policy("bf16-mixed", "sgd", "cuda")).kernels == (kernel,)


def test_a_symbolic_head_dimension_becomes_a_requirement():
    from symmem.graph import Graph
    from symmem.symbols import a, b, h, s
    g = Graph("attn")
    x = g.input("x", (b, s, h), dtype="float32", requires_grad=True)
    q, k, v = (g.add("heads", x, heads=a, name=n) for n in "qkv")
    g.add("merge_heads", g.add("attention", q, k, v, dropout=0.0, causal=True, name="core"), name="out")
    est = sm.estimate(g, sm.Policy("bf16-mixed", "sgd", "cuda"))
    reasons = [r.reason for r in est.requirements]
    assert any("up to 256" in r for r in reasons) and any("multiple of 8" in r for r in reasons)
    assert est.at(b=2, s=16, h=64, a=4).peak > 0
    with pytest.raises(sm.errors.ConfigError, match="multiple of 8"):
        est.at(b=2, s=16, h=48, a=4)          # d = 12


@pytest.mark.parametrize("attention,precision,device,words", [
    ("flash", "fp32", "cuda", "flash runs in bfloat16 or float16 only"),
    ("cudnn", "fp32", "cuda", "cudnn runs in bfloat16 or float16 only"),
    ("mem-efficient", "fp32", "cpu", "expected a kernel that runs on cpu (eager, sdpa, flash, math)"),
    ("cudnn", "bf16-mixed", "cpu", "cudnn runs on cuda only"),
    ("flashy", "fp32", "cuda", "unknown attention kernel 'flashy'. Did you mean 'flash'?"),
])
def test_a_kernel_that_cannot_run_is_refused(attention, precision, device, words):
    with pytest.raises((sm.errors.ConfigError, sm.errors.UnknownName)) as e:
        sm.estimate("gpt2", sm.Policy(precision, "sgd", device, attention=attention))
    assert words in str(e.value)


def test_a_head_dimension_a_kernel_cannot_run_is_refused():
    g = sm.models.build_gpt2(sm.models.GPT2Config(n_embd=1024, n_head=4, n_layer=1, vocab_size=100, n_positions=32))
    with pytest.raises(sm.errors.ConfigError) as e:              # d = 256 > cuDNN's 128
        sm.estimate(g, sm.Policy("bf16-mixed", "sgd", "cuda", attention="cudnn"))
    assert str(e.value) == ("attention = 'cudnn' is not valid: expected a kernel that runs head dimension 256. "
                            "cuDNN attention takes head dimensions up to 128 (256 on Hopper with cuDNN 9.10 or "
                            "later); use --attention sdpa to let PyTorch pick.")


def test_eager_keeps_seven_point_nine_gib_more_than_sdpa_on_gpt2():
    """The issue's example: GPT-2 small, b=8, s=1024, bf16 autocast on CUDA (sdpa: flash).
    Per layer eager keeps the softmax output (float32 under CUDA autocast: 4*b*a*s^2), the
    dropout's bool mask (b*a*s^2) and the dropped bf16 probabilities (2*b*a*s^2): 7*b*a*s^2 =
    7 * 8*12*1024^2 = 704,643,072 bytes. Both keep 6*b*s*h of Q, K and V (eager's copies; flash's
    views of c_attn's output) and c_proj's input (eager's merged copy; flash's output, which the
    merge only views). Flash adds its log-sum-exp, 4*b*a*s = 393,216, and 24 bytes of RNG state:
    704,249,832 a layer, 8,450,997,984 for the 12 layers (7.87 GiB)."""
    eager = sm.estimate("gpt2", sm.Policy("bf16-mixed", "adamw", attention="eager")).at(b=8, s=1024)
    sdpa = sm.estimate("gpt2", sm.Policy("bf16-mixed", "adamw")).at(b=8, s=1024)
    diff = eager.bytes["activations"] - sdpa.bytes["activations"]
    assert diff == 12 * (7 * 8 * 12 * 1024**2 - 4 * 8 * 12 * 1024 - 24) == 8_450_997_984
    assert round(diff / 2**30, 2) == 7.87
