"""Time single solves and a 10^6-point sweep of the compiled peak formula (GPT-2 and GPT-3's
shape, bf16 autocast, AdamW, eager attention).

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


def main():
    # eager attention: its a*b*s^2 terms make the sequence solves quadratic, the harder case
    policy = sm.Policy("bf16-mixed", "adamw", "cuda", attention="eager")
    print(f"{'task':<64}{'time':>12}{'answer':>14}")
    for name in ("gpt2", "gpt3-175b"):
        est = sm.estimate(sm.models.preset(name), policy)
        budget = "80GiB" if name == "gpt2" else "8TiB"
        t, sol = best(lambda: max_batch(est, budget, reserve="10%", s=1024))
        print(f"{f'{name}: max batch, s=1024, {budget} - 10%':<64}{t * 1e3:>10.1f}ms{sol.value:>14,}")
        seq_budget, bb = ("16GiB", 8) if name == "gpt2" else ("3.5TiB", 8)
        t, sol = best(lambda: max_seq(est, seq_budget, b=bb, reserve=0))
        kind = "quadratic boundary" if sol.limit is None else "the model's limit"
        print(f"{f'{name}: max sequence, b={bb}, {seq_budget} - 0 ({kind})':<64}{t * 1e3:>10.1f}ms{sol.value:>14,}")
        t, sol = best(lambda: solve(est, "L", budget, b=1, s=1024, reserve=0))
        print(f"{f'{name}: max layers, b=1, s=1024, {budget} - 0':<64}{t * 1e3:>10.1f}ms{sol.value:>14,}")

    est = sm.estimate(sm.models.preset("gpt2"), policy)
    t_compile, f = best(lambda: est.evaluator("b", "s"), 1)
    b, s = np.meshgrid(np.arange(1, 1001), np.arange(1, 1001), indexing="ij")   # 10^6 points
    t_eval, peaks = best(lambda: f(b=b, s=s))
    assert int(peaks[7, 999]) == est.at(b=8, s=1000).peak
    print(f"{f'gpt2: compile the peak ({len(est.points)} candidates)':<64}{t_compile * 1e3:>10.1f}ms")
    print(f"{'gpt2: evaluate the peak at 10^6 (b, s) points':<64}{t_eval * 1e3:>10.1f}ms"
          f"{t_eval / b.size * 1e9:>11.0f}ns/pt")
    t_sweep, table = best(lambda: sweep(est, b=list(range(1, 1001)), s=list(range(1, 1001))), 1)
    print(f"{'gpt2: scaling.sweep, every component, 10^6 points':<64}{t_sweep * 1e3:>10.1f}ms"
          f"{t_sweep / b.size * 1e9:>11.0f}ns/pt")


if __name__ == "__main__":
    main()
