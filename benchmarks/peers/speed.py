"""Speed beside the peers: how long symmem, llm-analysis and PyTorch's MemTracker take to answer.

    make peers                                          # builds .venv-peers, runs both scripts
    .venv-peers/bin/python benchmarks/peers/speed.py [--full] [--only FAMILY] [--layers 2,8,32,128]

Three tables, in CPU seconds (``time.process_time``; the parent reads its children's with
``getrusage``), PyTorch at one thread: on a shared machine wall clock measures the
neighbours, CPU time far less so. One run each: read the ratios, not the digits.

1. Per configuration, over accuracy.py's grid (``grid.py``): each tool runs the whole grid
   in a fresh process of its own (``speed.py --process TOOL``), the cases in order, and
   times each case: symmem (``sm.estimate`` of the case's graph and policy, then
   ``.at(b, s)``: a derivation per case, with sympy's cache as the earlier cases left it),
   llm-analysis (``LLMAnalysis(...).training(...)``), MemTracker over one tracked training
   step with real tensors and under ``FakeTensorMode``. For MemTracker two numbers: the
   tracked step alone (forward, backward, optimizer step: the most favourable reading) and
   with what it needs first, building the model (inside the fake mode for the fake run)
   and a warm-up step that makes the optimizer's state.
2. The same processes as wholes: CPU seconds of each, interpreter start and imports
   included (every process imports torch and transformers, whose config classes are the
   grid's input; the time to import the tool's own package is shown apart), and wall clock.
3. Layers: the grid's Llama case (sdpa, bf16 autocast, AdamW) at L = 2, 8, 32, 128.
   MemTracker under FakeTensorMode runs the step at each L (its time grows with the number of
   operators, so with L; the tracked step only). symmem twice: *derive once* (the formula is
   symbolic in L: one ``sm.estimate`` at the config's L = 3, then ``est.at(b, s, L=n)`` at
   each L, the first of which compiles the formula; the row shows the derivation once and
   each evaluation) and *derive per L* (a fresh config with ``num_hidden_layers = L``,
   sympy's cache cleared with ``sympy.core.cache.clear_cache()`` before each, then
   ``sm.estimate`` and ``.at``; symmem keeps no disk cache). Both symmem answers are
   checked equal at each L. MemTracker's step grows faster than L (after every operator it
   updates the peak of every module it tracks): L = 128 costs it ten minutes of CPU or
   more; ``--layers 2,8,32`` leaves that out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grid  # noqa: E402
import torch  # noqa: E402

TOOLS = ("symmem", "llm-analysis", "MemTracker", "MemTracker fake")
ROWS = ("symmem", "llm-analysis", "MemTracker", "MemTracker + setup", "MemTracker fake", "MemTracker fake + setup")


def _clock() -> float:
    return time.process_time()


def memtracker_step(case: grid.Case, fake: bool, cfg) -> tuple[float, float, int]:
    """Seconds to build the model and run the warm-up step, seconds of MemTracker's tracked
    step (forward, backward, optimizer step), and its peak."""
    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    t0 = _clock()
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(0)
        model = getattr(transformers, grid.FAMILIES[case.family][1])(cfg)
        model.train()
        ids = torch.randint(0, cfg.vocab_size, (case.b, case.s))
        opt = grid.make_optimizer(case, model.parameters())
        fwd = grid.loss_fn(case, ids)
        fwd(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = _clock()
        mt = MemTracker()
        mt.track_external(model, opt, ids)
        with mt:
            loss = fwd(model)
            loss.backward()
            del loss
            opt.step()
        peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        return t - t0, _clock() - t, peak


def one_case(tool: str, case, cfg) -> dict:
    """CPU seconds of one tool's answer for a case (MemTracker: its setup and its step apart)."""
    t = time.process_time()
    if tool == "symmem":
        grid.symmem_answer(case, cfg)
    elif tool == "llm-analysis":
        grid.llm_analysis_answer(case, cfg)
    else:
        setup, step, _ = memtracker_step(case, tool.endswith("fake"), cfg)
        return {tool: step, tool + " + setup": setup + step}
    return {tool: time.process_time() - t}


def process(tool: str, cases) -> dict:
    """One tool over the grid in this (fresh) process: the CPU seconds of importing the
    tool's own package, then of each case."""
    t = time.process_time()
    if tool == "symmem":
        import symmem  # noqa: F401
    elif tool == "llm-analysis":
        import llm_analysis.analysis  # noqa: F401
    else:
        import torch.distributed._tools.mem_tracker  # noqa: F401
        import torch._subclasses.fake_tensor  # noqa: F401
    out = {"import": time.process_time() - t, "cases": []}
    for case in cases:
        out["cases"].append(one_case(tool, case, grid.hf_config(case)))
        print(f"# {tool} {case.label}: {out['cases'][-1]}", file=sys.stderr, flush=True)
    return out


def layers(ns, runs, walls, path=None) -> list[dict]:
    import sympy
    import symmem as sm

    case = grid.Case("llama", "sdpa", "bf16-mixed", "adamw")
    policy = sm.Policy(case.precision, case.optimizer, "cpu", "for-loop")
    sympy.core.cache.clear_cache()
    t = time.process_time()
    est = sm.estimate(grid.symmem_graph(grid.hf_config(case)), policy)
    derive_once = time.process_time() - t
    rows = []
    for n in ns:
        cfg = grid.hf_config(case, num_hidden_layers=n)
        t = time.process_time()
        once = est.at(b=case.b, s=case.s, L=n).peak
        evaluate = time.process_time() - t
        sympy.core.cache.clear_cache()
        t = time.process_time()
        fresh = sm.estimate(grid.symmem_graph(cfg), policy).at(b=case.b, s=case.s).peak
        per_l = time.process_time() - t
        assert once == fresh, (n, once, fresh)
        _, mt, mt_peak = memtracker_step(case, True, cfg)
        rows.append(dict(L=n, derive_once=derive_once, evaluate=evaluate, derive_per_L=per_l, memtracker_fake=mt,
                         symmem_peak=once, memtracker_peak=mt_peak))
        print(f"# L={n}: {rows[-1]}", file=sys.stderr, flush=True)
        if path:                    # after each L: a run stopped early keeps what it has
            Path(path).write_text(json.dumps({"runs": runs, "walls": walls, "layers": rows}, indent=1))
    return rows


def print_grid(runs, walls, cases) -> None:
    times = {r: [c[r] for c in runs[r.removesuffix(" + setup")]["cases"]] for r in ROWS}
    print(f"Per configuration, {len(cases)} cases of the accuracy grid, each tool in its own process, "
          f"the cases in order (CPU seconds)")
    print(f"{'tool':<24}  {'median':>8}  {'min':>8}  {'max':>8}  {'sum':>8}  {'median / symmem':>15}")
    med = {t: sorted(v)[len(v) // 2] for t, v in times.items()}
    for t, v in times.items():
        print(f"{t:<24}  {med[t]:8.3f}  {min(v):8.3f}  {max(v):8.3f}  {sum(v):8.2f}  {med[t] / med['symmem']:15.3g}")
    print()
    print("The whole grid, one process per tool: CPU seconds of the process (interpreter, every import,"
          " the grid), of which importing the tool's package; wall clock")
    print(f"{'tool':<24}  {'process CPU':>11}  {'import':>8}  {'wall':>8}  {'CPU / symmem':>12}")
    for t in TOOLS:
        print(f"{t:<24}  {runs[t]['cpu']:11.2f}  {runs[t]['import']:8.2f}  {walls[t]:8.1f}  "
              f"{runs[t]['cpu'] / runs['symmem']['cpu']:12.3g}")
    print()


def print_layers(rows) -> None:
    print(f"Layers: Llama {grid.FAMILIES['llama'][2]['hidden_size']} wide, sdpa, bf16 autocast, AdamW, "
          f"b={grid.Case('llama', '', '', '').b}, s={grid.Case('llama', '', '', '').s} (CPU seconds)")
    print(f"{'L':>4}  {'symmem derive once':>18}  {'+ evaluate at L':>15}  {'symmem derive per L':>19}  "
          f"{'MemTracker fake':>15}  {'fake / per L':>12}  {'fake / eval':>11}  {'symmem peak':>14}  {'MemTracker fake':>15}")
    for r in rows:
        print(f"{r['L']:>4}  {r['derive_once']:18.3f}  {r['evaluate']:15.5f}  {r['derive_per_L']:19.3f}  "
              f"{r['memtracker_fake']:15.3f}  {r['memtracker_fake'] / r['derive_per_L']:12.1f}  "
              f"{r['memtracker_fake'] / r['evaluate']:11.0f}  {r['symmem_peak']:>14,}  {r['memtracker_peak']:>15,}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="all 48 combinations (default: the 24 of the half fraction)")
    ap.add_argument("--only", help="one family (per-configuration and process tables)")
    ap.add_argument("--layers", default="2,8,32,128")
    ap.add_argument("--json", help="write the raw times to this file")
    ap.add_argument("--from-json", help="print the tables of a file --json wrote, without running anything")
    ap.add_argument("--process", choices=TOOLS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c for c in (grid.FULL_GRID if args.full else grid.GRID) if not args.only or c.family == args.only]
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print_grid(saved["runs"], saved["walls"], cases)
        print_layers(saved.get("layers", []))
        return 0
    torch.set_num_threads(1)
    if args.process:
        print(json.dumps(process(args.process, cases)))
        return 0

    runs, walls = {}, {}
    cmd = [sys.executable, __file__] + (["--full"] if args.full else []) + (["--only", args.only] if args.only else [])
    for t in TOOLS:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run(cmd + ["--process", t], check=True, stdout=subprocess.PIPE, text=True).stdout
        walls[t] = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs[t] = json.loads(out.splitlines()[-1])
        runs[t]["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        print(f"# {t}: {runs[t]['cpu']:.1f} s of CPU", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": runs, "walls": walls}, indent=1))

    ns = [int(x) for x in args.layers.split(",")]
    rows = layers(ns, runs, walls, args.json)
    print_grid(runs, walls, cases)
    print_layers(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
