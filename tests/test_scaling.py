"""symmem.scaling: degrees, leading terms, elasticities, regimes, bytes per parameter, sweeps.

Pinned numbers come with the hand arithmetic beside them. GPT-2 small: h=768, L=12, a=12,
V=50257, s_max=1024, N = 124,439,808 parameters.
"""
import math
import sys

import numpy as np
import pytest
import sympy as sp

import symmem as sm
from symmem import scaling as sc
from symmem.symbols import B_a, B_g, B_m, B_o, B_w, L, V, a, b, h, s, s_max

N_GPT2 = 124_439_808


@pytest.fixture(scope="module")
def est():
    """GPT-2 small, fp32 AdamW on CUDA (foreach): B_w = B_g = B_o = B_a = 4, no master copy."""
    return sm.estimate(sm.models.preset("gpt2"), sm.Policy("fp32", "adamw", attention="eager"))


@pytest.fixture(scope="module")
def est_master():
    """GPT-2 small, bf16 weights with fp32 master weights and Adam: 2 + 2 + 4 + 4 + 4."""
    return sm.estimate(sm.models.preset("gpt2"), sm.Policy("bf16-master", "adam", attention="eager"))


@pytest.fixture(scope="module")
def tiny():
    """h=8, L=1, a=2, V=16, s_max=8, fp32 AdamW on CUDA."""
    cfg = sm.models.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=8)
    return sm.estimate(sm.models.build_gpt2(cfg), sm.Policy("fp32", "adamw", attention="eager"))


# --------------------------------------------------------------------------- orders

def test_orders_of_activations(est):
    """Explicit attention saves a*s^2*b-sized tensors: order 2 in s, 1 in b; the logits
    (b*s*V) make V appear with order 1; nothing saved is h^2 (that is the weights)."""
    act = est.components["activations"]
    assert sc.order(act, s) == 2
    assert sc.order(act, "b") == 1
    assert sc.orders(act) == {b: 1, s: 2, h: 1, a: 1, L: 1, V: 1}


def test_orders_of_peak(est):
    """The peak (a Max) has the largest degree of its candidates: h^2 from the weights,
    s^2 from attention, s_max from the position embedding (an Estimate stands for its peak)."""
    assert sc.orders(est.peak) == {b: 1, s: 2, h: 2, a: 1, L: 1, V: 1, s_max: 1}
    assert sc.orders(est) == sc.orders(est.peak)
    assert sc.order(est, h) == 2


def test_order_of_constants_and_ratios():
    assert sc.order(sp.Integer(0), b) == 0
    assert sc.order(7 * h, b) == 0
    assert sc.orders(sp.Integer(3)) == {}
    assert sc.order((b**3 + 1) / (b + 2), b) == 2          # 3 - 1


def test_unknown_symbol_name(est):
    with pytest.raises(sm.UnknownName, match="Did you mean 's'"):
        sc.order(est, "sq")


# --------------------------------------------------------------------------- leading terms

def test_leading_term_of_activations_in_s_is_korthikanti(est, est_master):
    """Per layer the a*s^2*b terms are the softmax output and the dropout output in B_a bytes
    and the 1-byte dropout mask on CUDA: (2*B_a + 1)*a*s^2*b, times L. With B_a = 2 that is
    Korthikanti's 5*a*s/h * s*b*h = 5*a*s^2*b per layer."""
    for e in (est, est_master):
        lt = sc.leading_term(e.components["activations"], s)
        assert sp.expand(lt - L * (2 * B_a + 1) * a * b * s**2) == 0
    assert sp.expand(lt.xreplace({B_a: 2}) - 5 * L * a * b * s**2) == 0


def test_leading_term_of_peak_in_s(est):
    """The peak's s^2 term: during the backward of the context matmul of the last layer all L
    layers' attention tensors are saved, (2*B_a + 1)*a*b*s^2 each, and the gradient of the
    attention probabilities adds B_a*a*b*s^2 once."""
    lt = sc.leading_term(est, s)
    assert not isinstance(lt, sp.Max)
    assert sp.expand(lt - (L * (2 * B_a + 1) + B_a) * a * b * s**2) == 0


def test_leading_term_of_peak_in_h(est):
    """As h grows the optimizer step peaks: per layer 12*h^2 elements of weights (B_w),
    gradients (B_g), two Adam states and foreach's one temporary of every parameter
    (3*B_o). Priced fp32: 12*(4 + 4 + 3*4) = 240 bytes * L*h^2."""
    lt = sc.leading_term(est, h)
    assert sp.expand(lt - 12 * L * h**2 * (B_w + B_g + 3 * B_o)) == 0
    assert sp.expand(lt.xreplace(est.policy.bindings()) - 240 * L * h**2) == 0


def test_leading_term_of_max_prunes_and_keeps():
    # degree 2 candidates: 3b^2 and 2b^2; 3b^2 >= 2b^2 provably, b + 100 is of lower degree
    assert sc.leading_term(sp.Max(3 * b**2 + b, 2 * b**2 + 5, b + 100, evaluate=False), b) == 3 * b**2
    # V*b and 9*h*b: neither is provably larger, both stay
    lt = sc.leading_term(sp.Max(V * b + 1, 9 * h * b, evaluate=False), b)
    assert isinstance(lt, sp.Max) and set(lt.args) == {V * b, 9 * h * b}
    # the peak's leading terms in b: a Max of a few candidates, each b*(...)
    assert sc.order(sp.Integer(5), s) == 0 and sc.leading_term(h + 1, s) == h + 1


# --------------------------------------------------------------------------- elasticity

def test_elasticity_by_hand(tiny):
    """Tiny model, fp32 (B_a = 4), b = 1, s = 4. Activations = b*P + Q with
    per layer: 2*B_a*a*b*s^2 = 2*4*2*16 = 256, 28*B_a*b*h*s = 28*4*8*4 = 3584, a*b*s^2 = 32,
    2*b*h*s = 64, 16*b*s = 64 -> 4000; outside the layers: B_a*V*s = 256, 2*B_a*h*s = 256,
    h*s = 32, 24*s = 96 -> 640. P = 4640, Q = 8*s + 4 = 36, M = 4676.
    E = b*P / M = 4640/4676 = 1160/1169, exact; at b = 3: 13920/13956 = 3480/3489. (The step
    at b = 1 itself keeps the padded labels, s + 1 int64: 8 bytes more, 4684; the elasticity is
    the formula's, in b.)"""
    assert tiny.components["activations"].xreplace({**tiny.bindings, b: 1, s: 4}) == 4676
    assert tiny.at(b=1, s=4).bytes["activations"] == 4684
    e = sc.elasticity(tiny, b, {"b": 1, "s": 4}, component="activations")
    assert e == sp.Rational(1160, 1169) and isinstance(e, sp.Rational)
    assert sc.elasticity(tiny, "b", {"b": 3, "s": 4}, component="activations") == sp.Rational(3480, 3489)


def test_elasticity_is_one_for_the_part_proportional_to_b(est):
    """Activations = b*P + Q with P, Q free of b: b*P alone has elasticity exactly 1."""
    act = est.components["activations"]
    prop = sp.expand(act - act.xreplace({b: 0}))
    values = {**{k.name: v for k, v in est.bindings.items()}, "b": 5, "s": 300}
    assert sc.elasticity(prop, b, values) == 1
    assert sc.elasticity(act, b, values) < 1


def test_elasticity_of_formulas():
    # 3*b^2*s + 5 at b = s = 1: b * 6*b*s / 8 = 6/8
    assert sc.elasticity(3 * b**2 * s + 5, "b", {"b": 1, "s": 1}) == sp.Rational(3, 4)
    m = sp.Max(b**2, 10 * b, evaluate=False)
    assert sc.elasticity(m, b, {"b": 2}) == 1          # 10*b = 20 > 4
    assert sc.elasticity(m, b, {"b": 20}) == 2         # 400 > 200
    assert sc.elasticity(m, b, {"b": 10}) == 2         # tie 100 = 100: the faster one
    assert isinstance(sc.elasticity(b**2 + 1, b, {"b": 2.0}), float)
    with pytest.raises(sm.ConfigError, match="s"):
        sc.elasticity(b * s, b, {"b": 2})


def test_peak_elasticity_follows_the_peak_candidate(est):
    """At b = 1, s = 128 the peak is the optimizer step: 20N + 4 (the loss) + 8bs (the input
    ids, on the device for the whole step), so d ln M / d ln b = 8bs / M = 1024 / 2,488,797,188
    exactly. At b = 8 the peak is in backward and grows with b, but less than proportionally."""
    assert est.at(b=1, s=128).peak_point.phase == "optimizer"
    assert sc.elasticity(est, b, {"b": 1, "s": 128}) == sp.Rational(8 * 128, 20 * N_GPT2 + 4 + 8 * 128)
    e = sc.elasticity(est, b, {"b": 8, "s": 128})
    assert 0 < e < 1


@pytest.mark.parametrize("x, point", [("b", {"b": 512, "s": 1024}), ("s", {"b": 8, "s": 1000}),
                                      ("h", {"b": 4, "s": 512, "h": 4092})])   # h a multiple of a = 12
def test_elasticity_matches_finite_difference(est, x, point):
    """d ln M / d ln x ~ (ln M(x*(1+eps)) - ln M(x*(1-eps))) / (ln(1+eps) - ln(1-eps))."""
    names = sorted(point)
    f = est.evaluator(*names, check=False)      # evaluated at x * (1 +- eps), not a whole number
    eps = 1e-4

    def lnM(scale):
        return math.log(float(f(**{n: float(point[n]) * (scale if n == x else 1) for n in names})))
    fd = (lnM(1 + eps) - lnM(1 - eps)) / (math.log(1 + eps) - math.log(1 - eps))
    assert float(sc.elasticity(est, x, point)) == pytest.approx(fd, rel=1e-6)


def test_elasticity_tends_to_the_order(est):
    """At s = s_max = 2^20 the a*s^2 terms swamp the rest: elasticity in s near order 2."""
    e = sc.elasticity(est, s, {"b": 1, "s": 2**20, "s_max": 2**20})
    assert 1.99 < e < 2


def test_elasticity_checks_requirements(est):
    with pytest.raises(sm.ConfigError, match="s_max"):
        sc.elasticity(est, s, {"b": 1, "s": 2048})       # GPT-2's s_max is 1024


# --------------------------------------------------------------------------- regimes

def test_dominant_and_regimes_crossover(est):
    """fp32 AdamW, s = 128. Small b: the peak is the optimizer step with params 4N, grads 4N,
    Adam states 8N and foreach's temporary 4N (+4 bytes: the loss; + 8bs: the input ids), so
    the optimizer states hold 8N / (20N + 4 + 8bs) of it. Large b: activations (proportional
    to b) win."""
    assert sc.dominant(est, {"b": 1, "s": 128}) == "optimizer"
    assert sc.dominant(est, {"b": 64, "s": 128}) == "activations"
    rows = sc.regimes(est, "b", [1, 2, 4, 8, 16, 32, 64], {"s": 128})
    assert [r.role for r in rows] == ["optimizer"] * 3 + ["activations"] * 4
    assert [r.value for r in rows] == [1, 2, 4, 8, 16, 32, 64]
    assert rows[0].share == pytest.approx(8 * N_GPT2 / (20 * N_GPT2 + 4 + 8 * 128), rel=1e-12)
    shares = [r.share for r in rows[3:]]
    assert shares == sorted(shares) and all(0 < x < 1 for x in shares)
    value, role, share = rows[-1]                         # a plain (value, role, share) tuple
    assert (value, role) == (64, "activations")


def test_regimes_grouped_model_states(est):
    """Grouped, the model states (16N at the optimizer step: 16/20 of the peak, less the loss's
    4 bytes and the input ids' 8bs)
    dominate up to b = 8, where the backward peak holds params 4N + Adam 8N = 12N =
    1,493,277,696 bytes against 1,458,844,672 of saved activations; from b = 16 activations."""
    rows = sc.regimes(est, b, [1, 8, 16], {"s": 128}, grouped=True)
    assert [r.role for r in rows] == ["model_states", "model_states", "activations"]
    assert rows[0].share == pytest.approx(16 * N_GPT2 / (20 * N_GPT2 + 4 + 8 * 128), rel=1e-12)
    parts = est.at(b=8, s=128).peak_parts
    assert parts["params"] + parts["optimizer"] == 12 * N_GPT2 == 1_493_277_696
    # the saved activations, less the input ids the embedding saves: they are the batch's
    assert parts["activations"] == 1_458_852_864 - 8 * 8 * 128 == 1_458_844_672
    assert parts["batch"] == 8 * 8 * 128


def test_regimes_rejects_empty(est):
    with pytest.raises(sm.ConfigError):
        sc.regimes(est, b, [], {"s": 128})


# --------------------------------------------------------------------------- per parameter

def test_parameter_count(est):
    """N = 12*L*h^2 + 13*L*h + (V + s_max)*h + 2*h; 124,439,808 for GPT-2 small."""
    n = sc.parameter_count(est.graph)
    assert sp.expand(n - (12 * L * h**2 + 13 * L * h + (V + s_max) * h + 2 * h)) == 0
    assert n.xreplace(est.bindings) == N_GPT2
    assert sc.leading_term(n, h) == 12 * L * h**2
    assert sc.parameter_count(est) == n


def test_bytes_per_parameter_zero(est_master):
    """ZeRO: mixed-precision Adam keeps N*(B_w + B_g + B_m + 2*B_o) = 2 + 2 + 4 + 8 = 16 bytes."""
    assert sp.expand(sc.bytes_per_parameter(est_master) - (B_w + B_g + B_m + 2 * B_o)) == 0
    assert sc.bytes_per_parameter(est_master, limit=h, priced=True) == 16
    assert sc.bytes_per_parameter(est_master, "master", priced=True) == 4
    assert sc.bytes_per_parameter(est_master, "optimizer", limit="h") == 2 * B_o


def test_bytes_per_parameter_fp32(est):
    """fp32 AdamW on CUDA: 4 weights + 4 grads + 2*4 states = 16 (no master copy: 0)."""
    assert sc.bytes_per_parameter(est, limit="h", priced=True) == 16
    assert sc.bytes_per_parameter(est, "master") == 0
    assert sc.bytes_per_parameter(est, "activations", limit="h") == 0   # order 1 over order 2
    with pytest.raises(sm.UnknownName, match="model_states"):
        sc.bytes_per_parameter(est, "weights")


def test_bytes_per_parameter_sgd_and_step_counters():
    """fp32 SGD: 4 + 4 = 8. Adam on the CPU also counts a 4-byte step per parameter tensor:
    12 per layer (4 weights, 4 biases, 2 layer norms x 2) + wte, wpe, ln_f (2) -> 12*12 + 4 =
    148 tensors, 592 bytes: 16 + 592/N exactly, and the limit as h -> oo is still 16."""
    g = sm.models.preset("gpt2")
    sgd = sm.estimate(g, sm.Policy("fp32", "sgd", attention="eager"))
    assert sc.bytes_per_parameter(sgd, limit="h", priced=True) == 8
    assert sc.bytes_per_parameter(sgd, priced=True) == 8
    cpu = sm.estimate(g, sm.Policy("fp32", "adam", "cpu", attention="eager"))
    exact = sc.bytes_per_parameter(cpu, priced=True)
    assert exact.xreplace(cpu.bindings) == 16 + sp.Rational(592, N_GPT2)
    assert sc.bytes_per_parameter(cpu, limit=h, priced=True) == 16
    assert sc.leading_term(exact, h) == 16                    # the same limit, read off the ratio


# --------------------------------------------------------------------------- sweeps

GRID = {"b": [1, 2, 4, 8], "s": [128, 512, 1024]}


def _check_sweep(est, cols):
    assert len(cols["peak"]) == 4 * 3
    # the last name varies fastest
    assert list(cols["b"][:4]) == [1, 1, 1, 2] and list(cols["s"][:4]) == [128, 512, 1024, 128]
    for i in (0, 5, 11):
        ev = est.at(b=int(cols["b"][i]), s=int(cols["s"][i]))
        for c in ("params", "grads", "master", "optimizer", "activations", "peak"):
            assert int(cols[c][i]) == ev.bytes[c]
        assert cols["peak_gib"][i] == pytest.approx(ev.peak / 2**30)
    # b = 1, s = 128: the optimizer step, 20N + 4 (the loss) + 8*1*128 (the input ids)
    assert int(cols["peak"][0]) == 20 * N_GPT2 + 4 + 8 * 128 == 2_488_797_188


def test_sweep_dataframe(est):
    pd = pytest.importorskip("pandas")
    df = sc.sweep(est, **GRID)
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns) == ["b", "s", "params", "buffers", "grads", "master", "optimizer", "activations",
                                "peak", "peak_gib"]
    assert df.shape == (12, 10)
    _check_sweep(est, {c: df[c].to_numpy() for c in df.columns})


def test_sweep_without_pandas(est, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)      # import pandas -> ImportError
    cols = sc.sweep(est, **GRID)
    assert isinstance(cols, dict) and all(isinstance(v, np.ndarray) for v in cols.values())
    assert cols["peak"].dtype == np.int64
    _check_sweep(est, cols)


def test_sweep_overrides_a_binding(est):
    """h in the grid replaces the model's h = 768; the params column is 4*N(h). A value the
    model does not allow (h = 1024 is not a multiple of its 12 heads) is refused."""
    cols = sc.sweep(est, b=[1], s=[128], h=[768, 1020])
    cols = {k: np.asarray(v) for k, v in dict(cols).items()}
    n = sc.parameter_count(est.graph).xreplace({**est.bindings, h: 1020})
    assert int(cols["params"][1]) == 4 * n
    with pytest.raises(sm.ConfigError, match="h = 1024 is not valid: expected a multiple of 12"):
        sc.sweep(est, b=[1], s=[128], h=[768, 1024])


def test_sweep_rejects(est):
    with pytest.raises(sm.ConfigError, match="at least one symbol"):
        sc.sweep(est)
    with pytest.raises(sm.UnknownName, match="unknown symbol 'q'"):
        sc.sweep(est, q=[1], s=[128])
    with pytest.raises(sm.ConfigError, match="non-empty"):
        sc.sweep(est, b=[], s=[128])
    with pytest.raises(sm.ConfigError, match="positive integer"):
        sc.sweep(est, b=[0, 1], s=[128])
    with pytest.raises(sm.ConfigError, match="positive integer"):
        sc.sweep(est, b=[1.5], s=[128])
    with pytest.raises(sm.ConfigError, match="missing: s"):
        sc.sweep(est, b=[1, 2])
    with pytest.raises(sm.ConfigError, match="s_max"):
        sc.sweep(est, b=[1], s=[512, 2048])              # GPT-2's s_max is 1024
