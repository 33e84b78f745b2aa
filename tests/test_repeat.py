"""A block repeated n times is analysed once; it must agree exactly with the unrolled graph."""
import random

import pytest
import sympy as sp

import symmem as sm
from symmem.symbols import L, V, a, b, h, s, s_max

CFG = sm.models.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=500, n_positions=64)
POLICIES = [sm.Policy("fp32", "adamw", "cpu"), sm.Policy("bf16-mixed", "adam", "cuda"),
            sm.Policy("fp32", "sgd-momentum", "cuda", "fused")]


@pytest.fixture(scope="module")
def graphs():
    g = sm.models.build_gpt2(CFG)
    return g, g.unrolled()


_CACHE = {}


def estimates(graphs, policy):
    if policy not in _CACHE:
        g, u = graphs
        _CACHE[policy] = sm.estimate(g, policy), sm.estimate(u, policy)
    return _CACHE[policy]


def test_unrolled_graph_has_three_copies(graphs):
    g, u = graphs
    names = [n.name for n in u.items]
    assert "h.0/ln_1" in names and "h.2/mlp/residual" in names and "h.3/ln_1" not in names
    # the same parameters, spelled per layer: 12 tensors per layer, 4 outside (wte, wpe, ln_f w, b)
    assert len(u.params()) == 4 + 12 * 3
    assert sp.expand(u.param_count() - g.param_count().subs(L, 3)) == 0


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.precision}-{p.optimizer}-{p.device}")
def test_components_equal_symbolically(graphs, policy):
    rep, unr = estimates(graphs, policy)
    for name, expr in rep.components.items():
        assert sp.expand(expr.subs(L, 3) - unr.components[name]) == 0, name


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.precision}-{p.optimizer}-{p.device}")
def test_peak_equal_at_random_points(graphs, policy):
    rep, unr = estimates(graphs, policy)
    rng = random.Random(0)
    for _ in range(40):
        heads = rng.choice([1, 2, 4, 8])
        vals = {b: rng.randint(1, 64), s: rng.randint(1, 8192), a: heads,
                h: heads * rng.randint(1, 256), V: rng.randint(2, 200_000), s_max: 64,
                **policy.bindings()}
        assert rep.peak.xreplace({**vals, L: 3}) == unr.peak.xreplace(vals), vals


def test_deriving_does_not_unroll():
    """L stays a symbol: the graph holds one body whatever the layer count."""
    small = sm.models.build_gpt2(sm.models.GPT2Config(n_layer=2))
    big = sm.models.build_gpt2(sm.models.GPT2Config(n_layer=96))
    assert len(str(small).splitlines()) == len(str(big).splitlines())
    est = sm.estimate(big, sm.Policy())
    assert L in est.components["activations"].free_symbols


def walked_graph(count=L):
    """A block of layers (x -> silu(x)) and a loop over what each layer made (``Graph.recorded``):
    each layer's output softmaxed and summed over the rows into a running (h,) sum, the loss its
    sum."""
    g = sm.Graph("walked", {})
    x = g.input("x", (b, h), dtype="float32", requires_grad=True)
    g.repeat(L, lambda g, x: g.add("silu", x, name="layers/act"), x)
    zero = g.add("index_tensor", shape=(h,), dtype="float32", name="sum0")

    def walk(g, total):
        act = g.recorded("layers", "layers/act", name="walk/act")
        g.output(act)
        rows = g.add("sum_rows", g.add("softmax", act, name="walk/softmax"), name="walk/rows")
        return g.add("add", total, rows, name="walk/total")
    g.add("sum_all", g.repeat(count, walk, zero, name="walk"), name="loss")
    return g


def test_loop_over_recorded_values():
    """Each layer saves silu's input, the loop each layer's softmax (float32, as the input):
    2 L b h 4 for backward; the loop is no block of layers (passes leave it alone)."""
    g = walked_graph()
    assert [r.name for r in g.layer_blocks()] == ["layers"] and g.repeats()[1].loop_of == "layers"
    est = sm.estimate(g, sm.Policy("fp32", "sgd", "cpu"))
    assert sp.expand(est.components["activations"] - 8 * L * b * h) == 0
    # at L = 4, b = 2, h = 8: 2 * 4 * 2 * 8 * 4 = 512 bytes saved
    assert est.at(b=2, s=1, L=4, h=8).bytes["activations"] == 512


def test_recorded_value_checked():
    """``Graph.recorded`` names a value computed in the block's body; a loop over a block's
    layers has its count."""
    g = sm.Graph("toy", {})
    x = g.input("x", (b, h), dtype="float32", requires_grad=True)
    g.repeat(L, lambda g, x: g.add("silu", x, name="layers/act"), x)
    with pytest.raises(sm.ConfigError, match="recorded value = 'layers/in' is not valid"):
        g.repeat(L, lambda g, y: (g.recorded("layers", "layers/in", name="walk/x"), y)[1], x, name="walk")
    with pytest.raises(sm.ConfigError, match="count of repeat 'walk2' = L - 1 is not valid"):
        g.repeat(L - 1, lambda g, y: g.add("add", y, g.recorded("layers", "layers/act", name="walk2/x"),
                                          name="walk2/y"), x, name="walk2")
