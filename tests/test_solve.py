"""Solvers: the answer, its proof, the closed-form boundary, and agreement with brute force."""
import numpy as np
import pytest
import sympy as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import symmem as sm
from symmem.errors import ConfigError, Infeasible
from symmem.solve import frontier, max_batch, max_seq, solve
from symmem.symbols import G, M, R, g, h, s

GiB = 2**30


@pytest.fixture(scope="module")
def gpt2():
    return sm.estimate(sm.models.preset("gpt2"), sm.Policy("bf16-mixed", "adamw", attention="eager"))


def c1_bytes_per_sequence(est):
    """At s = 1024 the peak grows by the same bytes for each sequence added (b = 1 -> 2)."""
    return est.at(b=2, s=1024).peak - est.at(b=1, s=1024).peak


def test_max_batch_with_proof(gpt2):
    sol = max_batch(gpt2, "80GiB", reserve="10%", s=1024)
    # usable = 80 GiB - 10% = 85,899,345,920 - 8,589,934,592 = 77,309,411,328
    assert (sol.total, sol.reserve, sol.usable) == (85_899_345_920, 8_589_934_592, 77_309_411_328)
    assert sol.at_value.peak <= sol.usable < sol.past_value.peak
    assert sol.value == 30
    # the boundary, evaluated, is the answer; with numbers it is floor((M - R - c0)/c1)
    assert sol.boundary.xreplace({**gpt2.bindings, s: 1024, M: sol.total, R: sol.reserve}) == 30
    c1 = gpt2.at(b=2, s=1024).peak - gpt2.at(b=1, s=1024).peak     # bytes per sequence
    assert sp.expand(sol.boundary_numeric.args[0] - (M - R - (gpt2.at(b=1, s=1024).peak - c1)) / c1) == 0
    assert sol.binding.where == "backward log_softmax"
    assert "max b = 30" in str(sol)
    c0, c1 = sol.linear_terms()             # the binding candidate is c0 + c1*b
    bound = {**gpt2.bindings, s: 1024}
    assert c1.xreplace(bound) == c1_bytes_per_sequence(gpt2)
    assert sp.expand(sol.boundary.args[0] - (M - R - c0) / c1) == 0
    assert max_seq(gpt2, "16GiB", b=8, reserve=0).linear_terms() is None   # quadratic in s


def test_quadratic_boundary_in_s(gpt2):
    """Explicit attention saves a*b*s^2 terms: the boundary in s is a root of a quadratic."""
    sol = max_seq(gpt2, "16GiB", b=8, reserve=0)
    assert sol.at_value.peak <= 16 * GiB < sol.past_value.peak
    assert any(isinstance(x, sp.Pow) and x.exp == sp.Rational(1, 2) for x in sp.preorder_traversal(sol.boundary))
    assert sol.boundary_numeric.xreplace({M: 16 * GiB, R: 0}) == sol.value


def test_a_size_gets_the_default_reserve(gpt2):
    """One rule (symmem.gpus.DEFAULT_RESERVE): a size passed to a solver gets a 10% reserve
    unless reserve= says otherwise; a Budget keeps its own unless reserve= replaces it."""
    # 16 GiB = 17,179,869,184 bytes; 10% = 1,717,986,918 (rounded down)
    assert max_seq(gpt2, "16GiB", b=8).reserve == 1_717_986_918
    assert max_seq(gpt2, "16GiB", b=8).value <= max_seq(gpt2, "16GiB", b=8, reserve=0).value
    t4 = sm.gpus.budget(gpu="T4")
    assert max_batch(gpt2, t4, s=512).reserve == t4.reserve
    assert max_batch(gpt2, t4, s=512, reserve=0).reserve == 0


def test_sequence_limited_by_the_model(gpt2):
    sol = max_seq(gpt2, "80GiB", b=1)
    assert sol.value == 1024 and sol.limit.startswith("s <= s_max = 1024")
    assert sol.past_value is None and sol.boundary is None


def test_infeasible_shows_the_breakdown(gpt2):
    with pytest.raises(Infeasible) as e:
        max_batch(gpt2, "1GiB", s=1024, reserve=0)
    err = e.value
    assert err.symbol == "b" and err.value == 1 and err.usable == GiB
    assert err.needed == gpt2.at(b=1, s=1024).peak
    # 4,156,690,948 before gelu_new's float32 copy (12 x 1024*3072 x 2 bytes) and the loss's
    # gradient (4) were counted
    assert str(err).startswith("no value of b fits: at b = 1 the peak is 4,232,188,424 bytes (3.94 GiB, "
                               "during backward log_softmax) but the budget allows 1,073,741,824 bytes")
    assert "\nactivations " in str(err) and "% of peak" in str(err)


def test_other_symbols(gpt2):
    sol = solve(gpt2, "L", "80GiB", b=8, s=1024, reserve=0)
    assert gpt2.at(b=8, s=1024, L=sol.value).peak <= 80 * GiB < gpt2.at(b=8, s=1024, L=sol.value + 1).peak
    with pytest.raises(ConfigError, match="b = 8 is not valid: expected not fixed"):
        solve(gpt2, "b", "80GiB", b=8, s=1024)
    with pytest.raises(ConfigError, match=r"values = \['s'\]"):
        solve(gpt2, "b", "80GiB")


def test_frontier(gpt2):
    edge = frontier(gpt2, "40GB", "s", [128, 512, 1024])
    assert [v for v, _ in edge] == [128, 512, 1024]
    bs = [m for _, m in edge]
    assert bs == sorted(bs, reverse=True)       # longer sequences, smaller batches
    assert frontier(gpt2, "1GB", "s", [1024]) == [(1024, None)]


# --- a graph built for a symbol memory falls with: gradient accumulation at a fixed global batch
def accumulation_model():
    """G sequences per optimizer step, in g micro-batches of G/g: the activations fall with g."""
    gr = sm.Graph("accumulate", {h: 256, s: 512, G: 64})
    ids = gr.input("ids", (G / g, s))
    w = gr.param("embed", (1000, h))
    x = gr.add("embedding", ids, params=(w,), name="embed")
    x = gr.add("linear", x, params=(gr.param("up", (4 * h, h)),), name="up")
    x = gr.add("gelu", x, name="act")
    x = gr.add("linear", x, params=(gr.param("down", (h, 4 * h)),), name="down")
    x = gr.add("linear", x, params=(gr.param("head", (1000, h)),), name="head")
    x = gr.add("log_softmax", x, name="logp")
    gr.add("nll_loss", x, ids, name="loss")
    return sm.estimate(gr, sm.Policy("fp32", "adamw", attention="eager"))


def test_min_accumulation_steps():
    est = accumulation_model()
    peak = est.evaluator("g")
    g1 = int(peak(g=1))
    budget = g1 // 3
    sol = solve(est, "g", budget, direction="min")
    assert sol.value > 1
    assert sol.at_value.peak <= budget < sol.past_value.peak
    assert sol.boundary is not None and sol.boundary.func == sp.ceiling
    brute = next(v for v in range(1, 10_000) if peak(g=v) <= budget)
    assert sol.value == brute
    with pytest.raises(Infeasible, match="does not shrink with g"):
        solve(est, "g", est.components["params"].xreplace(est.bindings), direction="min")


# --- property tests: random models and settings against brute force
ESTIMATES = {}


def cached(precision, optimizer, device, act):
    key = (precision, optimizer, device, act)
    if key not in ESTIMATES:
        cfg = sm.models.GPT2Config(activation_function=act)
        ESTIMATES[key] = sm.estimate(sm.models.build_gpt2(cfg), sm.Policy(precision, optimizer, device, attention="eager"))
    return ESTIMATES[key]


EVALUATORS = {}


def evaluator(est):
    """One compiled evaluator per estimate (compiling it is most of an example's time)."""
    if id(est) not in EVALUATORS:
        EVALUATORS[id(est)] = est.evaluator("b", "s", "a", "h", "L", "V", "s_max")
    return EVALUATORS[id(est)]


settings_ = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    est = cached(draw(st.sampled_from(["fp32", "bf16-mixed", "bf16-master"])),
                 draw(st.sampled_from(["sgd", "adamw"])), draw(st.sampled_from(["cuda", "cpu"])),
                 draw(st.sampled_from(["gelu", "gelu_new"])))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    model = {"a": heads, "h": heads * draw(st.integers(1, 64)), "L": draw(st.integers(1, 8)),
             "V": draw(st.integers(2, 5000)), "s_max": 4096}
    seq = draw(st.integers(1, 4096))
    base = est.at(b=1, s=seq, **model).peak
    per_seq = est.at(b=2, s=seq, **model).peak - base
    budget = base + draw(st.integers(0, 300)) * per_seq + draw(st.integers(0, per_seq))
    return est, model, seq, budget


@settings_
@given(problems())
def test_max_batch_equals_brute_force(problem):
    est, model, seq, budget = problem
    sol = max_batch(est, budget, s=seq, reserve=0, **model)
    f = evaluator(est)
    bs = np.arange(1, 2000)
    peaks = f(b=bs, s=seq, **model)
    fits = peaks <= budget
    brute = int(bs[fits].max())
    assert sol.value == brute
    assert sol.at_value.peak <= budget < sol.past_value.peak       # exact at the boundary
    if sol.boundary is not None:
        assert sol.boundary.xreplace({**est.bindings, **{sm.symbols.symbol(k): v for k, v in model.items()},
                                      s: seq, M: budget, R: 0}) == sol.value


@settings_
@given(problems(), st.integers(1, 10**9))
def test_monotone_in_budget(problem, more):
    est, model, seq, budget = problem
    assert max_batch(est, budget, s=seq, reserve=0, **model).value <= max_batch(est, budget + more, s=seq, reserve=0,
                                                                        **model).value


def test_only_values_the_model_allows(gpt2):
    """h must be a multiple of a (12 heads split it evenly), a a divisor of h = 768: the answer
    and the proof's next value are such values, and a fixed h = 770 is refused as a config
    with it is."""
    sol = solve(gpt2, "h", "80GB", b=8, s=1024)
    assert sol.value % 12 == 0 and sol.step == sol.value + 12
    assert sol.at_value.peak <= sol.usable < sol.past_value.peak
    assert sol.boundary is None                  # no closed form over multiples only
    sol_a = solve(gpt2, "a", "80GB", b=8, s=1024)
    divisors = [d for d in range(1, 769) if 768 % d == 0]
    assert 768 % sol_a.value == 0 and sol_a.step == divisors[divisors.index(sol_a.value) + 1]
    assert sol_a.at_value.peak <= sol_a.usable < sol_a.past_value.peak
    with pytest.raises(ConfigError, match=r"^h = 770 is not valid: expected a multiple of 12: the attention "
                                          r"heads split the hidden size evenly\.$"):
        max_batch(gpt2, "80GB", s=1024, h=770)


@pytest.mark.parametrize("symbol,direction,fixed,message", [
    ("B_a", "max", {"b": 8, "s": 1024}, "symbol = 'B_a' is not valid: expected a dimension (b, s, h, a, L, V, "
                                        "...), not a byte price."),
    ("M", "max", {"b": 8, "s": 1024}, "symbol = 'M' is not valid: expected a dimension (b, s, h, a, L, V, "
                                      "...), not the budget or the reserve."),
    ("g", "min", {"b": 8, "s": 1024}, "symbol = 'g' is not valid: expected a symbol the peak of gpt2 "
                                      "depends on: L, V, a, b, h, s, s_max."),
    ("b", "min", {"s": 1024}, "direction = 'min' is not valid: expected 'max': memory does not fall as b "
                              "grows, so the smallest b that fits is 1 whenever any does. Ask for the largest."),
])
def test_questions_without_meaning_are_refused(gpt2, symbol, direction, fixed, message):
    with pytest.raises(ConfigError) as e:
        solve(gpt2, symbol, "80GB", direction=direction, **fixed)
    assert str(e.value).startswith(message)


def test_the_search_limit_is_not_the_formula(gpt2):
    """A budget of 10^30 bytes: at b = 2^40 the peak still fits, and the error says that the
    search stopped there (not that memory does not grow with b)."""
    from symmem.errors import SearchLimit
    with pytest.raises(SearchLimit) as e:
        max_batch(gpt2, 10**30, s=1024, reserve=0)
    assert e.value.value == 2**40 and e.value.peak <= e.value.usable == 10**30
    assert str(e.value).startswith("the largest b is beyond the search: at b = 1,099,511,627,776 the peak")


def test_search_keeps_the_candidates_that_can_be_the_peak():
    from symmem.solve import _frontier
    # x, 5, 2x, (x + 9)/2 on x >= 1: x is never above 2x; 5 leads at small x, 2x at large x;
    # (x + 9)/2 is 5 at x = 1 like the constant but grows: the constant never leads alone
    polys = [([1, 0], 1), ([5], 1), ([2, 0], 1), ([1, 9], 2)]
    assert _frontier(polys) == [2, 3]
    assert _frontier(polys + [(None, None)]) == [0, 1, 2, 3, 4]    # a ceiling: all kept


def test_fsdp_smallest_data_parallel_degree():
    """FSDP2's padded shards make memory fall with d, then rise again once d passes a
    parameter's rows (every gathered unit padded to d rows): the smallest d is found by
    probing 1, 2, 4, ... then bisecting; the largest is refused. Llama-2-7B in fp32 with AdamW,
    b = 1, s = 2048, on an H100: 125.5 GiB on one rank, half of the states on each of two."""
    est = sm.estimate("llama-2-7b", sm.Policy("fp32", "adamw", parallel="dp=d,fsdp=full"))
    h100 = sm.gpus.budget(gpu="H100-80GB")
    sol = solve(est, "d", h100, direction="min", b=1, s=2048)
    assert sol.value == 2
    assert est.at(b=1, s=2048, d=1).peak > h100.usable >= est.at(b=1, s=2048, d=2).peak
    with pytest.raises(ConfigError) as e:
        solve(est, "d", h100, direction="max", b=1, s=2048)
    assert "memory does not grow with d" in str(e.value)
