"""Accuracy beside the peers: symmem, llm-analysis and PyTorch's MemTracker against a measured
training step, per component and for the peak, in % of the measured bytes.

    make peers                                         # builds .venv-peers, runs both scripts
    .venv-peers/bin/python benchmarks/peers/accuracy.py [--full] [--json out.json] [--only gpt2]

The grid, the measurement and each tool's mapping are in ``grid.py`` beside this file (read
its docstring: every choice made for llm-analysis is listed there). ``--full`` runs all 48
combinations instead of the default 24. Prints one table of the peak per case, one of every
component per case, and a summary (the largest |error| of each tool per column). An error
is ``(predicted - measured) / measured``; "exact" means equal to the byte; below 0.01 % the
difference is given in bytes.

Exit status 1 if symmem is not exact on a case (the suite's standard); the peers' errors are
reported, not judged.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grid  # noqa: E402

TOOLS = ("symmem", "llm-analysis", "MemTracker", "MemTracker fake")


def answers(case: grid.Case) -> dict:
    cfg = grid.hf_config(case)
    out = {"measured": grid.measured(case)}
    calls = {"symmem": lambda: grid.symmem_answer(case, cfg),
             "llm-analysis": lambda: grid.llm_analysis_answer(case, cfg),
             "MemTracker": lambda: grid.memtracker_answer(case, False, cfg),
             "MemTracker fake": lambda: grid.memtracker_answer(case, True, cfg)}
    for tool, call in calls.items():
        try:
            out[tool] = call()
        except Exception as exc:  # a peer that fails on a case is reported, not hidden
            out[tool] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:120]}
            traceback.print_exc(file=sys.stderr)
    return out


def error(pred, meas) -> float | None:
    if pred is None or meas is None:
        return None
    return 100.0 * (pred - meas) / meas if meas else (0.0 if pred == 0 else float("inf"))


def fmt(pred, meas) -> str:
    if pred is None:
        return "n/a"
    if pred == meas:
        return "exact"
    e = error(pred, meas)
    if abs(e) < 0.01:
        return f"{int(pred - meas):+,} B"
    return f"{e:+.1f}%" if abs(e) >= 0.1 else f"{e:+.2f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="all 48 combinations (default: the 24 of the half fraction)")
    ap.add_argument("--only", help="one family")
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--from-json", help="print the tables of a file --json wrote, without running anything")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        rows = [(grid.Case(*r["case"].split()), {k: v for k, v in r.items() if k not in ("case", "b", "s")})
                for r in saved]
        return report(rows, None)
    cases = [c for c in (grid.FULL_GRID if args.full else grid.GRID) if not args.only or c.family == args.only]

    t0 = time.perf_counter()
    rows = []
    for case in cases:
        t = time.perf_counter()
        rows.append((case, answers(case)))
        print(f"# {case.label}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"case": case.label, "b": case.b, "s": case.s, **ans} for case, ans in rows], indent=1, default=float))
    return report(rows, wall)


def report(rows, wall) -> int:
    cases = [case for case, _ in rows]

    width = max(len(c.label) for c in cases)
    print(f"Peak of the training step, measured (bytes) and each tool's error; b, s per family in grid.py")
    print(f"{'case':<{width}}  {'measured':>12}  {'phase':<9}" + "".join(f"  {t:>15}" for t in TOOLS))
    for case, ans in rows:
        m = ans["measured"]
        print(f"{case.label:<{width}}  {m['peak']:>12,}  {m['phase']:<9}"
              + "".join(f"  {fmt(ans[t].get('peak'), m['peak']):>15}" for t in TOOLS))
    print()
    print("Components: error of each tool (symmem / llm-analysis / MemTracker / MemTracker fake)")
    cols = grid.COLUMNS[:-1]
    print(f"{'case':<{width}}" + "".join(f"  {c:>36}" for c in cols))
    for case, ans in rows:
        m = ans["measured"]
        cells = []
        for c in cols:
            cells.append(" / ".join(fmt(ans[t].get(c), m[c]) for t in TOOLS))
        print(f"{case.label:<{width}}" + "".join(f"  {x:>36}" for x in cells))
    print()
    print(f"Summary over {len(rows)} cases: the largest |error| per column (exact: every case to the byte; "
          f"below 0.01 %: the largest difference in bytes)")
    print(f"{'tool':<16}" + "".join(f"  {c:>12}" for c in grid.COLUMNS) + "  failed cases")
    symmem_exact = True
    for t in TOOLS:
        cells, failed = [], sum("error" in ans[t] for _, ans in rows)
        for c in grid.COLUMNS:
            pairs = [(ans[t].get(c), ans["measured"][c]) for _, ans in rows if "error" not in ans[t]]
            errs = [abs(error(p, m)) for p, m in pairs if p is not None]
            if not errs:
                cells.append("n/a")
            elif max(errs) == 0:
                cells.append("exact")
            else:
                if max(errs) < 0.01:
                    cells.append(f"{max(abs(int(p - m)) for p, m in pairs)} B")
                else:
                    cells.append(f"{max(errs):.1f}%" if max(errs) >= 0.1 else f"{max(errs):.2f}%")
                if t == "symmem":
                    symmem_exact = False
        print(f"{t:<16}" + "".join(f"  {x:>12}" for x in cells) + f"  {failed}")
    for case, ans in rows:
        for t in TOOLS:
            if "error" in ans[t]:
                print(f"  {t} failed on {case.label}: {ans[t]['error']}")
    if wall is not None:
        print(f"\n{len(rows)} cases in {wall:.0f} s")
    return 0 if symmem_exact and all("error" not in ans["symmem"] for _, ans in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
