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


# ----- what the zoo needs: buffers, blocks carrying several values, attributes, locals -----

def test_a_buffer_is_a_model_state_without_gradient_or_optimizer_state():
    """A (h,) float32 table added to the embedding (a stand-in for a rotary table):
    4h bytes for the whole step, in its own component and role."""
    g = sm.Graph("buffered", {h: 8, V: 11})
    ids = g.input("ids", (b, s))
    x = g.add("embedding", ids, params=(g.param("emb", (V, h)),), name="embed")
    table = g.buffer("table", (h,))
    assert g.buffers()[0][0].name == "table"
    x = g.add("add", x, table, name="plus")
    x = g.add("log_softmax", g.add("linear", x, params=(g.param("head", (V, h)),), name="head"), name="logp")
    g.add("nll_loss", x, ids, name="loss")
    est = sm.estimate(g, sm.Policy("fp32", "adamw", "cpu"))
    assert sp.expand(est.components["buffers"] - 4 * h) == 0
    assert sp.expand(est.components["grads"] - sm.symbols.B_g * 2 * V * h) == 0     # emb, head only
    assert all(dict(p.parts)["buffers"] == 4 * h for p in est.timeline)


def carry_two(tied=True):
    """A block that carries (x, bias): each layer adds the bias and passes it on unchanged,
    as T5 hands its position bias from layer to layer."""
    g = sm.Graph("two", {h: 8, V: 11})
    ids = g.input("ids", (b, s))
    x = g.add("embedding", ids, params=(g.param("emb", (V, h)),), name="embed")
    bias = g.add("linear", x, params=(g.param("bias_proj", (h, h)),), name="bias")

    def body(gr, xs):
        y, c = xs
        y = gr.add("add", gr.add("layer_norm", y, params=(gr.param("w", (h,)), gr.param("b", (h,))),
                                 name="blk/ln"), c, name="blk/plus")
        return gr.add("relu", y, name="blk/relu"), c

    x, bias_out = g.repeat(L, body, (x, bias), name="blk")
    assert bias_out == "blk.1"
    x = g.add("add", x, bias_out, name="final")
    x = g.add("log_softmax", g.add("linear", x, params=(g.param("head", (V, h)),), name="head"), name="logp")
    g.add("nll_loss", x, ids, name="loss")
    return g


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_a_block_carrying_two_values_equals_its_unrolled_graph(n):
    """The first iteration frees its input (the embedding: layer norm saves it, relu saves
    its own output, but nothing saves the sum of the two), so the formula in L holds from two
    layers on; a one-layer model is derived with L bound, exactly."""
    g = carry_two()
    policy = sm.Policy("fp32", "adamw", "cpu")
    g.bindings[L] = n
    rep = sm.estimate(g, policy)
    assert (L in rep.peak.free_symbols) == (n > 1)
    assert_repeat_matches_unrolled(rep, sm.estimate(g.unrolled(), policy), n)


def test_a_block_must_return_what_it_carries():
    g = sm.Graph("bad", {h: 8})
    x = g.input("x", (b, s, h), dtype="float32", requires_grad=True)
    with pytest.raises(ShapeError, match="the body to return as many values as it receives"):
        g.repeat(L, lambda gr, xs: xs[0], (x, x), name="blk")


def test_scopes_give_their_nodes_attributes():
    g = sm.Graph("scoped", {h: 8})
    x = g.input("x", (b, s, h), dtype="float32", requires_grad=True)
    with g.scope(recompute="attention"):
        y = g.add("relu", x, name="inside")
        with g.scope(precision="fp32"):
            z = g.add("relu", y, name="deeper")
    w = g.add("relu", z, name="outside")
    nodes = {n.name: n for n in g.items}
    assert nodes["inside"].attr("recompute") == "attention" and nodes["inside"].attr("precision") is None
    assert nodes["deeper"].attr("recompute") == "attention" and nodes["deeper"].attr("precision") == "fp32"
    assert nodes[w].attrs == ()


def test_layer_ranges_split_and_group_keep_the_parameters():
    g = tiny()
    g.annotate_layers("layer", 2, None, recompute=True)
    assert g.repeats()[0].layers_with("recompute") == ((2, None, True),)
    split = g.split_layers("layer", [2])
    assert [r.name for r in split.repeats()] == ["layer[:2]", "layer[2:]"]
    assert [r.count for r in split.repeats()] == [2, L - 2]
    assert sp.expand(split.param_count() - g.param_count()) == 0
    assert any(r.lhs == 3 and r.rhs == L for r in split.requirements)      # the last part holds a layer
    grouped = tiny().grouped("layer", 2)
    assert grouped.repeats()[0].count == L / 2
    assert sp.expand(grouped.param_count() - g.param_count()) == 0
    (req,) = [r for r in grouped.requirements if r.kind == "divides"]
    assert str(req.broken({L: 5})) == ("L = 5 is not valid: expected a multiple of 2: the block 'layer' is "
                                       "recomputed 2 layers at a time.")
    for n in (2, 4):
        gg, tt = tiny().grouped("layer", 2), tiny()
        gg.bindings[L] = tt.bindings[L] = n
        policy = sm.Policy("fp32", "sgd", "cpu")
        assert sm.estimate(gg, policy).at(b=3, s=7).peak == sm.estimate(tt, policy).at(b=3, s=7).peak


def test_split_part_outputs_are_its_body_values():
    """A block whose body names its values other than after the block (T5's ``encoder/blocks``
    runs ``encoder/block/...``): each part's outputs are values its own body copy defines
    (they were once the block's name cut off the output's, a name no node had)."""
    from symmem.graph import Graph
    g = Graph("t", {L: 4})
    x = g.input("x", (b, s, 8), dtype="float32", requires_grad=True)

    def body(gb, y):
        return gb.add("gelu", y, name="enc/block/act")
    g.add("gelu", g.repeat(L, body, x, name="enc/blocks"), name="out")
    split = g.split_layers("enc/blocks", [1])
    for rep in split.repeats():
        assert set(rep.output) <= {n.name for n in rep.body.items}
        assert rep.output == (f"{rep.name}/block/act",)
    policy = sm.Policy("fp32", "sgd", "cpu")
    assert sm.estimate(split, policy).at(b=2, s=3).peak == sm.estimate(g, policy).at(b=2, s=3).peak


def test_a_held_local_lives_until_its_node_ran():
    """``scale`` saves no tensor of its input's size, so the embedding dies once scaled;
    held (a Python local) until the head ran, its b*s*h*4 bytes are there at every point
    in between."""
    def build(hold):
        g = sm.Graph("held", {h: 8, V: 11})
        ids = g.input("ids", (b, s))
        x = g.add("embedding", ids, params=(g.param("emb", (V, h)),), name="embed")
        y = g.add("scale", x, name="scaled")
        y = g.add("linear", y, params=(g.param("head", (V, h)),), name="head")
        if hold:
            g.hold("embed", until="head")
        g.add("nll_loss", g.add("log_softmax", y, name="logp"), ids, name="loss")
        return g
    policy = sm.Policy("fp32", "sgd", "cuda")
    free, held = (sm.estimate(build(x), policy) for x in (False, True))
    at = {sm.symbols.b: 2, s: 3, **{k: v for k, v in build(False).bindings.items()}, **policy.bindings()}
    for p, q in zip(free.timeline, held.timeline):
        assert (p.phase, p.node) == (q.phase, q.node)
        extra = int((q.total - p.total).xreplace(at))
        # at "scaled" the embedding is read anyway; held, it is also there while "head" runs
        assert extra == (2 * 3 * 8 * 4 if p.phase == "forward" and p.node == "head" else 0), p.where
    with pytest.raises(ConfigError, match="value to hold = 'nowhere' is not valid"):
        build(False).hold("nowhere", until="head")
