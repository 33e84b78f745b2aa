"""Cross-layer weight sharing as ALBERT does it (Lan et al. 2019): Hugging Face's GPT-2 with
one block object in every layer (``transformer.h = ModuleList([block] * L)``), trained one
step on the CPU, against ``graph.with_shared_layers("h")``: the weights once, the
activations L times, the gradients of the L layers summed into one per weight.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import param_bytes, saved_bytes, training_step  # noqa: E402
from helpers import assert_step_exact  # noqa: E402
from test_gpt2_measured import POINTS, graph_of, hf_model, loss_fn, optimizer  # noqa: E402

transformers.logging.set_verbosity_error()

CASES = [(POINTS[0], "fp32", "adamw", "for-loop"), (POINTS[1], "bf16-mixed", "adamw", "for-loop"),
         (POINTS[1], "fp32", "sgd", "foreach"), (POINTS[2], "bf16-mixed", "sgd-momentum", "for-loop")]


def shared_model(point):
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    block = model.transformer.h[0]
    model.transformer.h = torch.nn.ModuleList([block] * L)
    return cfg, model


@pytest.mark.parametrize("point,precision,opt,impl", CASES,
                         ids=[f"b{p[0]}-L{p[4]}-{pr}-{o}-{i}" for p, pr, o, i in CASES])
def test_shared_layers_exact(point, precision, opt, impl):
    b, s, h, a, L, V, P, act = point
    cfg, model = shared_model(point)
    est = sm.estimate(graph_of(cfg).with_shared_layers("h"), sm.Policy(precision, opt, "cpu", impl))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    assert ev.bytes["params"] == param_bytes(model)
    fwd = loss_fn(model, ids, precision)
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, impl, model.parameters()), extra=(ids,))
    assert_step_exact(est, report, b, s)


def test_shared_weights_are_counted_once():
    """GPT-2 small with ALBERT's sharing: 12 layers of 7,087,872 weights become one; the
    activations are the same as without sharing."""
    g = sm.models.preset("gpt2")
    own, shared = sm.estimate(g), sm.estimate(g.with_shared_layers("h"))
    per_layer = 12 * 768**2 + 13 * 768                     # 7,087,872
    assert shared.graph.param_count().xreplace(shared.bindings) == 124_439_808 - 11 * per_layer
    assert own.at(b=2, s=64).bytes["activations"] == shared.at(b=2, s=64).bytes["activations"]
    with pytest.raises(sm.errors.UnknownName, match="unknown repeated block 'layers'"):
        g.with_shared_layers("layers")
