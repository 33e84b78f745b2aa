"""Precisions against Hugging Face's GPT-2 on the CPU: a model cast whole to half precision
(``model.to(torch.bfloat16)``, every role in 2 bytes, torch's optimizers keeping their states
in the parameters' dtype) measured to the byte, beside the float32 and autocast runs of
``tests/test_gpt2_measured.py``.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import param_bytes, saved_bytes, training_step  # noqa: E402
from helpers import assert_step_exact  # noqa: E402
from test_gpt2_measured import POINTS, graph_of, hf_model, optimizer  # noqa: E402

transformers.logging.set_verbosity_error()

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASES = [(POINTS[0], "bf16", "adamw", "for-loop"), (POINTS[1], "bf16", "sgd-momentum", "foreach"),
         (POINTS[2], "fp16", "adam", "foreach"), (POINTS[0], "fp16", "sgd", "for-loop"),
         (POINTS[3], "bf16", "adamw", "fused")]


@pytest.mark.parametrize("point,precision,opt,impl", CASES,
                         ids=[f"b{p[0]}-s{p[1]}-h{p[2]}-{pr}-{o}-{i}" for p, pr, o, i in CASES])
def test_pure_half_precision_exact(point, precision, opt, impl):
    """Parameters, saved activations, the peak, its phase and every phase's maximum."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    model.to(HALF[precision])
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", impl))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    assert ev.bytes["params"] == param_bytes(model)
    assert ev.bytes["activations"] == saved_bytes(lambda: model(ids, labels=ids).loss, exclude=model).total
    report = training_step(model, lambda m: m(ids, labels=ids).loss, optimizer(opt, impl, model.parameters()),
                           extra=(ids,))
    assert_step_exact(est, report, b, s)


def test_half_precision_states_are_half():
    """AdamW on a bf16 model: exp_avg and exp_avg_sq are bf16 (zeros_like the parameter), 2 x 2 bytes
    per parameter, where mixed precision keeps them in float32 (2 x 4)."""
    g = sm.models.preset("gpt2")
    N = 124_439_808
    half = sm.estimate(g, sm.Policy("bf16", "adamw")).at(b=1, s=1024).bytes
    mixed = sm.estimate(g, sm.Policy("bf16-mixed", "adamw")).at(b=1, s=1024).bytes
    assert (half["params"], half["grads"], half["optimizer"]) == (2 * N, 2 * N, 4 * N)
    assert (mixed["params"], mixed["optimizer"]) == (4 * N, 8 * N)
    assert sm.estimate(g, sm.Policy("tf32")).at(b=4, s=512).peak == sm.estimate(g, sm.Policy("fp32")).at(b=4, s=512).peak


SCALED = [(POINTS[0], "sgd", "for-loop", 1), (POINTS[1], "adamw", "foreach", 1), (POINTS[2], "adam", "for-loop", 2)]


@pytest.mark.parametrize("point,opt,impl,k", SCALED, ids=[f"b{p[0]}-{o}-{i}-K{k}" for p, o, i, k in SCALED])
def test_fp16_autocast_with_grad_scaler_exact(point, opt, impl, k):
    """fp16-mixed as torch.amp.GradScaler's documentation runs it: its scale and growth
    tracker (4 + 4 bytes) from the start; the scaled loss and the gradient
    torch.autograd.backward holds for it through backward (4 + 4, the loss's own gradient made
    from it); unscale_'s float64 reciprocal (8 + 8) and found_inf (4), held through the step."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    est = sm.estimate(graph_of(cfg), sm.Policy("fp16-mixed", opt, "cpu", impl, accumulate=k))
    ids = torch.randint(0, V, (b, s))

    def fwd(m):
        with torch.autocast("cpu", dtype=torch.float16):
            return m(ids, labels=ids).loss
    report = training_step(model, fwd, optimizer(opt, impl, model.parameters()), extra=(ids,), accumulate=k,
                           scaler=torch.amp.GradScaler("cpu"))
    assert_step_exact(est, report, b, s)
