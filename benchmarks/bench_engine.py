"""Time deriving each preset's symbolic peak, at its own layer count and at L = 2 ... 1024.

Run: python benchmarks/bench_engine.py [--all] [--runs 3] [--before PATH] [--eval]

One row per preset (the first of each family; ``--all``: every preset): the derivation
``sm.estimate(graph, policy).peak`` at the preset's own ``L`` and with its layer count set to
2, 8, 32, 128 and 1024, bf16 autocast, AdamW, CUDA, the model's default attention (eager,
marked ``*``, where symmem models no kernel of that default on CUDA: T5's fused SDPA). ``L``
stays a symbol (the repeated block is counted as three copies, the middle one
extrapolated), so a row should be flat. Each row runs in a fresh process that first derives
gpt2 once (sympy imported and its caches warm, as in a notebook) and then times every cell
once; the row's process runs ``--runs`` times and each cell is the median.

``--before PATH`` (a checkout of an earlier commit) times the same rows with that tree too,
the two trees taking turns process by process so that the machine's load falls on both
alike, and prints the ratio after / before of the rows' sums. ``--eval`` adds the old
table: compiling the peak and evaluating it at 10^5 (b, s) points.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
LAYERS = (2, 8, 32, 128, 1024)

CHILD = r"""
import json, sys, time
from dataclasses import fields, replace
import symmem as sm
name, layers = json.loads(sys.argv[1])
policy = sm.Policy("bf16-mixed", "adamw", "cuda")
sm.estimate(sm.models.preset("gpt2"), policy).peak          # sympy warm, as in a notebook
fam, cfg = sm.models.preset_config(name)
field = next((f.name for f in fields(cfg) if f.name in ("n_layer", "num_hidden_layers", "num_layers")), None)
out = {}
for L in [None, *layers]:
    if L is not None and field is None:
        out[str(L)] = None
        continue
    graph = fam.build(cfg if L is None else replace(cfg, **{field: L}))
    t = time.perf_counter()
    try:
        try:
            est = sm.estimate(graph, policy)
        except sm.errors.ConfigError as e:    # the default has no kernel here (T5's fused SDPA on CUDA)
            if e.field != "attention" or "attention" in out:
                raise
            policy, out["attention"] = sm.Policy("bf16-mixed", "adamw", "cuda", attention="eager"), "eager"
            t = time.perf_counter()
            est = sm.estimate(graph, policy)
        est.peak
        out["own" if L is None else str(L)] = [time.perf_counter() - t, len(est.points)]
    except Exception as e:
        out["own" if L is None else str(L)] = [None, type(e).__name__]
print(json.dumps([getattr(cfg, field) if field else None, out]))
"""


def row(tree: Path, name: str) -> list:
    env = {**os.environ, "PYTHONPATH": str(tree), "SYMMEM_NO_CACHE": "1"}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps([name, LAYERS])], cwd=tree,
                         capture_output=True, text=True, env=env)
    if run.returncode:
        raise SystemExit(f"{tree}: {name}: {run.stderr[-2000:]}")
    return json.loads(run.stdout)


def names(every: bool) -> list[str]:
    sys.path.insert(0, str(HERE))
    import symmem as sm
    if every:
        return sorted(sm.models.PRESETS)
    return [next(iter(f.presets)) for f in sm.models.families() if f.presets]


def _cell(times: list) -> str:
    good = [t for t in times if t is not None]
    return f"{statistics.median(good):>8.3f}" if good else f"{'—':>8}"


def evaluation_table() -> None:
    import time
    import numpy as np
    sys.path.insert(0, str(HERE))
    import symmem as sm
    rng = np.random.default_rng(0)
    n = 100_000
    b, s = rng.integers(1, 65, n), rng.integers(128, 1025, n)
    policy = sm.Policy("bf16-mixed", "adamw", "cuda")
    print(f"\n{'model':<18}{'compile':>10}{'eval 1e5':>10}{'per config':>12}{'candidates':>12}")
    for name in ("gpt2", "gpt3-175b"):
        est = sm.estimate(sm.models.preset(name), policy)
        t = time.perf_counter()
        f = est.evaluator("b", "s")
        t_compile = time.perf_counter() - t
        t = time.perf_counter()
        peaks = f(b=b, s=s)
        t_eval = time.perf_counter() - t
        for i in (0, n // 2, n - 1):           # the vectorised answer against the exact one
            assert int(peaks[i]) == est.at(b=int(b[i]), s=int(s[i])).peak
        print(f"{name:<18}{t_compile:>9.2f}s{t_eval * 1e3:>8.1f}ms{t_eval / n * 1e9:>10.0f}ns{len(est.points):>12}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--all", action="store_true", help="every preset, not the first of each family")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--before", type=Path, help="an earlier tree to time beside this one")
    p.add_argument("--models", help="comma-separated preset names (instead of the default rows)")
    p.add_argument("--eval", action="store_true", help="also time compiling and evaluating the peak")
    args = p.parse_args(argv)
    rows = args.models.split(",") if args.models else names(args.all)
    trees = [("after", HERE)] + ([("before", args.before.resolve())] if args.before else [])
    cols = ["own", *map(str, LAYERS)]
    print(f"derivation (s), bf16-mixed AdamW CUDA, median of {args.runs} processes; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start")
    head = f"{'model':<16}{'tree':<8}{'L':>6}" + "".join(f"{'L=' + c if c != 'own' else 'own L':>9}" for c in cols)
    print(head + f"{'points':>8}")
    sums = {label: [] for label, _ in trees}
    for name in rows:
        got = {label: [] for label, _ in trees}
        for _ in range(args.runs):
            for label, tree in trees:          # the trees take turns
                got[label].append(row(tree, name))
        for label, _ in trees:
            L = got[label][0][0]
            cells = {c: [r[1].get(c) and r[1][c][0] for r in got[label]] for c in cols}
            points = got[label][0][1]["own"][1]
            shown = name + ("*" if "attention" in got[label][0][1] else "")
            print(f"{shown:<16}{label:<8}{L if L is not None else '—':>6}"
                  + "".join(_cell(cells[c]) + " " for c in cols) + f"{points:>7}")
            sums[label].append(sum(statistics.median([t for t in cells[c] if t is not None] or [0]) for c in cols))
    for label in sums:
        print(f"sum over the rows, {label}: {sum(sums[label]):.2f} s")
    if args.before:
        print(f"after / before: {sum(sums['after']) / sum(sums['before']):.2f}")
    if args.eval:
        evaluation_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
