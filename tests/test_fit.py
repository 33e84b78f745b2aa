"""symmem fit: the layouts that fit, fewest GPUs first, each checked against its own estimate."""
import json

import pytest

import symmem as sm
from symmem.cli import main
from symmem.errors import ConfigError
from symmem.fit import fit
from symmem.gpus import budget


@pytest.fixture(scope="module")
def gpt2_layouts():
    # GPT-2 small, s = 1024, 64 sequences a step, on 16 GiB - 10%, up to 2 GPUs
    return fit(sm.models.preset("gpt2"), budget(bytes="16GiB"), 1024, 64, max_gpus=2)


def _sample(layouts):
    """The first layout of each (gpus, sharding): every kind of estimate fit derives, checked
    with a derivation of its own (the layout's numbers, not fit's symbols d and t)."""
    seen, out = set(), []
    for x in layouts:
        if (x.gpus, x.sharding) not in seen:
            seen.add((x.gpus, x.sharding))
            out.append(x)
    return out


def test_each_layout_fits_and_is_its_estimate(gpt2_layouts):
    assert gpt2_layouts, "GPT-2 small trains on one 16 GiB device with a small enough micro-batch"
    for x in gpt2_layouts:
        assert x.gpus == x.dp * x.tp and x.dp * x.micro_batch * x.accumulate == 64
    for x in _sample(gpt2_layouts):
        pol = sm.Policy("bf16-mixed", "adamw", "cuda", recompute=x.recompute,
                        accumulate=x.accumulate, parallel=x.parallel)
        ev = sm.estimate(sm.models.preset("gpt2"), pol).at(b=x.micro_batch, s=1024)
        assert ev.peak == x.peak <= x.usable     # accumulate = 2 stood for k >= 2: the same peak


def test_largest_micro_batch_and_order(gpt2_layouts):
    keys = [(x.gpus, x.peak) for x in gpt2_layouts]
    assert keys == sorted(keys) and keys[0][0] == 1
    for x in _sample(gpt2_layouts):
        b2 = 2 * x.micro_batch                  # the next divisor of 64 / dp above b
        if (64 // x.dp) % b2 or (x.sharding in ("zero-2", "zero-3", "fsdp-full")):
            continue
        pol = sm.Policy("bf16-mixed", "adamw", "cuda", recompute=x.recompute,
                        accumulate=1 if b2 * x.dp == 64 else 2, parallel=x.parallel)
        assert sm.estimate(sm.models.preset("gpt2"), pol).at(b=b2, s=1024).peak > x.usable


def test_cli_json_and_table(capsys):
    assert main(["fit", "--model", "gpt2", "--budget", "16GiB", "--seq", "1024", "--global-batch", "64",
                 "--max-gpus", "1", "--format", "json"]) == 0
    j = json.loads(capsys.readouterr().out)
    first = j["layouts"][0]
    assert j["usable"] == 16 * 2**30 - 16 * 2**30 // 10 and first["gpus"] == 1
    assert set(first) >= {"gpus", "dp", "tp", "zero", "recompute", "micro_batch", "bytes", "peak", "headroom"}
    assert main(["fit", "--model", "gpt2", "--budget", "16GiB", "--seq", "1024", "--global-batch", "64",
                 "--max-gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split() == ["gpus", "dp", "tp", "sharding", "recompute", "b", "k", "peak",
                                           "headroom"]


def test_nothing_fits_and_bad_input(capsys):
    assert main(["fit", "--model", "gpt2", "--budget", "1GiB", "--seq", "1024", "--global-batch", "8",
                 "--max-gpus", "1"]) == 1
    assert "no layout of up to 1 GPUs fits" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="global batch = 0 is not valid: expected a positive integer"):
        fit(sm.models.preset("gpt2"), budget(bytes="16GiB"), 1024, 0)
