"""Time ``symmem estimate`` as a whole process, as a user waits for it: with the cache off
(``SYMMEM_NO_CACHE=1``), cold (an empty cache directory: derive and store), warm estimate
(the derived estimate there, the question new: another batch size each run, so the answer
is computed from the stored formulas: from the question's kit, :mod:`symmem.kit`, without
sympy), the same with ``--format json`` (from its own kit), the same without kits (each
removed before the run: sympy evaluates the stored estimate) and warm answer (the same
question again: the stored answer printed, no sympy imported), beside ``python -c pass``
(the interpreter alone) and ``python -c "import symmem; symmem.models"`` (the library with
sympy and the families). The processes write and read Python's bytecode (``__pycache__``),
as an installed package does, whatever ``PYTHONDONTWRITEBYTECODE`` says.

Run: python benchmarks/bench_cli.py [--runs 5]

Each row is the median of ``--runs`` processes; the cases run in turns (one process of each,
then the next round), so that a machine's load falls on every column alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYMMEM = [sys.executable, "-m", "symmem"]
QUESTIONS = {"gpt2": ["estimate", "--model", "gpt2", "--batch", "8", "--seq", "1024", "--precision",
                      "bf16-mixed", "--optimizer", "adamw"],
             "llama-2-7b": ["estimate", "--model", "llama-2-7b", "--batch", "1", "--seq", "4096",
                            "--precision", "bf16-mixed", "--optimizer", "adamw"]}


def timed(cmd, env) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    # as a user's install runs: with the bytecode of symmem's modules written and read back
    # (PYTHONDONTWRITEBYTECODE, set on some machines, would compile every module in every process)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    base["PYTHONPATH"] = str(root)
    timed([sys.executable, "-c", "import symmem.cli, symmem.models"], base)    # write the bytecode once
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            times.setdefault(("python -c pass", ""), []).append(timed([sys.executable, "-c", "pass"], base))
            times.setdefault(("import symmem", "with sympy and the families"), []).append(
                timed([sys.executable, "-c", "import symmem; symmem.models"], base))
            for name, question in QUESTIONS.items():
                off = {**base, "SYMMEM_NO_CACHE": "1"}
                cold = {**base, "SYMMEM_NO_CACHE": "0", "SYMMEM_CACHE_DIR": f"{tmp}/cold{run}"}
                warm = {**base, "SYMMEM_NO_CACHE": "0", "SYMMEM_CACHE_DIR": f"{tmp}/warm"}
                def batch(n):
                    i = question.index("--batch") + 1
                    return [*question[:i], str(n), *question[i + 1:]]
                as_json = ["--format", "json"]
                if run == 0:                                 # fill the warm cache once, the kits with it
                    for fmt in ([], as_json):
                        timed(SYMMEM + question + fmt, warm)
                        timed(SYMMEM + batch(99) + fmt, warm)
                for label, env, cmd in (("no cache", off, question), ("cold cache", cold, question),
                                        ("warm estimate", warm, batch(100 + run)),
                                        ("warm estimate, JSON", warm, batch(100 + run) + as_json),
                                        ("warm estimate without kits", warm, batch(200 + run)),
                                        ("warm answer", warm, question)):
                    if label.endswith("without kits"):
                        kits = [(k, k.read_bytes()) for k in Path(warm["SYMMEM_CACHE_DIR"]).glob("answers/*.kit.json")]
                        for k, _ in kits:
                            k.unlink()
                    times.setdefault((name, label), []).append(timed(SYMMEM + cmd, env))
                    if label.endswith("without kits"):
                        for k, blob in kits:                 # put back for the next round
                            k.write_bytes(blob)
    print(f"{'whole process':<48}{'median':>9}{'min':>9}   ({args.runs} runs; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end)")
    for (name, label), ts in times.items():
        print(f"{(name + ' ' + label).strip():<48}{statistics.median(ts):>8.2f}s{min(ts):>8.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
