"""The parallel layout (symmem.Parallel) and the shard pass: data parallelism, ZeRO 1-3, FSDP and
offload, derived per rank with the data-parallel degree d a symbol.

The model is tiny-gpt2 (h = 64, L = 2, a = 4, V = 1000, s_max = 128; tied output layer) in
bf16-master (B_w = B_g = 2, B_m = B_o = 4): N = 172,288 parameters, so one device holds
params 2N = 344,576, grads 2N = 344,576, master 4N = 689,152 and AdamW's two states 8N = 1,378,304.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import sympy as sp

import symmem as sm
from symmem.cli import main
from symmem.errors import ConfigError
from symmem.passes.shard import padded_rows, unit_bytes
from symmem.symbols import B_w, L, V, d, h, s_max

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-gpt2"
N = 172_288


@pytest.fixture(scope="module")
def graph():
    return sm.models.from_hf_config(TINY / "config.json")


_CACHE: dict = {}


def est(graph, parallel, **kw):
    """The tiny model's estimate under ``parallel`` (derived once per module)."""
    key = (parallel, tuple(sorted(kw.items())))
    if key not in _CACHE:
        _CACHE[key] = sm.estimate(graph, sm.Policy(precision="bf16-master", parallel=parallel, **kw))
    return _CACHE[key]


# ----------------------------------------------------------------------------- the layout

def test_parallel_defaults_and_specs():
    assert sm.Policy().parallel == sm.Parallel() and str(sm.Policy().parallel) == "none"
    p = sm.Parallel(dp=8, zero=3)
    assert sm.Policy(parallel=p).parallel is p
    assert sm.Parallel.parse(str(p)) == p and str(p) == "dp=8,zero=3"
    assert sm.Parallel.parse("dp=d,fsdp=full,offload=params") == sm.Parallel(dp=d, fsdp="full", offload="params")
    assert sm.Policy(parallel="dp=8,zero=1").bindings()[d] == 8
    assert d not in sm.Policy(parallel="dp=d,zero=1").bindings()       # stays a symbol
    assert sm.Parallel(fsdp="full").stage == 3 and sm.Parallel(fsdp="grad-op").stage == 2
    assert sm.Parallel(dp=16, fsdp="hybrid").shard_degree == 8


@pytest.mark.parametrize("kwargs,message", [
    ({"zero": 4}, "zero = 4 is not valid: expected a ZeRO stage 0, 1, 2 or 3."),
    ({"zero": -1}, "zero = -1 is not valid: expected a ZeRO stage 0, 1, 2 or 3."),
    ({"dp": 0}, "dp = 0 is not valid: expected a whole number >= 1 or the symbol d."),
    ({"dp": "x"}, "dp = 'x' is not valid: expected a whole number >= 1 or the symbol d."),
    ({"zero": 3, "fsdp": "full"}, "zero with fsdp = 'zero=3, fsdp=full' is not valid: expected either a ZeRO "
                                  "stage or an FSDP strategy."),
    ({"fsdp": "sharded"}, "fsdp = 'sharded' is not valid: expected one of full, grad-op, hybrid."),
    ({"offload": "optimizer"}, "offload = 'optimizer' is not valid: expected a sharded run (--zero 1, 2 or 3, "
                               "or --fsdp)."),
    ({"zero": 2, "offload": "params"}, "offload = 'params' is not valid: expected parameters sharded: --zero 3 "
                                       "or --fsdp full|hybrid."),
    ({"zero": 1, "offload": "disk"}, "offload = 'disk' is not valid: expected one of none, optimizer, params, both."),
    ({"dp": 12, "fsdp": "hybrid"}, "dp with fsdp hybrid = 12 is not valid: expected a multiple of the shard "
                                   "group's 8 ranks."),
    ({"tp": 0}, "tp = 0 is not valid: expected a whole number >= 1 or the symbol t."),
    ({"pp": 0}, "pp = 0 is not valid: expected a whole number >= 1."),
    ({"pp": "p"}, "pp = 'p' is not valid: expected a whole number >= 1."),
    ({"pp": 4, "schedule": "zigzag"}, "schedule = 'zigzag' is not valid: expected one of gpipe, 1f1b, interleaved."),
    ({"pp": 4, "schedule": "interleaved"}, "virtual_stages = 1 is not valid: expected 2 or more chunks per rank "
                                           "for the interleaved schedule."),
    ({"pp": 4, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 6},
     "microbatches = 6 is not valid: expected a multiple of the 4 pipeline stages (the interleaved schedule runs "
     "micro-batches in groups of p)."),
    ({"pp": 4, "virtual_stages": 2}, "virtual_stages = 2 is not valid: expected 1 with the 1f1b schedule"),
    ({"pp": 4, "microbatches": 0}, "microbatches = 0 is not valid: expected a whole number >= 1."),
    ({"cp": 0}, "cp = 0 is not valid: expected a whole number >= 1 or the symbol c."),
    ({"dp": 8, "fsdp": "full", "reduce_dtype": "int8"}, "reduce_dtype = 'int8' is not valid: expected one of fp32, "
                                                         "bf16, fp16."),
    ({"dp": 8, "zero": 3, "reduce_dtype": "bf16"}, "reduce_dtype = 'bf16' is not valid: expected fp32 without --fsdp"),
    ({"ep": 0}, "ep = 0 is not valid: expected a whole number >= 1 or the symbol e."),
    ({"sp": True}, "sp = True is not valid: expected tensor parallelism beside it (tp > 1): sequence "
                   "parallelism splits the layers' norms and dropouts over the tensor-parallel ranks."),
    ({"schedule": "gpipe"}, "pp = 1 is not valid: expected 2 or more pipeline stages for a schedule, virtual "
                            "stages or micro-batches."),
    ({"microbatches": 4}, "pp = 1 is not valid: expected 2 or more pipeline stages for a schedule, virtual "
                          "stages or micro-batches."),
])
def test_bad_layouts_name_the_values(kwargs, message):
    with pytest.raises(ConfigError) as e:
        sm.Parallel(**kwargs)
    assert str(e.value).startswith(message)


def test_bad_specs_and_combinations():
    with pytest.raises(ConfigError, match="parallel = 'dp=8,stage=3' is not valid: expected none, or KEY=VALUE"):
        sm.Parallel.parse("dp=8,stage=3")
    with pytest.raises(ConfigError, match=r"accumulate with sharded gradients = 4 is not valid: expected 1 "
                                          r"\(accumulation into sharded gradients"):
        sm.Policy(parallel="dp=8,zero=2", accumulate=4)
    sm.Policy(parallel="dp=8,zero=1", accumulate=4)          # ZeRO-1 and DDP accumulate as before
    with pytest.raises(ConfigError, match="parallel with --mode inference"):
        sm.Policy(parallel="dp=8", mode="inference")


def test_reduce_dtype_is_the_mixed_precisions_half_dtype():
    g = sm.models.preset("gpt2")
    for precision in ("bf16-mixed", "fp16-master", "bf16"):
        with pytest.raises(ConfigError) as e:
            sm.estimate(g, sm.Policy(precision, parallel="dp=8,fsdp=full,reduce_dtype=bf16"))
        assert str(e.value).startswith("reduce_dtype = 'bf16' is not valid: expected fp32, or the parameters' half "
                                       "dtype under FSDP's mixed precision (bf16 with --precision bf16-master, fp16 "
                                       f"with fp16-master). With --precision {precision} FSDP reduces")
    est = sm.estimate(g, sm.Policy("bf16-master", parallel="dp=8,fsdp=full,reduce_dtype=bf16"))
    assert "gradients reduced in bf16" in est.policy.describe()


def test_global_batch_must_divide():
    p = sm.Parallel(dp=8)
    assert p.micro_batch(64, accumulate=2) == 4          # 64 = 4 * 8 * 2
    with pytest.raises(ConfigError) as e:
        p.micro_batch(60, accumulate=2)
    assert str(e.value).startswith("global batch = 60 is not valid: expected a multiple of dp * accumulate "
                                   "= 8 * 2 = 16")


# ----------------------------------------------------------------------------- model states

def states(e) -> sp.Expr:
    return sum(e.components[k] for k in ("params", "grads", "master", "optimizer"))


@pytest.mark.parametrize("layout,per_param", [
    ("none", 16),                                          # 2 + 2 + 4 + 8
    ("dp=d", 18),                                          # DDP: + the buckets' copy of the gradients (2)
    ("dp=d,zero=1", 4 + sp.Integer(12) / d),               # 2 + 2 + 12/d
    ("dp=d,zero=2", 2 + sp.Integer(14) / d),               # 2 + (2 + 12)/d
    ("dp=d,zero=3", sp.Integer(16) / d),
    ("dp=d,fsdp=full", sp.Integer(16) / d),
    ("dp=d,fsdp=grad-op", sp.Integer(16) / d),             # at rest; forward gathers every unit (below)
    ("dp=64,fsdp=hybrid", sp.Integer(16) / 8),             # sharded within groups of 8
    ("dp=d,zero=1,offload=optimizer", 4),                  # master and states on the host
    ("dp=d,zero=2,offload=optimizer", 2),                  # + the gradient partition
    ("dp=d,zero=3,offload=both", 0),
])
def test_model_states_per_parameter(graph, layout, per_param):
    """Every model state is sharded as the stage says: bytes per parameter, exactly."""
    e = est(graph, layout)
    n_params = e.prepared.param_count()
    total = states(e).xreplace(e.policy.prec.bindings())
    if "fsdp" in layout:
        # FSDP2 pads each parameter's dim 0 to a multiple of the shard degree n: ceiling(dim0 / n)
        # rows a rank; where n divides every dim 0 (ceiling(x) = x) the formula is the one above,
        # and at d = 8 (V = 1000, s_max = 128, h = 64: all divide) its value
        assert total.has(sp.ceiling)
        assert total.subs({V: 1000, s_max: 128, h: 64, L: 2, d: 8}) == per_param.subs(d, 8) * N
        total = total.replace(sp.ceiling, lambda x: x)
    assert sp.expand(total - per_param * n_params) == 0


def test_hybrid_needs_whole_groups(graph):
    """Hybrid sharding with d a symbol: evaluating at a d that is not a multiple of the group is refused."""
    e = est(graph, "dp=d,fsdp=hybrid")
    assert e.at(b=2, s=16, d=16).bytes["optimizer"] == 8 * N // 8      # AdamW's 8N over the group of 8
    with pytest.raises(ConfigError, match="d = 12 is not valid: expected a multiple of 8: FSDP hybrid shards "
                                          "within groups of shard_size = 8 ranks"):
        e.at(b=2, s=16, d=12)


def test_host_bytes(graph):
    """Offloaded: master (4) + AdamW (8) + the float32 gradient partition (4) per parameter, over d;
    params offloaded add their 2/d. At d = 8: 16N/8 = 344,576 and 18N/8 = 387,648."""
    assert est(graph, "dp=d,zero=2,offload=optimizer").at(b=2, s=16, d=8).bytes["host"] == 16 * N // 8
    assert est(graph, "dp=d,zero=1,offload=optimizer").at(b=2, s=16, d=8).bytes["host"] == 16 * N // 8
    assert est(graph, "dp=d,zero=3,offload=both").at(b=2, s=16, d=8).bytes["host"] == 18 * N // 8
    assert "host" not in est(graph, "dp=d,zero=3").components


# ----------------------------------------------------------------------------- transients

def test_units_of_tiny_gpt2(graph):
    units, root, grads, root_grads = unit_bytes(graph)
    # a GPT-2 layer: c_attn 3h^2+3h, c_proj h^2+h, c_fc 4h^2+4h, mlp c_proj 4h^2+h, 2 norms 4h
    assert sp.expand(units["h"] - B_w * (12 * h**2 + 13 * h)) == 0
    # wte (tied to the head) V*h, wpe s_max*h, ln_f 2h
    assert sp.expand(root - B_w * (V * h + s_max * h + 2 * h)) == 0


def _padded_units(graph):
    """The units as FSDP2 gathers them: each parameter's dim 0 padded to a multiple of d."""
    return unit_bytes(graph, lambda p: d * padded_rows(p, d))


def test_fsdp_full_gathers_the_unit_and_the_next(graph):
    """At each unit's copy-out in backward (the last layer, the first run there) the rank holds its shards, the root
    whole, the unit's all-gather output (its flat buffer, prefetched by the layer after it) and
    its unsharded parameters: two units, padded. The output is let go right after, and the
    next unit's prefetched in its place."""
    e = est(graph, "dp=d,fsdp=full")
    # tiny-gpt2's two layers are below the layer count these formulas hold for in L (the first
    # layer's forward and the last's backward differ from the rest): derived with L bound
    units, root, *_ = _padded_units(e.prepared)
    assert sp.expand(units["h"] - unit_bytes(graph)[0]["h"]).has(sp.ceiling)     # padded: not N/d
    shard = e.components["params"]
    pts = [p for p in e.timeline if p.node == "all-gather h" and p.phase == "backward" and p.iteration == "last"]
    assert pts
    parts = dict(pts[0].parts)
    assert sp.expand(parts["params"] - (shard + root + 2 * units["h"])) == 0
    # the layer's backward runs beside the next unit's output (prefetched), not with prefetch=0
    mid = next(p for p in e.timeline if p.node == "h/ln_1" and p.phase == "backward" and p.iteration == "last")
    assert sp.expand(dict(mid.parts)["params"] - (shard + root + 2 * units["h"])) == 0
    e0 = est(graph, "dp=d,fsdp=full,prefetch=0")
    units, root, *_ = _padded_units(e0.prepared)      # here the formulas hold in L at L = 2
    shard = e0.components["params"]
    # without prefetch the output is made at the unit's own pre-backward: at the copy-out, the same
    # two units; during the layer's backward, one
    pts0 = [p for p in e0.timeline if p.node == "all-gather h" and p.phase == "backward" and p.iteration == "last"]
    assert sp.expand(dict(pts0[0].parts)["params"] - (shard + root + 2 * units["h"])) == 0
    mid0 = next(p for p in e0.timeline if p.node == "h/ln_1" and p.phase == "backward" and p.iteration == "last")
    assert sp.expand(dict(mid0.parts)["params"] - (shard + root + units["h"])) == 0


def test_fsdp_prefetches_in_backward_only(graph):
    """FSDP2 gathers one layer at a time in forward (no forward prefetch by default) and one ahead
    in backward; DeepSpeed's ZeRO-3 prefetches both ways. At a middle layer's forward point the
    gathered parameters beyond the shards and the root are two units in either: ZeRO-3's layer
    and the one prefetched; FSDP2's layer and its own all-gather output, kept in
    comm_ctx.all_gather_state until the next layer's copy-out (not a prefetch: no third)."""
    # FSDP's later layers are alike in forward (one segment, its last run labelled "last"; the
    # first differs: the root's output is let go at its copy-out); ZeRO-3's middle layers
    # prefetch and its last does not ("second to last": a middle one)
    for layout, units_of, it in (("dp=d,fsdp=full", _padded_units, "last"),
                                 ("dp=d,zero=3", unit_bytes, "second to last")):
        e = est(graph, layout)
        units, root, *_ = units_of(e.prepared)
        p = next(p for p in e.timeline if p.phase == "forward" and p.node == "h/ln_1" and p.iteration == it)
        assert sp.expand(dict(p.parts)["params"] - e.components["params"] - root - 2 * units["h"]) == 0, layout


def test_grad_op_keeps_every_unit_until_backward(graph):
    """SHARD_GRAD_OP: at the start of backward every layer's parameters are whole again (ZeRO-2's
    peak): the params held then are the shards plus all of them."""
    e = est(graph, "dp=d,fsdp=grad-op")
    shard = e.components["params"]
    whole = sum(p.numel * m * d * padded_rows(p, d) for p, m in e.prepared.params()) * B_w    # padded
    first = next(p for p in e.timeline if p.phase == "backward")
    assert sp.expand(dict(first.parts)["params"] - (shard + whole)) == 0


def test_ddp_buckets_are_a_second_copy_of_the_gradients(graph):
    one, ddp = est(graph, "none"), est(graph, "dp=d")
    a, b_ = one.at(b=2, s=16), ddp.at(b=2, s=16, d=4)
    assert b_.bytes["grads"] == 2 * a.bytes["grads"] == 4 * N
    assert b_.peak == a.peak + 2 * N          # the buckets live through the whole step


def test_deepspeed_bucket_in_backward(graph):
    """ZeRO-2 (stage_1_and_2.py backward()): one ipg buffer of reduce_bucket_size elements in the
    gradients' dtype through backward: with reduce_bucket = 1000, 1000 B_g bytes more at the first
    backward point. ZeRO-1 has none (DeepSpeed's engine sets contiguous_gradients False at stage 1)."""
    def first(e):
        return next(p for p in e.timeline if p.phase == "backward")
    for stage, extra in ((2, 1000 * sm.symbols.B_g), (1, 0)):
        small, none = (est(graph, f"dp=d,zero={stage},reduce_bucket={n}") for n in (1000, 0))
        assert sp.expand(first(small).total - first(none).total - extra) == 0, stage


# ----------------------------------------------------------------------------- command line

def test_cli_parallel_options_and_host_bytes(capsys):
    code = main(["estimate", "--config", str(TINY), "--batch", "2", "--seq", "16", "--precision", "bf16-master",
                 "--dp", "8", "--zero", "2", "--offload", "optimizer", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["inputs"]["parallel"] == "dp=8,zero=2,offload=optimizer"
    assert out["host_bytes"] == 16 * N // 8
    assert out["bytes"]["master"] == out["bytes"]["optimizer"] == 0
    code = main(["estimate", "--config", str(TINY), "--batch", "2", "--seq", "16", "--zero", "5"])
    assert code == 1 and "zero = 5 is not valid" in capsys.readouterr().err
    code = main(["estimate", "--config", str(TINY), "--batch", "2", "--seq", "16", "--dp", "2",
                 "--parallel", "dp=4"])
    assert code == 1 and "Give the layout one way" in capsys.readouterr().err


def test_max_batch_per_rank(capsys):
    """max-batch takes the layout: ZeRO-3 over 8 ranks fits a larger micro-batch than one device."""
    argv = ["max-batch", "--config", str(TINY), "--seq", "16", "--precision", "bf16-master", "--budget", "16MiB",
            "--reserve", "0", "--format", "json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)["max_batch"]
    assert main(argv + ["--dp", "8", "--fsdp", "full"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert sharded["max_batch"] > one and "FSDP full over dp = 8" in sharded["policy"]
    assert "host_bytes" not in sharded
    assert main(argv + ["--dp", "8", "--fsdp", "full", "--offload", "params"]) == 0
    offloaded = json.loads(capsys.readouterr().out)
    # on the host, bf16-master under FSDP being MixedPrecisionPolicy: the float32 shards 4N/8 (the
    # master copy; no bfloat16 shard) + AdamW 8N/8 + the float32 gradient shards 4N/8 = 16N/8
    assert offloaded["host_bytes"] == offloaded["bytes_at_max"]["host"] == 16 * N // 8


def test_single_device_layouts_change_nothing(graph):
    """dp = 1 with nothing sharded is one device whatever the bucket and prefetch sizes: the same
    estimate as no layout at all."""
    a = est(graph, "none").at(b=2, s=16)
    b_ = est(graph, "reduce_bucket=0,prefetch=2").at(b=2, s=16)
    assert a.bytes == b_.bytes and a.peak_point.where == b_.peak_point.where


@pytest.mark.parametrize("model,seq,flag,words", [
    ("llama-2-7b", "8192", "--cp", "context parallel over cp = 2 (ring attention)"),
    ("mixtral-8x7b", "4096", "--ep", "expert parallel over ep = 2"),
])
def test_cli_takes_a_degree_and_names_its_flag(capsys, model, seq, flag, words):
    base = ["estimate", "--model", model, "--batch", "1", "--seq", seq, "--precision", "bf16-mixed"]
    assert main(base + [flag, "2"]) == 0
    assert words in " ".join(capsys.readouterr().out.split())
    assert main(base + [flag, flag[2]]) != 0            # the degree left a symbol: no number to print
    assert f"Pass {flag} {flag[2].upper()}." in capsys.readouterr().err
