"""Mixtral trained with ``output_router_logits: true`` (the load-balancing loss, weighted by
``router_aux_loss_coef``) against Hugging Face's own ``MixtralForCausalLM`` on the CPU: random
weights from small configs, eager and SDPA attention, float32, bfloat16 autocast and a bfloat16
model, K = 1, 2 and 3 = E, b = 1 and b >= 2, two and four layers, SGD and AdamW, full
recomputation; parameters, bytes saved for backward, the step's peak, its phase and every
phase's maximum, to the byte. The router logits each layer records are kept until forward
ends; the loss loops over them (:func:`symmem.models.mixtral.load_balancing_loss`).
"""
import warnings

import pytest
import sympy as sp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError  # noqa: E402
from symmem.measure import param_bytes  # noqa: E402
from helpers import assert_hf_step_exact, enable_checkpointing  # noqa: E402
from test_mixtral_measured import graph_of, hf_mixtral  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, f, a, k, L, V, E, K)
WIDE = (2, 8, 32, 16, 4, 2, 2, 16, 16, 2)        # 16 experts, 16 words: forward's maximum in the loss's loop
DEEP = (2, 16, 32, 16, 4, 4, 4, 400, 8, 2)       # four layers, a large vocabulary: backward's at the head
KONE = (3, 8, 32, 64, 4, 1, 2, 50, 4, 1)         # K = 1, multi-query
BONE = (1, 16, 32, 48, 4, 2, 2, 100, 3, 3)       # b = 1, K = E
BASE = (2, 8, 32, 64, 4, 2, 2, 100, 4, 2)

CASES = [
    # point, attention, precision, optimizer, implementation, where the phase maxima must be
    (WIDE, "eager", "fp32", "adamw", "for-loop", {"forward": "aux/values"}),
    (WIDE, "sdpa", "bf16-mixed", "sgd", "for-loop", {"forward": "aux/router_prob"}),
    (DEEP, "eager", "fp32", "adamw", "foreach", {"forward": "aux/values", "backward": "log_softmax"}),
    (KONE, "eager", "bf16-mixed", "sgd", "for-loop", {}),
    (BONE, "sdpa", "fp32", "adamw", "for-loop", {"forward": "aux/values"}),
    (BASE, "eager", "bf16", "sgd", "for-loop", {}),
]


def aux_model(point, attention, precision):
    cfg, model = hf_mixtral(point, attention, output_router_logits=True)
    if precision == "bf16":
        model.to(torch.bfloat16)
    return cfg, model


def top(est, phase, b, s):
    """The node of ``phase``'s largest point of ``est`` at (b, s)."""
    subs = est._subs({"b": b, "s": s})
    return max((p for p in est.timeline if p.phase == phase), key=lambda p: int(p.total.xreplace(subs))).node


@pytest.mark.parametrize("point,attention,precision,opt,impl,at", CASES,
                         ids=[f"b{p[0]}-L{p[6]}-V{p[7]}-E{p[8]}-K{p[9]}-{at}-{pr}-{o}-{i}"
                              for p, at, pr, o, i, _ in CASES])
def test_mixtral_aux_loss_exact(point, attention, precision, opt, impl, at):
    """Parameters, saved bytes, the peak, its phase and every phase's maximum with the
    load-balancing loss. Where ``at`` says so, the phase's maximum is where the loss's memory
    decides it: in the loop over the layers' logits (forward: the last layer's topk, beside
    every layer's logits and saved softmax and the previous layer's topk values and indices,
    or its float copy's sum), or at the head's backward, while each layer's logits gradient
    from the loss waits for the layer's backward."""
    b, s, h, f, a, k, L, V, E, K = point
    cfg, model = aux_model(point, attention, precision)
    ids = torch.randint(0, V, (b, s))
    with torch.no_grad():
        assert model(ids, labels=ids).aux_loss is not None
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", impl))
    if b == 1:
        est = est.at_one
    assert est.at(b=b, s=s).bytes["params"] == param_bytes(model)
    for phase, node in at.items():
        assert top(est, phase, b, s) == node, phase
    assert_hf_step_exact(est, model, ids, precision, opt, b, s, impl=impl)


RECOMPUTED = [
    (BASE, "eager", "fp32"),
    ((2, 8, 32, 16, 4, 2, 3, 16, 16, 2), "sdpa", "bf16-mixed"),     # three layers: a middle one
]


@pytest.mark.parametrize("point,attention,precision", RECOMPUTED,
                         ids=[f"L{p[6]}-{at}-{pr}" for p, at, pr in RECOMPUTED])
def test_mixtral_aux_loss_recomputed_exact(point, attention, precision):
    """Full recomputation (non-reentrant checkpoints of every layer): the router logits are an
    output of each checkpointed layer that the recorder keeps, so they stay until forward
    ends; the loss's own tensors are outside every checkpoint and saved as usual."""
    b, s, h, f, a, k, L, V, E, K = point
    cfg, model = aux_model(point, attention, precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # an alias in transformers 5
        enable_checkpointing(model)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "sgd", "cpu", "for-loop", recompute="full"))
    assert_hf_step_exact(est, model, torch.randint(0, V, (b, s)), precision, "sgd", b, s)


def test_aux_loss_saved_bytes_pinned_by_hand():
    """What the load-balancing loss saves for backward, beside what the model saves without
    it: each layer's softmax of its router logits, L N E B_a (the logits' dtype: float32, or
    bfloat16 under CPU autocast, which leaves softmax alone); the token fractions the product
    keeps, E 4; and three Python numbers kept as 0-dim tensors on the CPU, 3 x 8 (total_rows,
    a float64, by the division; num_experts, an int64, by the product; router_aux_loss_coef, a
    float64). BASE in float32: L = 2 layers, N = b s = 16 tokens, E = 4:
    2 * 16 * 4 * 4 + 4 * 4 + 24 = 512 + 16 + 24 = 552 bytes."""
    b, s, h, f, a, k, L, V, E, K = BASE
    cfg = graph_of(hf_mixtral(BASE, "eager", output_router_logits=True)[0])
    plain = graph_of(hf_mixtral(BASE, "eager")[0])
    policy = sm.Policy("fp32", "sgd", "cpu")
    with_aux, without = sm.estimate(cfg, policy), sm.estimate(plain, policy)
    diff = sp.expand(with_aux.components["activations"] - without.components["activations"])
    S = sm.symbols
    assert diff == sp.expand(S.L * S.b * S.s * S.E * S.B_a + 4 * S.E + 24)
    assert with_aux.at(b=b, s=s).bytes["activations"] - without.at(b=b, s=s).bytes["activations"] \
        == L * b * s * E * 4 + 4 * E + 24 == 552
    # on CUDA the Python numbers are host memory, and autocast runs softmax in float32
    cuda = sm.estimate(cfg, sm.Policy("bf16-mixed", "sgd")).components["activations"] \
        - sm.estimate(plain, sm.Policy("bf16-mixed", "sgd")).components["activations"]
    assert sp.expand(cuda) == sp.expand(4 * S.L * S.b * S.s * S.E + 4 * S.E)


def test_aux_loss_refused_with_split_layers():
    """A loop over the layers' recorded logits needs the block of layers whole: recomputing a
    range of layers (``last:N``) splits it, which is refused with the fix."""
    cfg = graph_of(hf_mixtral(BASE, "eager", output_router_logits=True)[0])
    with pytest.raises(ConfigError) as e:
        sm.estimate(cfg, sm.Policy("fp32", "sgd", "cpu", recompute="last:1"))
    assert "recorded value = 'layers/mlp.gate' is not valid: expected a value of the block of layers 'layers'" \
        in str(e.value)
    assert "Keep the block of layers whole" in str(e.value)

