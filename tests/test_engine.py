"""The engine's own invariants: pruning, canonical forms, evaluation, the timeline."""
import numpy as np
import pytest
import sympy as sp

import symmem as sm
from symmem.engine import canonical, provably_nonneg
from symmem.symbols import B_a, L, a, b, h, s


@pytest.fixture(scope="module")
def est():
    return sm.estimate(sm.models.preset("gpt2"), sm.Policy("bf16-mixed", "adamw", "cuda"))


def test_provably_nonneg():
    assert provably_nonneg(L - 1)              # L >= 1
    assert provably_nonneg(b * s * h - s)      # b*h >= 1
    assert provably_nonneg(B_a * (h - 1))
    assert not provably_nonneg(L - 2)          # false at L = 1
    assert not provably_nonneg(h**2 - 3 * h + 2)  # >= 0 on integers, but not provable this way: kept
    assert not provably_nonneg(-B_a)


def test_monomials_read_polynomials_and_refuse_the_rest():
    from fractions import Fraction
    from symmem.bounds import monomials
    assert monomials(sp.expand((b + 1)**2), [b]) == {(2,): 1, (1,): 2, (0,): 1}
    assert monomials(b * s / 2 + 3, [b, s]) == {(1, 1): Fraction(1, 2), (0, 0): 3}
    assert monomials(b - b, [b]) == {}
    for e in (1 / b, sp.sqrt(b), sp.Max(b, s), 2**b, sp.pi * b):
        assert monomials(e, [b, s]) is None, e
    assert provably_nonneg((L - 1) / L)        # a ratio: numerator and denominator apart
    assert not provably_nonneg((L - 2) / L)



def test_dominance_table_equals_comparing_every_pair():
    """The pruning's table of which row is >= which (ranks, bit sets) decides every pair as
    comparing their entries does: ties, repeated rows and columns, constant ones, none."""
    from symmem.bounds import _dominance
    rng = np.random.default_rng(0)
    for trial in range(200):
        n, width = int(rng.integers(1, 30)), int(rng.integers(0, 10))
        table = rng.integers(-3, 4, size=(n, width)).astype(float)
        if n > 2 and trial % 3 == 0:
            table[1] = table[0]
        if width > 1 and trial % 5 == 0:
            table[:, 1] = 7 * table[:, 0]
        every = np.array([[bool((table[j] >= table[i]).all()) for i in range(n)] for j in range(n)])
        assert (_dominance(table) == every.reshape(n, n)).all(), table

def test_peak_is_max_of_undominated_points(est):
    peak = est.peak
    assert isinstance(peak, sp.Max)
    # no kept point is provably at most another kept point (equal ones are kept once)
    totals = [sp.expand(p.total) for p in est.points]
    for i, ti in enumerate(totals):
        for j, tj in enumerate(totals):
            if i != j:
                assert not provably_nonneg(tj - ti), (est.points[i].where, est.points[j].where)
    # every dropped timeline point is dominated by some kept point at random configurations
    rng = np.random.default_rng(1)
    f_all = [sp.lambdify([b, s], sp.expand(p.total).xreplace(est.bindings)) for p in est.timeline]
    f_peak = est.evaluator("b", "s")
    bb, ss = rng.integers(1, 64, 200), rng.integers(1, 1025, 200)     # s <= s_max = 1024
    every = np.maximum.reduce([np.broadcast_to(f(bb, ss), bb.shape) for f in f_all])
    assert np.all(every == f_peak(b=bb, s=ss))


def test_canonical_form_groups_by_L_then_b_then_s(est):
    act = est.components["activations"]
    assert act == canonical(act)
    assert sp.expand(act).coeff(L) != 0
    # collected: the top level is a sum whose L-term is L*(...)
    assert any(t.is_Mul and L in t.args for t in act.args)


def test_canonical_is_sympys_collect(est):
    """canonical builds what sympy.collect(expand(e), [L, b, s]) gives, term for term and as
    printed, for every candidate of the peak (L, b and s at the top, bare numbers apart)."""
    exprs = [p.total for p in est.points] + list(est.components.values()) + [3 * L**2 * b + b * s + 7]
    for e in exprs:
        ours, theirs = canonical(e), sp.collect(sp.expand(e), [L, b, s])
        assert ours == theirs and str(ours) == str(theirs)


def test_evaluator_matches_exact(est):
    f = est.evaluator("b", "s")
    for bb, ss in [(1, 1), (8, 1024), (3, 777)]:
        assert int(f(b=bb, s=ss)) == est.at(b=bb, s=ss).peak
    assert f(b=np.array([1, 2]), s=np.array([1024, 1024])).shape == (2,)


def test_evaluator_is_exact_beyond_64_bits(est):
    """Integer inputs give exact integers however large: int64 would wrap at b = 10^16 (the
    peak is about 1.3e25 bytes), so such points are recomputed with exact integers, equal to
    est.at; the int64 points beside them stay as they were."""
    f = est.evaluator("b", "s")
    big = 10**16
    out = f(b=np.array([8, big, 3_037_000_500]), s=np.array([1024, 1024, 1024]))
    assert [int(v) for v in out] == [est.at(b=bb, s=1024).peak for bb in (8, big, 3_037_000_500)]
    assert int(out[1]) > 2**64
    act = est.evaluator("b", "s", component="activations")(b=big, s=1024)
    assert int(act) == est.at(b=big, s=1024).bytes["activations"]


def test_evaluator_checks_values_as_at_does(est):
    """The same errors as est.at: whole numbers >= 1 (2.0 is one), and the model's
    requirements (s <= s_max = 1024 for gpt2), naming the first value that fails;
    check=False evaluates anywhere (a finite difference needs fractional points)."""
    from symmem.errors import ConfigError
    f = est.evaluator("b", "s")
    assert int(f(b=2.0, s=512)) == est.at(b=2, s=512).peak
    for values, message in [({"b": -1, "s": 1024}, "b = -1 is not valid: expected a positive integer."),
                            ({"b": 1.5, "s": 1024}, "b = 1.5 is not valid: expected a positive integer."),
                            ({"b": np.array([1, 2]), "s": np.array([1, 0])}, "s = 0 is not valid"),
                            ({"b": np.nan, "s": 8}, "b = nan is not valid"),
                            ({"b": "x", "s": 8}, "b = 'x' is not valid")]:
        with pytest.raises(ConfigError) as e:
            f(**values)
        assert str(e.value).startswith(message)
    with pytest.raises(ConfigError) as e:
        f(b=np.array([1, 2, 3]), s=np.array([512, 2048, 4096]))
    with pytest.raises(ConfigError) as e_at:
        est.at(b=2, s=2048)
    assert str(e.value) == str(e_at.value)        # the first failing point, worded as est.at words it
    loose = est.evaluator("b", "s", check=False)
    assert loose(b=1.5, s=1024) > loose(b=1, s=1024)


def test_regions_say_which_candidate_binds_where(est):
    """gpt2, bf16-mixed AdamW on CUDA: the log-softmax's backward binds for large b*s, the
    optimizer step (model states and Adam's foreach temporaries) for small: each is the
    exact peak at a point of its region, and the shares add up to 1."""
    regions = est.regions()
    assert [r.point.where for r in regions] == ["backward log_softmax", "optimizer all parameters"]
    assert abs(sum(r.share for r in regions) - 1) < 1e-9
    low, high = regions[1], regions[0]
    at = {**est.bindings, b: 1, s: 1}
    assert int(low.point.total.xreplace(at)) == est.at(b=1, s=1).peak           # b = s = 1: the optimizer
    assert int(high.point.total.xreplace({**at, b: 8, s: 1024})) == est.at(b=8, s=1024).peak
    assert str(high).startswith("backward log_softmax: the peak at")


def test_evaluation_breakdown_adds_up(est):
    ev = est.at(b=8, s=1024)
    assert sum(ev.peak_parts.values()) == ev.peak
    # components at the peak can never exceed the components themselves
    assert ev.peak_parts["params"] == ev.bytes["params"]
    assert "peak during" in ev.table()


def test_timeline_phases_in_order(est):
    phases = [p.phase for p in est.timeline]
    assert phases[0] == "forward" and phases[-1] == "optimizer"
    assert phases.index("backward") > max(i for i, p in enumerate(phases) if p == "forward")


def test_gradients_grow_through_backward(est):
    """Steady state: no gradients during forward; all of them at the optimizer step."""
    fwd = [p for p in est.timeline if p.phase == "forward"]
    assert all(dict(p.parts)["grads"] == 0 for p in fwd)
    opt = [p for p in est.timeline if p.phase == "optimizer"][0]
    assert sp.expand(dict(opt.parts)["grads"] - est.components["grads"]) == 0


def test_cpu_and_cuda_differ_only_where_kernels_do():
    """On the CPU dropout saves a noise tensor in the activation dtype, on CUDA a 1-byte mask;
    the CPU saves 8-byte scalars for ``x * c``, and its layer norm keeps mean and rstd in the
    input's dtype (float32 on CUDA). Everything else is the same."""
    g = sm.models.build_gpt2(sm.models.GPT2Config(activation_function="gelu"))
    cpu = sm.estimate(g, sm.Policy("fp32", "sgd", "cpu", attention="eager")).components["activations"]
    cuda = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", attention="eager")).components["activations"]
    # per layer: 2 dropouts of s*b*h and one of a*s*s*b; plus one of s*b*h before the layers
    masks = (2 * s * b * h + a * s**2 * b) * L + s * b * h
    stats = (2 * L + 1) * 2 * b * s      # 2L + 1 layer norms, mean and rstd per token
    assert sp.expand(cpu - cuda - (masks * (B_a - 1) + 8 * L + stats * (B_a - 4))) == 0
