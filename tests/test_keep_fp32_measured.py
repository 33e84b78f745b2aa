"""Modules kept in float32 under autocast (``keep_fp32``) against Hugging Face's GPT-2 on the CPU.

The model runs under ``torch.autocast("cpu", dtype=torch.bfloat16)`` with each kept module's
``forward`` wrapped in ``torch.autocast("cpu", enabled=False)``, as a training script keeps
its output head or its first and last layers in float32: bytes saved for backward and the
whole training step, to the byte.
"""
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError  # noqa: E402
from symmem.measure import saved_bytes, training_step  # noqa: E402
from helpers import assert_step_exact, enable_checkpointing  # noqa: E402
from test_gpt2_measured import POINTS, graph_of, hf_model, loss_fn, optimizer  # noqa: E402

transformers.logging.set_verbosity_error()


def kept_modules(model, keep):
    """The modules of ``model`` that ``keep`` names (symmem's syntax: ``first:N``, ``last:N``,
    a module name in every layer, ``lm_head``/``ln_f`` at the top)."""
    blocks = list(model.transformer.h)
    out = []
    for item in keep:
        if item.startswith("first:"):
            out += blocks[:int(item[6:])]
        elif item.startswith("last:"):
            out += blocks[len(blocks) - int(item[5:]):]
        elif item in ("lm_head", "ln_f"):
            out.append(model.lm_head if item == "lm_head" else model.transformer.ln_f)
        else:
            out += [block.get_submodule(item) for block in blocks]
    return out


def keep_in_fp32(model, keep):
    for module in kept_modules(model, keep):
        module.forward = torch.autocast("cpu", enabled=False)(module.forward)


CASES = [
    # (point, keep, attention, optimizer, implementation, recompute)
    (POINTS[0], ("lm_head",), "eager", "adamw", "for-loop", "none"),
    (POINTS[1], ("first:1", "last:1"), "eager", "sgd", "for-loop", "none"),
    (POINTS[2], ("attn",), "sdpa", "adam", "foreach", "none"),
    (POINTS[1], ("mlp.c_fc", "ln_f"), "sdpa", "adamw", "for-loop", "none"),
    (POINTS[1], ("first:1",), "eager", "adamw", "for-loop", "last:1"),
    (POINTS[3], ("attn.c_attn", "lm_head"), "eager", "sgd-momentum", "foreach", "none"),
]


@pytest.mark.parametrize("point,keep,attention,opt,impl,recompute", CASES,
                         ids=[f"{'+'.join(k)}-{at}-{o}-{i}-rc_{r}" for _, k, at, o, i, r in CASES])
def test_modules_kept_in_float32_exact(point, keep, attention, opt, impl, recompute):
    """Saved bytes, the peak, its phase and every phase's maximum. With ``recompute`` last:1
    (every block but the last checkpointed, Hugging Face's gradient checkpointing) the kept
    first layer is also recomputed in float32: the regions pass splits the block once for both."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    cfg._attn_implementation = model.config._attn_implementation = attention
    keep_in_fp32(model, keep)
    if recompute != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)     # an alias in transformers 5
            enable_checkpointing(model)
        for block in list(model.transformer.h)[L - int(recompute[5:]):]:
            block.gradient_checkpointing = False
    est = sm.estimate(graph_of(cfg), sm.Policy("bf16-mixed", opt, "cpu", impl, recompute=recompute,
                                               keep_fp32=",".join(keep)))
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, "bf16-mixed")
    assert est.at(b=b, s=s).bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, impl, model.parameters()), extra=(ids,))
    assert_step_exact(est, report, b, s)


def test_a_float32_head_saves_no_half_copy():
    """GPT-2 small, b=8, s=1024, bf16-mixed, eager: the output head under autocast saves its
    input in bfloat16 (b*s*h*2 = 8*1024*768*2 = 12,582,912) and the cached bfloat16 copy of
    the tied weight (V*h*2 = 50257*768*2 = 77,194,752); kept in float32 it saves ln_f's float32
    output (b*s*h*4 = 25,165,824; the layer norm saved its input, not its output) and the
    weight itself (a parameter: 0 new bytes): 64,611,840 bytes fewer."""
    g = sm.models.preset("gpt2")
    mixed = sm.estimate(g, sm.Policy("bf16-mixed", attention="eager")).at(b=8, s=1024)
    kept = sm.estimate(g, sm.Policy("bf16-mixed", attention="eager", keep_fp32="lm_head")).at(b=8, s=1024)
    assert mixed.bytes["activations"] - kept.bytes["activations"] == 12_582_912 + 77_194_752 - 25_165_824


@pytest.mark.parametrize("kwargs,words", [
    ({"precision": "bf16", "keep_fp32": "lm_head"},
     "precision with --keep-fp32 = 'bf16' is not valid: expected bf16-mixed or fp16-mixed"),
    ({"precision": "fp32", "keep_fp32": "first:1"}, "expected bf16-mixed or fp16-mixed"),
    ({"precision": "bf16-mixed", "keep_fp32": "first:0"}, "keep_fp32 = 'first:0' is not valid: expected first:N "
                                                           "or last:N with N >= 1 layers"),
    ({"precision": "bf16-mixed", "keep_fp32": "lm_head,,"}, "keep_fp32 = 'lm_head,,' is not valid"),
])
def test_bad_keep_fp32_is_refused(kwargs, words):
    with pytest.raises(ConfigError) as e:
        sm.Policy(**kwargs)
    assert words in str(e.value)


@pytest.mark.parametrize("keep,words", [
    ("q_proj", "keep_fp32 = 'q_proj' is not valid: expected a module of 'gpt2': one of attn.c_attn, attn.c_proj, "
               "lm_head, ln_1, ln_2, ln_f, mlp.c_fc, mlp.c_proj, wpe, wte, or one around them (attn, h, mlp). "
               "Name a module to keep in float32, e.g. lm_head."),
    ("last:13", "keep_fp32 = 'last:13' is not valid: expected at most the 12 layers of block 'h'"),
])
def test_a_module_the_model_lacks_is_refused(keep, words):
    with pytest.raises(ConfigError) as e:
        sm.estimate("gpt2", sm.Policy("bf16-mixed", keep_fp32=keep))
    assert words in str(e.value)
