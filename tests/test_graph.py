"""The graph: tied parameters, repeats, names, the listing and networkx."""
import pytest
import sympy as sp

import symmem as sm
from helpers import assert_repeat_matches_unrolled
from symmem.errors import ConfigError, ShapeError
from symmem.symbols import L, V, b, h, s


def tiny(tied=True):
    g = sm.Graph("tiny", {h: 8, V: 11})
    ids = g.input("ids", (b, s))
    emb = g.param("emb", (V, h))
    x = g.add("embedding", ids, params=(emb,), name="embed")

    def body(gr, y):
        # scale saves no tensor of y's size: the block's input is freed in the first
        # iteration, while later inputs (relu outputs) are saved: iterations differ, exactly
        w = gr.param("w", (h, h))
        y = gr.add("scale", y, name="layer/scale")
        return gr.add("relu", gr.add("linear", y, params=(w,), name="layer/lin"), name="layer/relu")

    x = g.repeat(L, body, x, name="layer")
    head = emb if tied else g.param("head", (V, h))
    x = g.add("linear", x, params=(head,), name="head")
    x = g.add("log_softmax", x, name="logp")
    g.add("nll_loss", x, ids, name="loss")
    return g


def test_tied_weight_counted_once():
    # tied: V*h (emb = head) + L*h*h; untied: 2*V*h + L*h*h
    assert sp.expand(tiny().param_count() - (V * h + L * h**2)) == 0
    assert sp.expand(tiny(tied=False).param_count() - (2 * V * h + L * h**2)) == 0
    est = sm.estimate(tiny(), sm.Policy("fp32", "sgd"))
    assert sp.expand(est.components["grads"] - sm.symbols.B_g * (V * h + L * h**2)) == 0


def test_listing_format():
    lines = str(tiny()).splitlines()
    assert lines[0] == "ids  input  ()  (b, s)"
    assert lines[1] == "embed  embedding  (ids)  (b, s, h)  [emb]"
    assert lines[2] == "layer  repeat x L  (embed)  (b, s, h)"
    assert lines[5] == "    layer/lin  linear  (layer/scale)  (b, s, h)  [w]"


def test_networkx_view():
    G = tiny().to_networkx()
    assert G.nodes["layer"]["op"] == "repeat" and G.nodes["layer"]["count"] == L
    assert ("embed", "layer") in G.edges and ("layer", "head") in G.edges
    body = G.nodes["layer"]["body"]
    assert "layer/lin" in body.nodes


def test_names_and_wiring_errors():
    g = tiny()
    with pytest.raises(ConfigError, match="node name = 'embed' is not valid"):
        g.add("relu", "embed", name="embed")
    with pytest.raises(ConfigError, match="parameter name = 'emb' is not valid: .* Reuse the returned Param"):
        g.param("emb", (h,))
    with pytest.raises(ConfigError, match="repeat count = 0 is not valid"):
        g.repeat(0, lambda gr, y: y, "embed", name="again")
    with pytest.raises(ShapeError, match="the body to return its input's shape"):
        g.repeat(2, lambda gr, y: gr.add("linear", y, params=(gr.param("p", (3, h)),), name="again/p"),
                 "embed", name="again")


def test_unrolled_needs_a_number():
    g = tiny()
    with pytest.raises(ConfigError, match="repeat count = L is not valid: expected a number"):
        g.unrolled()
    g.bindings[L] = 2
    assert [n.name for n in g.unrolled().items if n.op == "linear"] == ["layer.0/lin", "layer.1/lin", "head"]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("policy", [sm.Policy("fp32", "adamw", "cpu"), sm.Policy("bf16-master", "sgd")],
                         ids=["fp32-cpu", "bf16-master"])
def test_tiny_repeat_equals_unrolled(policy, n):
    g = tiny()
    rep = sm.estimate(g, policy)
    g.bindings[L] = n
    assert_repeat_matches_unrolled(rep, sm.estimate(g.unrolled(), policy), n)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_block_that_changes_its_input_dtype_has_a_first_iteration_of_its_own(n):
    """Under autocast the tiny block turns its float32 input (the embedding) into bfloat16
    (the relu of a linear): its first iteration differs from the rest, which repeat alike;
    the formulas hold from two iterations on."""
    g = tiny()
    policy = sm.Policy("bf16-mixed", "adamw")
    est = sm.estimate(g, policy)
    assert any(r.lhs == 2 and r.rhs == L for r in est.requirements)
    g.bindings[L] = n
    assert_repeat_matches_unrolled(est, sm.estimate(g.unrolled(), policy), n)
    with pytest.raises(ConfigError, match="^L = 1 is not valid: expected at least 2: the block 'layer' "
                                          "treats its first iteration differently"):
        est.at(b=1, s=1, L=1)


def test_names_are_unique_across_bodies():
    g = tiny()
    with pytest.raises(ConfigError, match="node name = 'layer/lin' is not valid"):
        g.add("relu", "head", name="layer/lin")
