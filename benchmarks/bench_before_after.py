"""Derivation time of this tree beside an earlier commit's, side by side in one run.

Run: python benchmarks/bench_before_after.py [REF]     (REF defaults to d4642f8, the last
commit before the step became a plan, passes and one counter)

REF is checked out into a temporary git worktree (removed afterwards). For each case a fresh
Python process imports one tree and times ``sm.estimate(graph, policy)`` with its ``peak``:
the first (cold: sympy's caches empty) and the best of three further runs (warm). The trees
take turns, so that a change in the machine's load touches both columns alike. Policies the
older tree does not know (recomputation, accumulation, SDPA, LoRA) are timed for this tree
only; both run eager attention otherwise, the only one the older tree has.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import symmem as sm
model, L, kwargs = json.loads(sys.argv[1])
cfg = sm.models.PRESETS[model]
if L != cfg.n_layer:
    cfg = sm.models.GPT2Config(n_embd=cfg.n_embd, n_layer=L, n_head=cfg.n_head,
                               n_positions=cfg.n_positions, name=f"L{L}")
graph = sm.models.build_gpt2(cfg)
if "attention" in sm.Policy.__dataclass_fields__:     # eager: the older tree's only attention
    kwargs = {"attention": "eager", **kwargs}
policy = sm.Policy("bf16-mixed", "adamw", "cuda", **kwargs)
times = []
for _ in range(4):
    t = time.perf_counter()
    est = sm.estimate(graph, policy)
    est.peak
    times.append(time.perf_counter() - t)
print(json.dumps([times[0], min(times[1:]), len(est.points)]))
"""

CASES = [("gpt2", 12, {}), ("gpt2", 2, {}), ("gpt3-175b", 96, {}), ("gpt3-175b", 512, {}),
         ("gpt2", 12, {"recompute": "full"}), ("gpt2", 12, {"recompute": "selective"}),
         ("gpt2", 12, {"accumulate": 4}), ("gpt3-175b", 96, {"recompute": "full"}),
         ("gpt2", 12, {"attention": "sdpa"}), ("gpt2", 12, {"attention": "sdpa", "lora": 8})]


def timed(tree: pathlib.Path, case) -> list | None:
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], cwd=tree,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(run.stdout) if run.returncode == 0 else None


def main():
    ref = sys.argv[1] if len(sys.argv) > 1 else "d4642f8"
    with tempfile.TemporaryDirectory() as tmp:
        old = pathlib.Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), ref], cwd=HERE,
                       check=True, capture_output=True)
        try:
            print(f"derivation time (s), bf16-mixed AdamW CUDA; before = {ref}, after = this tree")
            print(f"{'model':<11}{'L':>5}  {'policy':<22}{'before cold':>12}{'warm':>7}"
                  f"{'after cold':>12}{'warm':>7}{'ratio warm':>12}")
            for model, L, kwargs in CASES:
                before = timed(old, (model, L, kwargs)) if not kwargs else None
                after = timed(HERE, (model, L, kwargs))
                policy = ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "attention=eager"
                cols = (f"{before[0]:>12.2f}{before[1]:>7.2f}" if before else f"{'—':>12}{'—':>7}")
                ratio = f"{after[1] / before[1]:>12.2f}" if before else f"{'—':>12}"
                print(f"{model:<11}{L:>5}  {policy:<22}{cols}{after[0]:>12.2f}{after[1]:>7.2f}{ratio}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=HERE,
                           capture_output=True)


if __name__ == "__main__":
    main()
