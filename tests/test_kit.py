"""symmem.kit: a table (or JSON) asked again at other values, answered from the kit the first
answer kept, without sympy, and printed exactly as the sympy path prints it."""
import os
import subprocess
import sys

import pytest

from symmem import kit
from symmem.__main__ import main

# (the first question, then other values; each list of argv tokens after the values)
QUESTIONS = [
    # fp32 on CUDA: SDPA's mem-efficient kernel, its log-sum-exp rounded up to 32 rows (a ceiling of s)
    (["estimate", "--model", "llama-2-7b"], [(8, 2048), (4, 1000), (64, 4096), (2, 100_000)]),
    # bf16 autocast: flash, its backward's rounding to 128 rows
    (["estimate", "--model", "gpt2", "--precision", "bf16-mixed", "--recompute", "full"], [(4, 512), (32, 1024)]),
    # two sequence lengths and a Max among the candidates (T5's causal bias mask)
    (["estimate", "--model", "t5-small", "--decoder-seq", "64", "--precision", "fp32"], [(8, 512), (2, 64)]),
    (["estimate", "--model", "mixtral-8x7b", "--precision", "bf16"], [(1 + 1, 4096), (16, 512)]),
    (["infer", "--model", "llama-3-8b", "--precision", "bf16", "--new-tokens", "256"], [(8, 4096), (64, 128)]),
    # ZeRO-3 with the optimizer on the host: the host's bytes beside the peak
    (["estimate", "--model", "gpt2", "--dp", "2", "--zero", "3", "--offload", "optimizer"], [(4, 512), (8, 1024)]),
]


def _argv(head, b, s):
    return [*head, "--batch", str(b), "--seq", str(s)]


def _sympy_path(argv, capsys, monkeypatch):
    monkeypatch.setenv("SYMMEM_NO_CACHE", "1")
    assert main(argv) == 0
    monkeypatch.setenv("SYMMEM_NO_CACHE", "0")
    return capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["table", "json"])
@pytest.mark.parametrize("head,points", QUESTIONS, ids=[" ".join(q[0][:3]) for q in QUESTIONS])
def test_a_kit_prints_what_sympy_prints(head, points, fmt, tmp_path, monkeypatch, capsys):
    """The first question keeps a kit; each later one is answered from it (the sympy path when
    its peak is a candidate no question had yet, which adds it), and every answer equals the
    sympy path's at the same values, byte for byte, as a table and as JSON."""
    head = [*head, "--format", fmt]
    monkeypatch.setenv("SYMMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SYMMEM_NO_CACHE", "0")
    first = _argv(head, *points[0])
    assert main(first) == 0
    capsys.readouterr()
    assert kit.load(first) is not None
    for b, s in points[1:] * 2:             # twice: the second time every peak is kept
        argv = _argv(head, b, s)
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out == _sympy_path(argv, capsys, monkeypatch), (b, s)
    for b, s in points[1:]:                 # now from the kit alone
        out = kit.text(kit.load(first), {"b": b, "s": s, **({"n_g": 256} if head[0] == "infer" else {})})
        assert out is not None and out + "\n" == _sympy_path(_argv(head, b, s), capsys, monkeypatch)


def _probe(argv, env):
    code = ("import sys; from symmem.__main__ import main; rc = main(sys.argv[1:]); "
            "print('SYMPY' if 'sympy' in sys.modules else 'NO SYMPY'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("fmt,shown", [("table", "b = 16"), ("json", '"batch": 16')])
def test_a_kit_answers_without_sympy(fmt, shown, tmp_path):
    """Another batch and sequence of a question asked before: no sympy imported."""
    env = {**os.environ, "SYMMEM_NO_CACHE": "0", "SYMMEM_CACHE_DIR": str(tmp_path)}
    head = ["estimate", "--model", "llama-2-7b", "--precision", "bf16-mixed", "--format", fmt]
    assert _probe(_argv(head, 8, 2048), env).stdout.endswith("\nSYMPY\n")
    again = _probe(_argv(head, 16, 2048), env)      # the same candidate binds: from the kit
    assert again.returncode == 0 and again.stdout.endswith("NO SYMPY\n") and shown in again.stdout


def test_what_a_kit_leaves_to_sympy(tmp_path, monkeypatch, capsys):
    """b = 1 (derived apart) and values that break a requirement (a sequence past GPT-2's 1,024
    positions) are not answered from the kit: the sympy path prints the answer or the error; a
    pipeline keeps no kit."""
    monkeypatch.setenv("SYMMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SYMMEM_NO_CACHE", "0")
    head = ["estimate", "--model", "gpt2"]
    assert main(_argv(head, 4, 512)) == 0
    k = kit.load(_argv(head, 4, 512))
    assert kit.evaluate(k, {"b": 1, "s": 512}) is None
    assert kit.evaluate(k, {"b": 4, "s": 2048}) is None
    capsys.readouterr()
    assert main(_argv(head, 4, 2048)) == 1
    assert "s = 2048 is not valid" in capsys.readouterr().err
    for fmt in ("table", "json"):       # a pipeline's stages: each stage's bytes, not in a kit
        assert main(_argv([*head, "--pp", "2", "--format", fmt], 4, 512)) == 0
        assert kit.load(_argv([*head, "--pp", "2", "--format", fmt], 4, 512)) is None


def test_the_template():
    """The free values come out of the key in either spelling; a value given twice, missing or
    not a positive integer leaves the question to the sympy path (which names the error)."""
    key, values = kit.template(["estimate", "--model", "gpt2", "--batch", "8", "--seq=1024"])
    assert values == {"b": 8, "s": 1024}
    assert kit.template(["estimate", "--model", "gpt2", "--batch=2", "--seq", "64"])[0] == key
    assert kit.template(["estimate", "--model", "gpt2", "--batch", "8", "--seq", "1024", "--precision", "bf16"])[0] != key
    for argv in (["estimate", "--model", "gpt2", "--batch", "8", "--batch", "4"],
                 ["estimate", "--model", "gpt2", "--batch", "0"], ["estimate", "--model", "gpt2", "--batch", "-8"],
                 ["estimate", "--model", "gpt2", "--batch"], ["max-batch", "--model", "gpt2"], []):
        assert kit.template(argv) is None, argv


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_window_s_two_regions_share_a_key(fmt, tmp_path, monkeypatch, capsys):
    """Mistral 7B v0.1 under SDPA: below its window of 4,096 and from it on the formulas differ
    (transformers passes SDPA the window's mask), under the same kit key; each region's
    questions print what the sympy path prints, whichever region the kit was kept for."""
    monkeypatch.setenv("SYMMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SYMMEM_NO_CACHE", "0")
    head = ["estimate", "--model", "mistral-7b", "--precision", "bf16-mixed", "--format", fmt]
    for b, s in [(4, 2048), (4, 8192), (8, 8192), (8, 2048), (4, 2048), (4, 8192)]:
        assert main(_argv(head, b, s)) == 0
        out = capsys.readouterr().out
        assert out == _sympy_path(_argv(head, b, s), capsys, monkeypatch), (b, s)
    kept = kit.load(_argv(head, 8, 2048))       # the last kept, at (8, 2048): s below the window
    assert kit.text(kept, {"b": 8, "s": 2048}) is not None and kit.text(kept, {"b": 8, "s": 8192}) is None
