"""Tests of the ``symmem`` command line: formats, numbers against the library and by hand,
and errors (exit status, message, no traceback).

``main`` runs in-process (fast; the CLI reuses a preset's derivation between calls); one
test runs the installed console script."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sympy as sp

import symmem
from symmem.cli import main

ROOT = Path(__file__).resolve().parents[1]
MEDIUM = ROOT / "examples" / "gpt2-medium" / "config.json"
TINY = ROOT / "examples" / "tiny-gpt2"
GPT2 = ["estimate", "--model", "gpt2", "--batch", "8", "--seq", "1024"]   # fp32, adamw, cuda, auto

# gpt2 by hand: h=768, L=12, V=50257, s_max=1024.
#   per layer 12*h^2 + 13*h: c_attn 3h^2+3h, c_proj h^2+h, c_fc 4h^2+4h, mlp c_proj 4h^2+h, 2 LN 4h
#   12*12*768^2 = 84,934,656;  13*12*768 = 119,808;  (50257+1024)*768 = 39,383,808 (wte, wpe)
#   2*768 = 1,536 (ln_f);  total 124,439,808 parameters; fp32 (4 bytes) -> 497,759,232 bytes.
GPT2_PARAMS = 124_439_808
# tiny-gpt2 (h=64, L=2, V=1000, s_max=128): 12*2*64^2 + 13*2*64 + (1000+128)*64 + 2*64
#   = 98,304 + 1,664 + 72,192 + 128 = 172,288 parameters -> 689,152 bytes in fp32.
TINY_PARAMS = 172_288
COMPONENTS = ("params", "buffers", "grads", "master", "optimizer", "activations")
ROLES = ("params", "buffers", "master", "optimizer", "grads", "activations", "batch", "transient")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--format", "json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def direct():
    """gpt2, fp32 + adamw on cuda, at b=8, s=1024: the library called directly."""
    est = symmem.estimate(symmem.models.preset("gpt2"),
                          symmem.Policy(precision="fp32", optimizer="adamw", device="cuda",
                                        implementation="auto"))
    return est.at(b=8, s=1024)


# ----------------------------------------------------------------------------- formats

def test_table_names_model_policy_and_peak(capsys, direct):
    code, out, err = run(capsys, *GPT2)
    assert code == 0 and err == ""
    assert out.startswith("symmem estimate: gpt2 (preset)")
    assert f"{GPT2_PARAMS:,} parameters" in out
    words = " ".join(out.split())                            # the policy line is wrapped
    assert "policy: fp32" in words and "adamw [foreach]" in words
    assert "batch b = 8, seq s = 1,024" in out
    assert "activations (saved for backward)" in out and "% of total" in out
    assert f"{direct.peak:,}" in out
    assert f"at the peak: {direct.peak_point.where}" in out
    assert "peak formula" in out and "B_w*V*h" in out
    assert "master" not in out.split("at the peak")[0]      # fp32 has no master copy


def test_json_shape(capsys):
    j = run_json(capsys, *GPT2)
    assert j["inputs"] == {"model": "gpt2", "config": None, "batch": 8, "seq": 1024, "tie": None, "share": [],
                           "precision": "fp32", "optimizer": "adamw", "device": "cuda",
                           "implementation": "auto", "recompute": "none", "accumulate": 1,
                           "attention": "sdpa", "parallel": "none", "implementation_resolved": "foreach",
                           "lora": None, "lora_targets": None, "lora_dtype": "float32", "quantize": "none", "quantize_skip": None, "keep_fp32": None,
                           "mode": "training",
                           "attention_kernels": ["mem-efficient"]}     # auto: transformers' default, on CUDA in fp32
    assert set(j["bytes"]) == {*COMPONENTS, "peak"}
    assert set(j["peak_breakdown"]) == set(ROLES)
    assert set(j["components"]) == set(COMPONENTS)
    assert {"peak", "latex"} <= set(j["formula"])
    for v in (*j["bytes"].values(), *j["peak_breakdown"].values(), j["parameters"]):
        assert type(v) is int
    assert j["peak_phase"] in ("forward", "backward", "optimizer") and j["peak_node"]
    assert sum(j["peak_breakdown"].values()) == j["bytes"]["peak"]
    assert j["formula"]["latex"].startswith(r"\max")


def test_json_equals_library(capsys, direct):
    j = run_json(capsys, *GPT2)
    assert j["bytes"] == direct.bytes
    # the KV cache's role is printed in inference only
    assert j["peak_breakdown"] == {r: v for r, v in direct.peak_parts.items() if r != "cache"}
    assert (j["peak_phase"], j["peak_node"]) == (direct.peak_point.phase, direct.peak_point.node)
    # and by hand (see GPT2_PARAMS): fp32 weights and grads 4 bytes, AdamW 2 fp32 states
    assert j["parameters"] == GPT2_PARAMS
    assert j["bytes"]["params"] == j["bytes"]["grads"] == 4 * GPT2_PARAMS == 497_759_232
    assert j["bytes"]["optimizer"] == 2 * 4 * GPT2_PARAMS
    assert j["bytes"]["master"] == 0


def test_json_formulas_parse_back(capsys):
    """The formula strings are sympy-readable: substituting the JSON's own bindings and
    inputs gives the JSON's numbers. The peak is read candidate by candidate (sympify of the
    whole Max compares every pair of its 73 candidates: a minute)."""
    j = run_json(capsys, *GPT2)
    values = {sp.Symbol(k): sp.Integer(v) for k, v in j["bindings"].items()}
    values.update({sp.Symbol("b"): sp.Integer(8), sp.Symbol("s"): sp.Integer(1024)})
    candidates = [sp.sympify(c) for c in j["formula"]["candidates"]]
    assert len(candidates) == j["formula"]["peak_candidates"]
    assert max(c.xreplace(values) for c in candidates) == j["bytes"]["peak"]
    assert sp.sympify(j["formula"]["peak_at_inputs"]).xreplace(values) == j["bytes"]["peak"]
    for name, text in j["components"].items():
        assert sp.sympify(text).xreplace(values) == j["bytes"][name], name


def test_config_equals_preset(capsys):
    by_config = run_json(capsys, "estimate", "--config", MEDIUM, "--batch", 4, "--seq", 1024,
                         "--precision", "bf16-mixed", "--optimizer", "adam")
    by_preset = run_json(capsys, "estimate", "--model", "gpt2-medium", "--batch", 4, "--seq", 1024,
                         "--precision", "bf16-mixed", "--optimizer", "adam")
    assert by_config["inputs"]["config"] == str(MEDIUM) and by_preset["inputs"]["config"] is None
    for j in (by_config, by_preset):
        del j["inputs"]["config"]
    assert by_config == by_preset
    assert by_config["inputs"]["model"] == "gpt2-medium"
    assert by_config["parameters"] == 354_823_168  # 12*24*1024^2 + 13*24*1024 + 51281*1024 + 2048


def test_latex(capsys):
    code, out, err = run(capsys, *GPT2, "--format", "latex")
    assert code == 0 and err == ""
    assert out.count(r"\begin{aligned}") == out.count(r"\end{aligned}") == 2
    assert r"\mathrm{peak} = \max\bigl(" in out and r"\mathrm{activations} &=" in out
    equations = out[out.index(r"\begin{aligned}"):]
    assert r"s_{\max}" in equations and r"B_{w}" in equations     # latex_names() applied
    assert "s_max" not in equations and "B_w" not in equations


def test_help_has_examples_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "symmem estimate --model gpt2 --batch 8" in out and "--config" in out
    assert "exit status" in out and "bad usage" in out


def test_models_lists_presets(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and all(name in out for name in symmem.models.PRESETS)


# ----------------------------------------------------------------------------- errors

def _write(tmp_path, text, name="config.json"):
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return path


def _tiny(**changes):
    cfg = json.loads((TINY / "config.json").read_text())
    return json.dumps({**cfg, **changes})


ERRORS = {  # id -> (argv after "estimate" or a function of tmp_path giving it, exit status, words)
    "unknown model": (["--model", "gpt-3", "--batch", 1, "--seq", 8], 1,
                      ["unknown model", "'gpt-3'", "Known:", "gpt2-medium"]),
    "missing config": (lambda t: ["--config", t / "nope" / "config.json", "--batch", 1, "--seq", 8],
                       1, ["config", "nope", "a local config.json file"]),
    "invalid json": (lambda t: ["--config", _write(t, '{"model_type": "gpt2", n_embd: 64'),
                                "--batch", 1, "--seq", 8], 1, ["valid JSON", "line 1"]),
    "not utf-8": (lambda t: ["--config", _write(t, b"\xff\xfe\x00binary"), "--batch", 1, "--seq", 8],
                  1, ["config", "UTF-8"]),
    "n_embd not a multiple of n_head": (
        lambda t: ["--config", _write(t, _tiny(n_embd=66, n_head=4)), "--batch", 1, "--seq", 8],
        1, ["n_embd", "66", "multiple", "n_head", "(4)"]),
    "unknown model_type": (
        lambda t: ["--config", _write(t, _tiny(model_type="rwkv")), "--batch", 1, "--seq", 8],
        1, ["model_type", "'rwkv'", "Known: bert, gpt2, gpt_neox, llama, mistral, mixtral, opt, qwen2, resnet, t5, vit"]),
    "seq beyond n_positions": (["--model", "gpt2", "--batch", 1, "--seq", 2048], 1,
                               ["s = 2048", "n_positions", "s_max = 1024"]),
    "unknown precision": (["--model", "gpt2", "--batch", 1, "--seq", 8, "--precision", "bf16-mix"], 1,
                          ["unknown precision", "'bf16-mix'", "Known:", "bf16-mixed"]),
    "unknown optimizer": (["--model", "gpt2", "--batch", 1, "--seq", 8, "--optimizer", "sgd-momentun"],
                          1, ["unknown optimizer", "'sgd-momentun'", "Did you mean 'sgd-momentum'?"]),
    "batch 0": (["--model", "gpt2", "--batch", 0, "--seq", 8], 2,
                ["argument --batch", "positive integer", "got 0"]),
    "batch abc": (["--model", "gpt2", "--batch", "abc", "--seq", 8], 2,
                  ["argument --batch", "positive integer", "got 'abc'"]),
    "seq -1": (["--model", "gpt2", "--batch", 1, "--seq=-1"], 2, ["argument --seq", "got -1"]),
    "model and config": (["--model", "gpt2", "--config", MEDIUM, "--batch", 1, "--seq", 8], 2,
                         ["not allowed with"]),
    "no batch": (["--model", "gpt2", "--seq", 8], 2, ["required", "--batch"]),
    "unknown recompute": (["--config", TINY, "--batch", 1, "--seq", 8, "--recompute", "bogus"], 1,
                          ["recompute = 'bogus'", "none, full, every:K, nth:N, selective or last:N", ",reentrant"]),
    "every:0": (["--config", TINY, "--batch", 1, "--seq", 8, "--recompute", "every:0"], 1,
                ["recompute = 'every:0'", "K a whole number >= 1"]),
    "last:N beyond the layers": (["--config", TINY, "--batch", 1, "--seq", 8, "--recompute", "last:9"], 1,
                                 ["recompute = 'last:9'", "at most the 2 layers"]),
    "accumulate 0": (["--config", TINY, "--batch", 1, "--seq", 8, "--accumulate", 0], 1,
                     ["accumulate = 0", "whole number of micro-batches >= 1"]),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_errors(capsys, tmp_path, case):
    argv, status, words = ERRORS[case]
    argv = ["estimate", *map(str, argv(tmp_path) if callable(argv) else argv)]
    if status == 2:                              # argparse's usage errors exit by themselves
        with pytest.raises(SystemExit) as e:
            main(argv)
        code = e.value.code
    else:
        code = main(argv)
    out, err = capsys.readouterr()
    assert code == status
    assert out == "" and "Traceback" not in err
    assert err.startswith("symmem: error: " if status == 1 else "usage: symmem estimate")
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("argv,kwargs", [(["--recompute", "full,reentrant"], {"recompute": "full,reentrant"}),
                                          (["--recompute", "every:2", "--accumulate", "3"],
                                           {"recompute": "every:2", "accumulate": 3})], ids=["full", "every-acc"])
def test_recompute_and_accumulate_options(capsys, argv, kwargs):
    """The shell's --recompute/--accumulate give the library's numbers and are stated in the
    inputs; recomputing keeps fewer activations than not."""
    j = run_json(capsys, "estimate", "--config", TINY, "--batch", 2, "--seq", 16, "--device", "cpu", *argv)
    est = symmem.estimate(symmem.models.from_hf_config(TINY / "config.json"),
                          symmem.Policy("fp32", "adamw", "cpu", **kwargs)).at(b=2, s=16)
    plain = run_json(capsys, "estimate", "--config", TINY, "--batch", 2, "--seq", 16, "--device", "cpu")
    assert j["bytes"]["peak"] == est.peak and j["bytes"]["activations"] == est.bytes["activations"]
    assert j["bytes"]["activations"] < plain["bytes"]["activations"]
    assert j["inputs"]["recompute"] == kwargs["recompute"]
    assert j["inputs"]["accumulate"] == kwargs.get("accumulate", 1)
    assert j["batch_per_step"] == 2 * kwargs.get("accumulate", 1)      # b*K sequences per step
    code, out, _ = run(capsys, "estimate", "--config", TINY, "--batch", 2, "--seq", 16, "--device", "cpu", *argv)
    assert f"recompute {kwargs['recompute']}" in " ".join(out.split())
    if "accumulate" in kwargs:
        assert "3 micro-batches of b = 2: 6 sequences per optimizer step" in out


def test_policies_lists_every_registered_part(capsys):
    """``symmem policies`` is generated from the registries: every name of every part, with
    its option and default."""
    from symmem.policy import PARTS
    code, out, err = run(capsys, "policies")
    assert code == 0 and err == ""
    for part in PARTS:
        assert f"{part.option} {part.metavar}  (default: {part.default})" in out
        for name in (part.registry.names() if part.registry is not None else ()):
            assert f"\n  {name} " in out, (part.option, name)
    assert "\n  every:K " in out and "\n  Recompute.layers(a, z) " in out


# ----------------------------------------------------------------------------- console script

def test_console_script(tmp_path):
    """The installed ``symmem`` script: a folder holding config.json, json out, exit 0; and a
    rejected input exits 1 through ``raise SystemExit(main())``."""
    script = Path(sys.executable).with_name("symmem")
    if not script.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    ok = subprocess.run([script, "estimate", "--config", TINY, "--batch", "2", "--seq", "16",
                         "--format", "json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    j = json.loads(ok.stdout)
    assert j["inputs"]["model"] == "tiny-gpt2" and j["parameters"] == TINY_PARAMS
    assert j["bytes"]["params"] == 4 * TINY_PARAMS
    bad = subprocess.run([script, "estimate", "--model", "gpt-3", "--batch", "1", "--seq", "8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("symmem: error: unknown model 'gpt-3'") and "Traceback" not in bad.stderr
    # a reader that has gone before the output comes (`symmem ... | head -c 0`): exit 0, no
    # traceback (the pipe is closed at once; the estimate prints only once it is derived)
    proc = subprocess.Popen([script, "estimate", "--config", TINY, "--batch", "2", "--seq", "16",
                             "--format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0 and b"Traceback" not in proc.stderr.read()


# ----------------------------------------------------------------------------- max-batch / solve

def test_max_batch_json(capsys):
    j = run_json(capsys, "max-batch", "--model", "gpt2", "--seq", 1024, "--precision", "bf16-mixed",
                 "--budget", "80GiB", "--reserve", "10%")
    # 80 GiB = 85,899,345,920 bytes; 10% = 8,589,934,592 reserved; usable 77,309,411,328
    assert (j["budget_bytes"], j["reserve_bytes"], j["usable_bytes"]) == (85_899_345_920, 8_589_934_592,
                                                                          77_309_411_328)
    est = symmem.estimate(symmem.models.preset("gpt2"), symmem.Policy("bf16-mixed", "adamw"))
    b = j["max_batch"]
    assert j["bytes_at_max"] == est.at(b=b, s=1024).bytes
    assert j["bytes_at_max"]["peak"] <= j["usable_bytes"] < j["bytes_past_max"]["peak"]
    assert sp.sympify(j["boundary"]["formula"], locals={n: i.symbol for n, i in symmem.symbols.TABLE.items()}) \
        .xreplace({**est.bindings, symmem.symbols.s: 1024, symmem.symbols.M: j["budget_bytes"],
                   symmem.symbols.R: j["reserve_bytes"]}) == b
    assert j["binding"]["where"] == "backward log_softmax"
    assert "\\left\\lfloor" in j["boundary"]["latex"]


def test_max_batch_table_with_gpu(capsys):
    code, out, err = run(capsys, "max-batch", "--model", "gpt2", "--seq", 1024, "--gpu", "h100-80gb")
    assert code == 0, err
    assert "budget: H100-80GB" in out and "max b = " in out and "boundary: b = floor(" in out


def test_max_batch_infeasible(capsys):
    code, out, err = run(capsys, "max-batch", "--model", "gpt2-xl", "--seq", 1024, "--budget", "4GiB",
                         "--format", "json")
    assert code == 1 and "Traceback" not in err
    j = json.loads(out)
    assert j["max_batch"] is None and j["needed_bytes"] > j["usable_bytes"]
    assert err.startswith("symmem: error: no value of b fits: at b = 1 the peak is")


def test_solve_for_sequence_and_layers(capsys):
    j = run_json(capsys, "solve", "--model", "gpt2", "--for", "s", "--max", "--batch", 8,
                 "--precision", "bf16-mixed", "--attention", "eager", "--budget", "16GiB", "--reserve", "0")
    # the library's answer (tests/test_solve.py proves it: the peak at 853 fits 16 GiB, at 854 not)
    assert j["value"] == 853 and j["symbol"] == "s" and j["fixed"] == {"b": 8}
    j = run_json(capsys, "solve", "--model", "gpt2", "--for", "L", "--batch", 8, "--seq", 1024,
                 "--budget", "80GiB", "--reserve", "0")
    assert j["bytes_at_max"]["peak"] <= j["usable_bytes"] < j["bytes_past_max"]["peak"]


@pytest.mark.parametrize("argv,words", [
    (["max-batch", "--model", "gpt2", "--seq", 8, "--gpu", "A1000"], ["unknown GPU 'A1000'"]),
    (["max-batch", "--model", "gpt2", "--seq", 8, "--budget", "80 GiBs"], ["budget = '80 GiBs' is not valid: expected a size like 80GiB"]),
    (["solve", "--model", "gpt2", "--for", "q", "--batch", 1, "--budget", "8GiB"], ["unknown symbol 'q'"]),
    (["solve", "--model", "gpt2", "--for", "L", "--set", "L5", "--budget", "8GiB"], ["--set = 'L5'"]),
])
def test_solve_errors(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 1 and "Traceback" not in err
    for w in words:
        assert w in err


def test_gpus_lists_the_catalog(capsys):
    code, out, err = run(capsys, "gpus")
    assert code == 0 and "H100-80GB" in out and "MI300X" in out


# ----------------------------------------------------------------------------- sweep

def test_sweep_csv_equals_the_library(capsys):
    code, out, err = run(capsys, "sweep", "--model", "gpt2", "--batch", "1:3", "--seq", "512,1024",
                         "--precision", "bf16-mixed", "--progress")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0] == "b,s,params,buffers,grads,master,optimizer,activations,peak"
    assert len(lines) == 1 + 3 * 2
    est = symmem.estimate(symmem.models.preset("gpt2"), symmem.Policy("bf16-mixed", "adamw"))
    for line in lines[1:]:
        b, s, *values = (int(v) for v in line.split(","))
        ev = est.at(b=b, s=s)
        assert values == [ev.bytes[k] for k in (*COMPONENTS, "peak")]
    assert "100% 6/6 points" in err and err.endswith("\n")


def test_sweep_is_exact_beyond_64_bits(capsys):
    """b = 10^16 at s = 1024: about 1.7e25 bytes, past int64 (9.2e18): the row equals estimate's
    exact integers, in CSV and in JSON."""
    code, out, err = run(capsys, "sweep", "--model", "gpt2", "--batch", "1,10000000000000000", "--seq", "1024")
    assert code == 0
    row = [int(v) for v in out.strip().splitlines()[2].split(",")]
    ev = symmem.estimate(symmem.models.preset("gpt2"), symmem.Policy()).at(b=10**16, s=1024)
    assert row[2:] == [ev.bytes[k] for k in (*COMPONENTS, "peak")] and row[-1] > 2**64
    j = run_json(capsys, "sweep", "--model", "gpt2", "--batch", "10000000000000000", "--seq", "1024")
    assert j[0]["peak"] == ev.peak


def test_sweep_json_and_errors(capsys):
    j = run_json(capsys, "sweep", "--model", "gpt2", "--batch", "2", "--seq", "8:16:8")
    assert [(r["b"], r["s"]) for r in j] == [(2, 8), (2, 16)]
    code, out, err = run(capsys, "sweep", "--model", "gpt2", "--batch", "1:x", "--seq", "8")
    assert code == 1 and "--batch = '1:x' is not valid: expected positive integers" in err
    code, out, err = run(capsys, "sweep", "--model", "gpt2", "--batch", "1", "--seq", "1000:2000")
    assert code == 1 and "s = 2000 is not valid: expected at most s_max = 1024" in err


@pytest.mark.parametrize("argv,words", [
    (["solve", "--model", "gpt2", "--for", "b", "--budget", "80GB"],
     ["--seq = None", "solving for b needs s fixed", "Pass --seq S."]),
    (["solve", "--model", "gpt2", "--for", "s", "--budget", "80GB"],
     ["--batch = None", "solving for s needs b fixed", "Pass --batch B."]),
    (["max-batch", "--model", "gpt2", "--seq", "1024", "--budget", "-5GB"],
     ["budget = '-5GB'", "at least 1 byte"]),
    (["max-batch", "--model", "gpt2", "--seq", "1024", "--budget", "80GB", "--reserve", "-3GB"],
     ["reserve = '-3GB'", "0 or more bytes"]),
], ids=["solve b without --seq", "solve s without --batch", "negative budget", "negative reserve"])
def test_shell_errors_name_the_shell_flags(capsys, argv, words):
    """Messages say what to type in the shell (--seq S), not the Python keyword (s=...); a
    negative size reaches symmem's check instead of argparse's "expected one argument"."""
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == "" and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert "s=..." not in err and "b=..." not in err


def test_budget_with_a_bare_unit_letter(capsys):
    code, out, err = run(capsys, "max-batch", "--model", "gpt2", "--seq", "1024", "--budget", "80G")
    assert code == 0 and "budget: 80.00 GiB budget ('80G' read as 80 GiB) minus a 10% reserve" in out


def test_gpus_and_policies_as_json(capsys):
    """``--format json`` for scripts: the catalog with exact bytes, every policy part with
    its names (the same entries as the tables)."""
    from symmem.gpus import CATALOG
    from symmem.policy import PARTS
    gpus = run_json(capsys, "gpus")["gpus"]
    assert [g["name"] for g in gpus] == list(CATALOG)
    assert gpus[0]["memory_bytes"] == CATALOG[gpus[0]["name"]].memory      # an exact integer
    parts = run_json(capsys, "policies")["parts"]
    assert [p["option"] for p in parts] == [p.option for p in PARTS]
    recompute = next(p for p in parts if p["field"] == "recompute")
    assert recompute["default"] == "none" and "every:K" in [n["name"] for n in recompute["names"]]
    models = run_json(capsys, "models")["families"]
    assert models[0]["name"] == "gpt2" and any(p["name"] == "gpt2-xl" for p in models[0]["presets"])


def test_output_fits_88_columns_and_columns_stay_apart(capsys):
    """No line over 88 characters (a boundary formula wraps at its signs), "for-loop" is not
    broken at its hyphen, and bytes and sizes at 10^16 bytes and beyond stay apart, in TiB
    and PiB rather than thousands of GiB."""
    code, big, _ = run(capsys, "estimate", "--model", "gpt3-175b", "--batch", "100000", "--seq", "2048",
                       "--implementation", "for-loop")
    code2, mb, _ = run(capsys, "max-batch", "--model", "gpt2", "--seq", "1024", "--budget", "80GB",
                       "--implementation", "for-loop", "--accumulate", "4")
    assert code == code2 == 0
    for out in (big, mb):
        assert max(map(len, out.splitlines())) <= 88
        assert "for-\n" not in out and "micro-\n" not in out
    assert "PiB" in big and "TiB" in big and not re.search(r"\d,\d{3}\.\d\d GiB", big)
    rows = [line for line in big.splitlines() if line.startswith(("activations", "peak  "))]
    for row in rows:                        # label, bytes, size (and %) separated by 2+ spaces
        assert len([c for c in row.split("  ") if c.strip()]) >= 3, row


def test_tie_and_no_tie_override_the_model(capsys):
    """--no-tie gives GPT-2's output layer its own V x h weight (50,257 x 768 = 38,597,376 more
    parameters); --tie keeps the model's own tying; the JSON echoes the choice."""
    base = run_json(capsys, "estimate", "--model", "gpt2", "--batch", 1, "--seq", 8)
    untied = run_json(capsys, "estimate", "--model", "gpt2", "--batch", 1, "--seq", 8, "--no-tie")
    tied = run_json(capsys, "estimate", "--config", "examples/tiny-gpt2", "--batch", 1, "--seq", 8, "--tie")
    assert untied["parameters"] - base["parameters"] == 50_257 * 768 == 38_597_376
    assert (base["inputs"]["tie"], untied["inputs"]["tie"], tied["inputs"]["tie"]) == (None, False, True)
    j = run_json(capsys, "max-batch", "--model", "gpt2", "--seq", 1024, "--no-tie", "--gpu", "H100-80GB")
    assert j["max_batch"] >= 1


def test_share_qkv_and_layers(capsys):
    """--share qkv: c_attn is 768 x 768 (+ 768 bias), not 768 x 2304 (+ 2304), in 12 layers:
    14,174,208 weights fewer; --share layers: one layer's 7,087,872 weights for all 12 (ALBERT),
    77,966,592 fewer; both: the shared layer's own 5,906,688 once. The JSON echoes the choice."""
    base = run_json(capsys, "estimate", "--model", "gpt2", "--batch", 1, "--seq", 8)
    qkv = run_json(capsys, "estimate", "--model", "gpt2", "--batch", 1, "--seq", 8, "--share", "qkv")
    layers = run_json(capsys, "estimate", "--model", "gpt2", "--batch", 1, "--seq", 8, "--share", "layers")
    both = run_json(capsys, "estimate", "--model", "gpt2", "--batch", 1, "--seq", 8, "--share", "qkv,layers")
    assert base["parameters"] - qkv["parameters"] == 14_174_208
    assert base["parameters"] - layers["parameters"] == 11 * 7_087_872 == 77_966_592
    assert both["parameters"] == 124_439_808 - 12 * 7_087_872 + 5_906_688 == 45_292_032
    assert (qkv["inputs"]["share"], both["inputs"]["share"]) == (["qkv"], ["qkv", "layers"])
    assert main(["estimate", "--model", "gpt2", "--batch", "1", "--seq", "8", "--share", "qkv,layers",
                 "--no-tie"]) == 0
    assert capsys.readouterr().out.startswith("symmem estimate: gpt2 (preset; own output layer; shared: qkv, "
                                              "layers), 83,889,408 parameters")   # 45,292,032 + 38,597,376
    with pytest.raises(SystemExit):
        main(["estimate", "--model", "gpt2", "--batch", "1", "--seq", "8", "--share", "heads"])
    assert "expected qkv and/or layers, comma-separated, got 'heads'" in capsys.readouterr().err


def test_image_models_need_no_seq(capsys):
    """An image model's formulas have no s: estimate and max-batch run without --seq, print
    no s, and the regions are a grid in b alone; a text model without --seq is told to pass it."""
    code, out, err = run(capsys, "estimate", "--model", "resnet-18", "--batch", 32)
    assert code == 0, err
    # the model's dimensions only: the data-parallel degree d = 1 is the layout, not the model
    assert "inputs: batch b = 32; model C = 3, H = 224, W = 224, n_c = 1,000\n" in out
    assert "seq s" not in out and "(b up to 65,536, a log grid):" in out
    assert ", b from " in out and "b*s" not in out
    code, out, err = run(capsys, "max-batch", "--model", "resnet-18", "--budget", "24GB")
    assert code == 0, err
    assert out.startswith("symmem max-batch: resnet-18\n")
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--batch", 2)
    assert code == 1
    assert ("--seq = None is not valid: expected a value: the formulas of gpt2 use s (s: sequence length "
            "(tokens per sequence)). Pass --seq S.") in err
    code, out, err = run(capsys, "max-batch", "--model", "gpt2", "--budget", "24GB")
    assert code == 1 and "solving for b needs s fixed. Pass --seq S." in err


def test_a_symbol_left_free_names_the_flag_the_command_has(capsys):
    """estimate and max-batch have no --set: the LoRA rank left a symbol asks for --lora, n_g
    for --new-tokens; estimate refuses inference mode (infer's), naming infer."""
    argv = ["--model", "gpt2", "--seq", "128"]
    assert main(["estimate", *argv, "--batch", "2", "--lora", "r"]) == 1
    assert ("--lora = 'r' is not valid: expected a value: the formulas of gpt2 use r (r: LoRA adapter rank). "
            "Pass --lora R (a number).") in capsys.readouterr().err
    assert main(["max-batch", *argv, "--mode", "inference", "--gpu", "H100-80GB"]) == 1
    assert "solving for b needs n_g fixed. Pass --new-tokens N." in capsys.readouterr().err
    assert main(["estimate", *argv, "--batch", "2", "--mode", "inference"]) == 1
    assert ("mode = 'inference' is not valid: expected training for symmem estimate. Use symmem infer"
            in capsys.readouterr().err)
