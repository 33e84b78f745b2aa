"""The cache of derived estimates on disk (symmem.cache): keys equal across processes and
different for different models, policies or code; entries read back equal; a corrupt, truncated
or foreign entry derived afresh, never trusted; off with SYMMEM_NO_CACHE=1."""
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import sympy as sp

import symmem as sm
from symmem import cache, engine

SOURCE = "import symmem as sm; from symmem.cache import fingerprint; " \
         "print(fingerprint(sm.models.preset('llama-2-7b'), sm.Policy('bf16-mixed', 'adamw'))); " \
         "print(fingerprint(sm.models.preset('t5-small'), sm.Policy(attention='eager', recompute='full')))"


@pytest.fixture
def on(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMEM_NO_CACHE", "0")
    monkeypatch.setenv("SYMMEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_key_is_the_same_in_every_process():
    # sets and dict orders vary with the hash seed: the key must not
    keys = {subprocess.run([sys.executable, "-c", SOURCE], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    # (T5's graph holds a function among a node's attributes: named, not by its address)
    assert len(keys) == 1 and [len(k) for k in keys.pop().split()] == [64, 64]


def test_the_key_changes_with_the_model_the_policy_and_tying():
    g, p = sm.models.preset("gpt2"), sm.Policy("fp32", "adamw")
    cfg = sm.models.preset_config("gpt2")[1]
    untied = sm.models.gpt2.build_gpt2(replace(cfg, tie_word_embeddings=False))
    keys = {cache.fingerprint(g, p), cache.fingerprint(g, replace(p, optimizer="sgd")),
            cache.fingerprint(sm.models.preset("gpt2-medium"), p), cache.fingerprint(untied, p)}
    assert len(keys) == 4
    assert cache.fingerprint(g, p) == cache.fingerprint(sm.models.preset("gpt2"), sm.Policy("fp32", "adamw"))


def test_an_entry_is_read_back_without_deriving(on, monkeypatch):
    g, p = sm.models.preset("gpt2"), sm.Policy("bf16-mixed", "adamw")
    first = cache.cached_estimate(g, p)
    assert not list(on.glob("*.pickle"))            # written when the command is done
    first.regions()                                  # what the command computed goes with it
    cache.store()
    assert len(list(on.glob("*.pickle"))) == 1

    def derive(*_):
        raise AssertionError("derived again")
    monkeypatch.setattr(engine, "estimate", derive)
    again = cache.cached_estimate(g, p)
    assert again is not first
    assert "peak" not in vars(again)                 # rebuilt from the candidates, not unpickled
    assert again.components == first.components and sp.expand(again.peak - first.peak) == 0
    assert again.at(b=8, s=1024).peak == first.at(b=8, s=1024).peak
    assert "_regions" in vars(again) and again.regions() == first.regions()


@pytest.mark.parametrize("name", ["llama-2-7b", "mixtral-8x7b"])
def test_an_entry_reads_back_the_same_expressions(on, name):
    # read back without sympy's evaluation: every stored expression must come back as the
    # same tree (srepr), ceilings (flash's ceiling(s/128) on CUDA), ratios (h/a) and the
    # 8-bit optimizer's Piecewise included
    p = sm.Policy("bf16-mixed", "adam8bit")
    first = cache.cached_estimate(sm.models.preset(name), p)
    cache.store()
    again = cache.cached_estimate(sm.models.preset(name), p)
    assert again is not first
    assert any(x.has(sp.ceiling) for x in first.candidates) and first.components["optimizer"].has(sp.Piecewise)
    assert [sp.srepr(x) for x in again.components.values()] == [sp.srepr(x) for x in first.components.values()]
    assert [sp.srepr(x) for x in again.candidates] == [sp.srepr(x) for x in first.candidates]
    assert [sp.srepr(p.total) for p in again.points] == [sp.srepr(p.total) for p in first.points]
    assert sp.srepr(again.peak) == sp.srepr(first.peak)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "foreign key", "not a pickle"])
def test_a_damaged_entry_is_derived_afresh(on, damage):
    g, p = sm.models.preset("gpt2"), sm.Policy("fp32", "sgd")
    good = cache.cached_estimate(g, p)
    cache.store()
    (path,) = on.glob("*.pickle")
    blob = bytearray(path.read_bytes())
    if damage == "flip a byte":
        blob[-10] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "foreign key":     # another entry's file under this name
        blob[len(cache._MAGIC) + 32] ^= 0x01
    else:
        blob = bytearray(b"garbage")
    path.write_bytes(bytes(blob))
    again = cache.cached_estimate(g, p)
    cache.store()
    assert again.components == good.components
    assert cache._read(path, path.stem) is not None     # rewritten sound


def test_no_cache_writes_nothing(on, monkeypatch):
    monkeypatch.setenv("SYMMEM_NO_CACHE", "1")
    assert cache.cache_dir() is None
    cache.cached_estimate(sm.models.preset("gpt2"), sm.Policy())
    cache.store()
    assert not on.exists()


def test_an_unwritable_directory_leaves_the_cache_off(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SYMMEM_NO_CACHE", "0")
    monkeypatch.setenv("SYMMEM_CACHE_DIR", str(blocker / "cache"))
    est = cache.cached_estimate(sm.models.preset("gpt2"), sm.Policy())
    cache.store()
    assert est.at(b=1, s=8).peak > 0


def test_the_command_line_uses_the_cache(on):
    env = {**os.environ, "SYMMEM_NO_CACHE": "0", "SYMMEM_CACHE_DIR": str(on)}
    cmd = [sys.executable, "-m", "symmem", "estimate", "--model", "gpt2", "--batch", "8", "--seq", "1024",
           "--format", "json"]
    cold = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    assert len(list(on.glob("*.pickle"))) == 1
    warm = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    assert warm == cold
    assert cache.clear() == 1 and not list(on.glob("*.pickle"))


# ----------------------------------------------------------------------------- answers

QUESTION = ["estimate", "--model", "gpt2", "--batch", "4", "--seq", "512", "--precision", "bf16-mixed"]


def _run(argv, env, probe=False):
    """``python -m symmem argv`` (with ``probe``: through symmem.__main__.main in-process, then
    whether sympy was imported, on the last line)."""
    if not probe:
        return subprocess.run([sys.executable, "-m", "symmem", *argv], capture_output=True, text=True, env=env)
    code = ("import sys; from symmem.__main__ import main; rc = main(sys.argv[1:]); "
            "print('SYMPY' if 'sympy' in sys.modules else 'NO SYMPY'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env)


def test_the_answer_key():
    key = cache.answer_key(QUESTION)
    assert len(key) == 64 and key == cache.answer_key(list(QUESTION))
    assert cache.answer_key(QUESTION[:-1] + ["fp32"]) != key
    for argv in (["sweep", "--model", "gpt2"], ["report", "--model", "gpt2"], ["models"], [],
                 ["estimate", "--config", "c.json"], ["estimate", "--config=c.json"],
                 ["estimate", "--conf", "c.json"], ["max-batch", "--co=c.json"]):
        assert cache.answer_key(argv) is None, argv


def test_the_answer_key_changes_with_the_code(monkeypatch):
    key = cache.answer_key(QUESTION)
    monkeypatch.setattr(cache, "_code_digest", lambda: "another version")
    assert cache.answer_key(QUESTION) != key


def test_an_answer_is_replayed_without_sympy(on):
    env = {**os.environ, "SYMMEM_NO_CACHE": "0", "SYMMEM_CACHE_DIR": str(on)}
    cold = _run(QUESTION, env, probe=True)
    assert cold.returncode == 0 and cold.stdout.endswith("SYMPY\n") and not cold.stdout.endswith("NO SYMPY\n")
    assert len(list(on.glob("answers/*.txt"))) == 1
    warm = _run(QUESTION, env, probe=True)
    assert warm.returncode == 0 and warm.stdout.endswith("NO SYMPY\n")
    assert warm.stdout[:-len("NO SYMPY\n")] == cold.stdout[:-len("SYMPY\n")]
    # another batch: a miss of the answers, answered from the question's kit (symmem.kit,
    # tests/test_kit.py); another sequence too, where the same candidate is the peak
    other = _run(QUESTION[:4] + ["8"] + QUESTION[5:], env, probe=True)
    assert other.returncode == 0 and other.stdout != warm.stdout and other.stdout.endswith("NO SYMPY\n")
    assert len(list(on.glob("*.pickle"))) == 1 and len(list(on.glob("answers/*.txt"))) == 1
    assert len(list(on.glob("answers/*.kit.json"))) == 1


def test_a_damaged_answer_is_not_trusted(on):
    env = {**os.environ, "SYMMEM_NO_CACHE": "0", "SYMMEM_CACHE_DIR": str(on)}
    good = _run(QUESTION, env).stdout
    (path,) = on.glob("answers/*.txt")
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x01                       # one character of the stored answer changed
    path.write_bytes(bytes(blob))
    again = _run(QUESTION, env, probe=True)
    assert again.stdout == good + "NO SYMPY\n"       # not the damaged text: the question's kit's
    for kept in on.glob("answers/*.kit.json"):
        kept.unlink()
    again = _run(QUESTION, env, probe=True)
    assert again.stdout == good + "SYMPY\n"          # without the kit: derived (read the estimate)
    assert _run(QUESTION, env).stdout == good         # and stored afresh


def test_failures_and_the_off_switch_store_no_answer(on, tmp_path):
    env = {**os.environ, "SYMMEM_NO_CACHE": "0", "SYMMEM_CACHE_DIR": str(on)}
    bad = _run(["estimate", "--model", "gpt-3", "--batch", "1", "--seq", "8"], env)
    assert bad.returncode == 1 and "gpt-3" in bad.stderr
    assert not list(on.glob("answers/*.txt"))
    off = {**env, "SYMMEM_NO_CACHE": "1", "SYMMEM_CACHE_DIR": str(tmp_path / "off")}
    assert _run(QUESTION, off).returncode == 0
    assert not (tmp_path / "off").exists()
