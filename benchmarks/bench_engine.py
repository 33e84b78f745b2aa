"""Time building a model, deriving its symbolic peak, and evaluating the formula.

Run: python benchmarks/bench_engine.py
Prints one table; the derivation time must not grow with the layer count L (L stays a
symbol: the repeated block is counted as three copies, the middle one extrapolated), so gpt2
(L=12) and gpt3-175b (L=96) and a 512-layer variant should take about the same time.
"""
from __future__ import annotations

import time

import numpy as np

import symmem as sm


def timed(fn, repeat=3):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def derive(graph, policy):
    est = sm.estimate(graph, policy)
    est.peak  # the Max of the candidates, built once
    return est


def main():
    rng = np.random.default_rng(0)
    n = 100_000
    b = rng.integers(1, 65, n)
    s = rng.integers(128, 1025, n)      # within every preset's n_positions
    policy = sm.Policy("bf16-mixed", "adamw", "cuda")
    cases = [("gpt2", sm.models.PRESETS["gpt2"]), ("gpt3-175b", sm.models.PRESETS["gpt3-175b"]),
             ("gpt3-175b, L=512", sm.models.GPT2Config(n_embd=12288, n_layer=512, n_head=96,
                                                       n_positions=2048, name="L512"))]
    print(f"{'model':<18}{'L':>5}{'build':>10}{'derive':>10}{'compile':>10}"
          f"{'eval 1e5':>10}{'per config':>12}{'candidates':>12}")
    for label, cfg in cases:
        t_build, g = timed(lambda: sm.models.build_gpt2(cfg))
        t_derive, est = timed(lambda: derive(g, policy), 1)
        t_compile, f = timed(lambda: est.evaluator("b", "s"), 1)
        t_eval, peaks = timed(lambda: f(b=b, s=s))
        # spot-check the vectorised answer against the exact one
        for i in (0, n // 2, n - 1):
            assert int(peaks[i]) == est.at(b=int(b[i]), s=int(s[i])).peak
        print(f"{label:<18}{cfg.n_layer:>5}{t_build * 1e3:>8.1f}ms{t_derive:>9.2f}s{t_compile:>9.2f}s"
              f"{t_eval * 1e3:>8.1f}ms{t_eval / n * 1e9:>10.0f}ns{len(est.points):>12}")


if __name__ == "__main__":
    main()
