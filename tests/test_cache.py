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
         "print(fingerprint(sm.models.preset('llama-2-7b'), sm.Policy('bf16-mixed', 'adamw')))"


@pytest.fixture
def on(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMEM_NO_CACHE", "0")
    monkeypatch.setenv("SYMMEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_key_is_the_same_in_every_process():
    # sets and dict orders vary with the hash seed: the key must not
    keys = {subprocess.run([sys.executable, "-c", SOURCE], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(keys) == 1 and len(keys.pop().strip()) == 64


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
