"""Recomputation and gradient accumulation against Hugging Face's own GPT-2, measured on the
CPU: bytes saved for backward, the training step's peak and every phase's maximum, to the
byte. Random weights from configs, eager attention, no download.

How each spec is run in transformers 5:

- ``full``: ``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable()``
  before transformers 5.24), whose default is the non-reentrant
  ``torch.utils.checkpoint`` (``use_reentrant=False``) around every ``GPT2Block``;
  ``full,reentrant``: the same with ``{"use_reentrant": True}``;
- ``nth:N``: ``model.activation_checkpointing_enable(every_n_layers=N)`` (transformers 5.24):
  blocks 0, N, 2N, ... checkpointed;
- ``last:N``: as ``full``, with ``gradient_checkpointing`` switched off on the last N blocks;
  ``Recompute.layers(i, j)``: switched off on every block but i to j - 1;
- ``selective``: ``eager_attention_forward`` (the attention core) wrapped in a checkpoint;
- ``Recompute.nodes("h/mlp.c_fc", "h/mlp/gelu_new")``: each block's ``mlp.act(mlp.c_fc(x))``
  wrapped in a checkpoint (``MLP_IN``).
"""
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import saved_bytes, training_step  # noqa: E402
from symmem.policy import Recompute  # noqa: E402
from helpers import enable_checkpointing  # noqa: E402
from test_gpt2_measured import POINTS, graph_of, hf_model, loss_fn, optimizer  # noqa: E402

transformers.logging.set_verbosity_error()


MLP_IN = Recompute.nodes("h/mlp.c_fc", "h/mlp/gelu_new")
FOUR_LAYERS = (2, 16, 32, 4, 4, 100, 32, "gelu_new")      # POINTS[0] with L = 4


def checkpointed(point, spec, monkeypatch):
    """Hugging Face's GPT-2 at ``point`` with ``spec`` applied (see the module's text)."""
    from transformers.models.gpt2 import modeling_gpt2
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    base, _, variant = str(spec).partition(",")
    reentrant = variant == "reentrant"
    if base == "full" or base.startswith(("last:", "layers(")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)     # an alias in transformers 5
            if reentrant:
                enable_checkpointing(model, use_reentrant=True)
            else:
                enable_checkpointing(model)          # the default: non-reentrant
        if base.startswith("last:"):
            for block in list(model.transformer.h)[L - int(base[5:]):]:
                block.gradient_checkpointing = False
        if base.startswith("layers("):
            start, stop = spec.span
            for i, block in enumerate(model.transformer.h):
                block.gradient_checkpointing = start <= i < (L if stop is None else stop)
    elif base.startswith("nth:"):
        if not hasattr(model, "activation_checkpointing_enable"):
            pytest.skip("every_n_layers needs transformers 5.24")
        model.activation_checkpointing_enable({"use_reentrant": reentrant}, every_n_layers=int(base[4:]))
    elif base.startswith("nodes("):
        assert spec == MLP_IN, spec                    # the one node set this file runs

        def mlp_forward(mlp, x):
            x = torch.utils.checkpoint.checkpoint(lambda x: mlp.act(mlp.c_fc(x)), x, use_reentrant=reentrant)
            return mlp.dropout(mlp.c_proj(x))
        for block in model.transformer.h:
            monkeypatch.setattr(block.mlp, "forward", mlp_forward.__get__(block.mlp))
    elif base == "selective":
        core = modeling_gpt2.eager_attention_forward

        def checkpointed_core(module, q, k, v, mask, **kwargs):
            def fn(q, k, v, mask):
                return core(module, q, k, v, mask, **kwargs)
            return torch.utils.checkpoint.checkpoint(fn, q, k, v, mask, use_reentrant=reentrant)
        monkeypatch.setattr(modeling_gpt2, "eager_attention_forward", checkpointed_core)
    return cfg, model


def measured_against_symmem(point, precision, opt, spec, monkeypatch, accumulate=1):
    b, s, h, a, L, V, P, act = point
    cfg, model = checkpointed(point, spec, monkeypatch)
    est = sm.estimate(graph_of(cfg),
                      sm.Policy(precision, opt, "cpu", recompute=spec, accumulate=accumulate))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, precision)
    saved = saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, "for-loop", model.parameters()),
                           extra=(ids,), accumulate=accumulate)
    subs = est._subs({"b": b, "s": s})
    phases = {ph: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == ph)
              for ph in report.phase_peaks}
    return est, ev, saved, report, phases


CASES = [
    (POINTS[0], "fp32", "adamw", "full"),
    (POINTS[0], "bf16-mixed", "adamw", "full"),
    (POINTS[1], "fp32", "sgd", "full,reentrant"),
    (POINTS[0], "bf16-mixed", "sgd-momentum", "full,reentrant"),
    (POINTS[2], "fp32", "adamw", "last:1"),
    (POINTS[0], "bf16-mixed", "adam", "last:1,reentrant"),
    (POINTS[1], "fp32", "adamw", "selective"),
    (POINTS[0], "bf16-mixed", "sgd", "selective,reentrant"),
    (POINTS[1], "bf16-mixed", "adamw", Recompute.layers(1, 2)),
    (FOUR_LAYERS, "fp32", "adamw", "nth:2"),          # layers 0 and 2 checkpointed
    (FOUR_LAYERS, "bf16-mixed", "sgd", "nth:2,reentrant"),
    (POINTS[1], "fp32", "sgd", "nth:3"),              # layer 0 of 3
    (POINTS[0], "fp32", "adamw", MLP_IN),
]


@pytest.mark.parametrize("point,precision,opt,spec", CASES,
                         ids=[f"{spec}-{pr}-{o}-L{p[4]}" for p, pr, o, spec in CASES])
def test_recomputation_exact(point, precision, opt, spec, monkeypatch):
    est, ev, saved, report, phases = measured_against_symmem(point, precision, opt, spec, monkeypatch)
    assert ev.bytes["activations"] == saved            # what the checkpoints keep
    assert ev.peak == report.peak, (ev.peak_point.where, report.peak_phase, report.peak_op)
    assert ev.peak_point.phase == report.peak_phase
    expected = dict(report.phase_peaks)
    if str(spec).endswith(",reentrant"):
        # Hugging Face passes each checkpointed call (a block, or the attention core) the
        # position_ids (int64, s of them) among its keyword arguments, which the reentrant
        # CheckpointFunction keeps in ctx.run_function until the
        # autograd graph is freed, after the step. No node of the graph reads them, so symmem
        # lets them go with the embedding's backward: 8s bytes fewer in the optimizer step.
        expected["optimizer"] -= 8 * point[1]
    assert phases == expected


def test_hugging_face_default_is_non_reentrant(monkeypatch):
    """gradient_checkpointing_enable() with no arguments is symmem's "full": the reentrant
    variant holds each recomputed block's output until its backward returns, b*s*h*4 bytes
    more at the peak inside the first layer's recomputed backward (fp32, h = 32, b*s = 32),
    and it keeps no Python numbers (it runs forward under no_grad): the 8 bytes of x * scale
    and the 24 of gelu_new's constants that the non-reentrant one keeps for that layer."""
    _, ev, _, default, _ = measured_against_symmem(POINTS[0], "fp32", "sgd", "full", monkeypatch)
    _, ev_re, _, reentrant, _ = measured_against_symmem(POINTS[0], "fp32", "sgd", "full,reentrant",
                                                        monkeypatch)
    assert (ev.peak, ev_re.peak) == (default.peak, reentrant.peak)
    assert reentrant.peak - default.peak == 2 * 16 * 32 * 4 - (8 + 24)


ACCUMULATE = [
    (POINTS[0], "fp32", "adamw", "none", 2),
    (POINTS[1], "fp32", "sgd", "none", 3),
    (POINTS[0], "bf16-mixed", "adamw", "none", 4),
    (POINTS[0], "fp32", "adamw", "full", 2),
    (POINTS[2], "bf16-mixed", "sgd-momentum", "full", 3),
]


@pytest.mark.parametrize("point,precision,opt,spec,k", ACCUMULATE,
                         ids=[f"K{k}-{spec}-{pr}-{o}" for p, pr, o, spec, k in ACCUMULATE])
def test_accumulation_exact(point, precision, opt, spec, k, monkeypatch):
    """K micro-batches then one step (``training_step(..., accumulate=K)``): the peak is in the
    second micro-batch's backward, exactly where symmem puts it."""
    est, ev, saved, report, phases = measured_against_symmem(point, precision, opt, spec, monkeypatch, k)
    assert ev.peak == report.peak, (ev.peak_point.where, report.peak_phase, report.peak_op)
    assert (ev.peak_point.phase, ev.peak_point.micro) == (report.peak_phase, str(report.peak_micro))
    assert phases == report.phase_peaks
