"""Time single solves and a 10^6-point sweep of the compiled peak formula (GPT-2 and GPT-3's
shape, bf16 autocast, AdamW, eager attention).

A solve's first call on an estimate reads the candidates of the peak into integer terms
(``Estimate.compiled``, kept per set of free symbols); "first" times that call, "then" the
best of three repeats, the cost of each further solve, ``at`` or frontier point.

Run: python benchmarks/bench_solve.py
"""
from __future__ import annotations

import time

import numpy as np

import symmem as sm
from symmem.scaling import sweep
from symmem.solve import max_batch, max_seq, solve


def best(fn, repeat=3):
    t_best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best, out


def first_and_then(est, fn):
    """The first call's time (the compiled terms and evaluators dropped before it; the step
    derived for b = 1, ``at_one``, already derived) and the best repeat's."""
    for e in (est, est.__dict__.get("at_one")):      # at_one: the step derived for b = 1
        if e is not None:
            e.__dict__.pop("_compiled", None)
            e.__dict__.pop("_evaluators", None)
    t = time.perf_counter()
    fn()
    t_first = time.perf_counter() - t
    t_then, out = best(fn)
    return t_first, t_then, out


def main():
    # eager attention: its a*b*s^2 terms make the sequence solves quadratic, the harder case
    policy = sm.Policy("bf16-mixed", "adamw", "cuda", attention="eager")
    print(f"{'task':<64}{'first':>10}{'then':>10}{'answer':>20}")

    def row(task, t_first, t_then, answer):
        print(f"{task:<64}{t_first * 1e3:>8.1f}ms{t_then * 1e3:>8.2f}ms{answer:>20,}")

    for name in ("gpt2", "gpt3-175b"):
        est = sm.estimate(sm.models.preset(name), policy)
        est.at_one                      # a derivation (the step at b = 1), not a solve
        budget = "80GiB" if name == "gpt2" else "8TiB"
        t1, t, sol = first_and_then(est, lambda: max_batch(est, budget, reserve="10%", s=1024))
        row(f"{name}: max batch, s=1024, {budget} - 10%", t1, t, sol.value)
        seq_budget, bb = ("16GiB", 8) if name == "gpt2" else ("3.5TiB", 8)
        t1, t, sol = first_and_then(est, lambda: max_seq(est, seq_budget, b=bb, reserve=0))
        kind = "quadratic boundary" if sol.limit is None else "the model's limit"
        row(f"{name}: max sequence, b={bb}, {seq_budget} - 0 ({kind})", t1, t, sol.value)
        t1, t, sol = first_and_then(est, lambda: solve(est, "L", budget, b=1, s=1024, reserve=0))
        row(f"{name}: max layers, b=1, s=1024, {budget} - 0", t1, t, sol.value)
        t1, t, ev = first_and_then(est, lambda: est.at(b=8, s=1024))
        row(f"{name}: exact bytes, at(b=8, s=1024)", t1, t, ev.peak)
    t, sol = best(lambda: str(max_batch(est, "8TiB", reserve="10%", s=1024)))
    print(f"{'gpt3-175b: max batch and its closed-form boundary, printed':<64}{'':>10}{t * 1e3:>8.2f}ms")

    est = sm.estimate(sm.models.preset("gpt2"), policy)
    b, s = np.meshgrid(np.arange(1, 1001), np.arange(1, 1001), indexing="ij")   # 10^6 points
    est.__dict__.pop("_evaluators", None)
    t_compile, f = best(lambda: est.evaluator("b", "s"), 1)
    t_eval, peaks = best(lambda: f(b=b, s=s))
    assert int(peaks[7, 999]) == est.at(b=8, s=1000).peak
    print(f"{f'gpt2: build the evaluator of the peak ({len(est.points)} candidates)':<64}{t_compile * 1e3:>8.1f}ms")
    print(f"{'gpt2: evaluate the peak at 10^6 (b, s) points':<64}{'':>10}{t_eval * 1e3:>8.1f}ms"
          f"{t_eval / b.size * 1e9:>9.0f}ns/pt")
    grid = {"b": list(range(1, 1001)), "s": list(range(1, 1001))}
    est.__dict__.pop("_evaluators", None)
    t1, t, table = first_and_then(est, lambda: sweep(est, **grid))
    print(f"{'gpt2: scaling.sweep, every component, 10^6 points':<64}{t1 * 1e3:>8.1f}ms{t * 1e3:>8.1f}ms"
          f"{t / b.size * 1e9:>9.0f}ns/pt")

if __name__ == "__main__":
    main()
