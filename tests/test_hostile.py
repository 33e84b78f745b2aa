"""Hostile input, to the command line and to the Python API: a clear error (exit status 1 or
2, a message naming the value), never a traceback, nothing written to disk."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import symmem as sm
from symmem.cli import main
from symmem.errors import ConfigError, SymmemError

ROOT = Path(__file__).resolve().parents[1]
TINY = json.loads((ROOT / "examples" / "tiny-gpt2" / "config.json").read_text())

# config.json contents -> words the message must contain
CONFIGS = {
    "nested 100,000 levels": ('{"a":' * 100_000 + "1" + "}" * 100_000, ["nested", "levels"]),
    "model_type a list": (json.dumps({**TINY, "model_type": ["gpt2"]}), ["model_type = ['gpt2']", "one of bert, gpt2"]),
    "n_embd a string": (json.dumps({**TINY, "n_embd": "768"}), ["n_embd = '768'", "positive integer"]),
    "n_embd infinite": (json.dumps({**TINY, "n_embd": 1e400}), ["n_embd = inf", "positive integer"]),
    "n_layer fractional": (json.dumps({**TINY, "n_layer": 2.5}), ["n_layer = 2.5", "positive integer"]),
    "n_head zero": (json.dumps({**TINY, "n_head": 0}), ["n_head = 0", "positive integer"]),
    "dropout above one": (json.dumps({**TINY, "resid_pdrop": 2.0}), ["resid_pdrop = 2.0", "[0, 1)"]),
    "tie_word_embeddings a string": (json.dumps({**TINY, "tie_word_embeddings": "yes"}),
                                     ["tie_word_embeddings = 'yes'", "true or false"]),
    "not an object": ("[1, 2]", ["config = 'list'", "a dict"]),
    "empty file": ("", ["valid JSON"]),
}


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    """The test runs in an empty folder, which must stay empty."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    yield work
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("case", CONFIGS, ids=list(CONFIGS))
def test_bad_configs(case, tmp_path, empty_cwd, capsys):
    text, words = CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_text(text)
    code = main(["estimate", "--config", str(path), "--batch", "1", "--seq", "8"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.startswith("symmem: error: ")
    for w in words:
        assert w in err, (w, err)
    with pytest.raises(SymmemError) as e:                    # the same from Python
        sm.models.from_hf_config(path)
    assert all(w in str(e.value) for w in words)


def test_a_sweep_larger_than_memory_streams(empty_cwd):
    """10^8 x 1,024 rows (about 760 GiB as one array): the rows stream out as they are
    computed, and a reader that stops early (| head) ends it quietly."""
    cmd = [sys.executable, "-c", "from symmem.cli import main; raise SystemExit(main())",
           "sweep", "--model", "gpt2", "--batch", "1:100000000", "--seq", "1:1024"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as p:
        lines = [p.stdout.readline() for _ in range(3)]
        p.stdout.close()                                     # the reader goes away
        err = p.stderr.read()
        code = p.wait(timeout=120)
    assert lines[0].startswith("b,s,params,") and lines[1].startswith("1,1,") and lines[2].startswith("1,2,")
    assert code == 0 and "Traceback" not in err


def test_sweep_ranges_are_not_written_out():
    from symmem.cli import _values
    big = _values("1:1000000000000", "--batch")
    assert isinstance(big, range) and len(big) == 10**12
    with pytest.raises(ConfigError, match=r"--batch = '0:5' is not valid"):
        _values("0:5", "--batch")


# argv -> (exit status, words of the message): each case of the newcomer's hour, and more
CLI = {
    "solve for h, fixed h not a multiple of a": (["solve", "--model", "gpt2", "--for", "b", "--seq", "1024",
                                                  "--set", "h=770", "--budget", "80GB"], 1, ["h = 770", "multiple of 12"]),
    "solve for a byte price": (["solve", "--model", "gpt2", "--for", "B_a", "--batch", "8", "--seq", "1024",
                                "--budget", "80GB"], 1, ["'B_a'", "not a byte price"]),
    "solve for the budget": (["solve", "--model", "gpt2", "--for", "M", "--batch", "8", "--seq", "1024",
                              "--budget", "80GB"], 1, ["'M'", "not the budget"]),
    "smallest b": (["solve", "--model", "gpt2", "--for", "b", "--min", "--seq", "1024", "--budget", "80GB"], 1,
                   ["direction = 'min'", "does not fall as b grows"]),
    "a symbol in no formula": (["solve", "--model", "gpt2", "--for", "g", "--min", "--batch", "8", "--seq", "1024",
                                "--budget", "80GB"], 1, ["'g'", "depends on"]),
    "a budget past the search": (["max-batch", "--model", "gpt2", "--seq", "1024", "--budget", "1e30"], 1,
                                 ["beyond the search", "2^40"]),
    "negative budget": (["max-batch", "--model", "gpt2", "--seq", "1024", "--budget", "-5GB"], 1, ["'-5GB'"]),
    "budget in gigabytes spelled out": (["max-batch", "--model", "gpt2", "--seq", "1024", "--budget", "80 gigabytes"],
                                        1, ["'80 gigabytes'", "80G (read as GiB)"]),
    "sequence past n_positions": (["sweep", "--model", "gpt2", "--batch", "1:4", "--seq", "512,2048"], 1,
                                  ["s = 2048", "s_max = 1024"]),
    "a range that is not one": (["sweep", "--model", "gpt2", "--batch", "4:1:0", "--seq", "8"], 1, ["'4:1:0'"]),
    "unknown recompute": (["estimate", "--model", "gpt2", "--batch", "1", "--seq", "8", "--recompute", "half"], 1,
                          ["'half'"]),
    "report named twice": (["report", "gpt2", "--model", "gpt2"], 2, ["name the model once"]),
    "unknown component": (["formula", "--model", "gpt2", "--component", "weights"], 1, ["'weights'"]),
}


@pytest.mark.parametrize("case", CLI, ids=list(CLI))
def test_hostile_command_lines(case, empty_cwd, capsys):
    argv, status, words = CLI[case]
    if status == 2:
        with pytest.raises(SystemExit) as e:
            main(argv)
        code = e.value.code
    else:
        code = main(argv)
    out, err = capsys.readouterr()
    assert code == status and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_what_a_newcomer_passes_to_estimate():
    """A preset's name is taken for the model (sm.estimate("gpt2")); anything else that is not
    a Graph, or a policy that is not a Policy, gets a message with the fix."""
    assert sm.estimate("gpt2").at(b=1, s=8).peak == sm.estimate(sm.models.preset("gpt2")).at(b=1, s=8).peak
    with pytest.raises(ConfigError, match=r"^graph = 'int' is not valid: expected a Graph, or a preset's name"):
        sm.estimate(3)
    with pytest.raises(ConfigError, match=r"^policy = 'bf16-mixed' is not valid: expected a Policy\. "
                                          r"E\.g\. sm\.Policy\(precision='bf16-mixed'"):
        sm.estimate("gpt2", "bf16-mixed")
