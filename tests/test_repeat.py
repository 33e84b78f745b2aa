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
