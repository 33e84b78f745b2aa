"""symmem fit: the layouts that fit, fewest GPUs first, each checked against its own estimate."""
import json

import pytest

import symmem as sm
from symmem.cli import main
from symmem.errors import ConfigError
from symmem.fit import fit, table
from symmem.gpus import budget


@pytest.fixture(scope="module")
def gpt2_layouts():
    # GPT-2 small, s = 1024, 64 sequences a step, on 16 GiB - 10%, up to 2 GPUs (pp = 2: 12 layers, 6 a stage)
    return fit(sm.models.preset("gpt2"), budget(bytes="16GiB"), 1024, 64, max_gpus=2, max_pp=2)


def _sample(layouts):
    """The first layout of each (gpus, sharding, pp): every kind of estimate fit derives,
    checked with a derivation of its own (the layout's numbers, not fit's symbols d and t,
    and its own micro-batch count, not the 2 or pp + 1 that stood for it)."""
    seen, out = set(), []
    for x in layouts:
        if (x.gpus, x.sharding, x.pp) not in seen:
            seen.add((x.gpus, x.sharding, x.pp))
            out.append(x)
    return out


def _policy(x, b: int):
    """The layout ``x`` at micro-batch ``b`` (the rest of its rank's share accumulated, or run
    through its pipeline)."""
    k = 64 // (x.dp * b)
    parallel = x.parallel.replace(f"microbatches={x.accumulate}", f"microbatches={k}")
    return sm.Policy("bf16-mixed", "adamw", "cuda", recompute=x.recompute,
                     accumulate=1 if x.pp > 1 or k == 1 else 2, parallel=parallel)


def test_each_layout_fits_and_is_its_estimate(gpt2_layouts):
    assert gpt2_layouts, "GPT-2 small trains on one 16 GiB device with a small enough micro-batch"
    assert {x.pp for x in gpt2_layouts} == {1, 2}
    for x in gpt2_layouts:
        assert x.gpus == x.dp * x.tp * x.pp and x.dp * x.micro_batch * x.accumulate == 64
        assert x.accumulate >= x.pp          # a pipeline runs at least one micro-batch a stage
    for x in _sample(gpt2_layouts):
        ev = sm.estimate(sm.models.preset("gpt2"), _policy(x, x.micro_batch)).at(b=x.micro_batch, s=1024)
        assert ev.peak == x.peak <= x.usable     # accumulate = 2 stood for k >= 2, pp + 1 for k > pp


def test_largest_micro_batch_and_order(gpt2_layouts):
    keys = [(x.gpus, x.peak) for x in gpt2_layouts]
    assert keys == sorted(keys) and keys[0][0] == 1
    for x in _sample(gpt2_layouts):
        b2 = 2 * x.micro_batch                  # the next divisor of 64 / dp above b
        if (64 // x.dp) % b2 or (x.sharding in ("zero-2", "zero-3", "fsdp-full")) or 64 // (x.dp * b2) < x.pp:
            continue
        assert sm.estimate(sm.models.preset("gpt2"), _policy(x, b2)).at(b=b2, s=1024).peak > x.usable


def test_pipeline_micro_batches_past_stages_plus_one_peak_alike():
    # fit derives a 1F1B pipeline of p stages at m = p + 1 for every m > p: the first stage's
    # last warm-up forward runs beside the first backward's gradients from m = p + 1 on (at m =
    # p every forward precedes every backward); more micro-batches repeat the steady state.
    graph = sm.models.from_hf_config({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                      "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100})

    def peaks(m):
        est = sm.estimate(graph, sm.Policy("bf16-mixed", "adamw", "cuda", parallel=f"pp=2,microbatches={m}"))
        return [rank.at(b=2, s=16).peak for rank in est.ranks]
    two, three = peaks(2), peaks(3)
    assert three == peaks(5) == peaks(8)
    assert two[0] < three[0] and two[1] == three[1]


def test_interleaved_micro_batches_past_twice_the_stages_peak_alike():
    # fit derives an interleaved pipeline of p stages, v chunks a rank, at m = 2p for every
    # multiple m >= 2p: the first rank's 2 (p - 1) + (v - 1) p warm-up chunk forwards leave two
    # steady ones from m v >= (v + 1) p on, which m = 2p reaches for any v; at m = p they do not
    graph = sm.models.from_hf_config({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                      "num_attention_heads": 4, "num_hidden_layers": 8, "vocab_size": 100})

    def peaks(p, v, m):
        est = sm.estimate(graph, sm.Policy("bf16-mixed", "adamw", "cuda", parallel=f"pp={p},microbatches={m},"
                                           f"schedule=interleaved,virtual_stages={v}"))
        return [rank.at(b=2, s=16).peak for rank in est.ranks]
    for p, v in ((2, 2), (2, 4), (4, 2)):
        once, twice = peaks(p, v, p), peaks(p, v, 2 * p)
        assert twice == peaks(p, v, 3 * p), (p, v)
        assert once[0] < twice[0], (p, v)


def test_interleaved_layouts_are_their_estimates(gpt2_layouts):
    # with --max-v 2 the search adds GPT-2's interleaved pipelines (pp = 2: 12 layers in 4 chunks
    # of 3), micro-batch counts multiples of pp; each is its own derivation at its own count
    layouts = fit(sm.models.preset("gpt2"), budget(bytes="16GiB"), 1024, 64, max_gpus=2, max_pp=2, max_v=2)
    chunked = [x for x in layouts if x.v > 1]
    assert chunked and {(x.pp, x.v) for x in chunked} == {(2, 2)}
    assert [x for x in layouts if x.v == 1] == gpt2_layouts
    for x in chunked:
        assert x.accumulate % x.pp == 0 and "schedule=interleaved,virtual_stages=2" in x.parallel
        assert x.as_dict()["schedule"] == "interleaved" and x.as_dict()["virtual_stages"] == 2
        ev = sm.estimate(sm.models.preset("gpt2"), _policy(x, x.micro_batch)).at(b=x.micro_batch, s=1024)
        assert ev.peak == x.peak <= x.usable     # 2 pp stood for k >= 2 pp
    assert " v " in table(layouts).splitlines()[0]


def test_cli_json_and_table(capsys):
    assert main(["fit", "--model", "gpt2", "--budget", "16GiB", "--seq", "1024", "--global-batch", "64",
                 "--max-gpus", "1", "--format", "json"]) == 0
    j = json.loads(capsys.readouterr().out)
    first = j["layouts"][0]
    assert j["usable"] == 16 * 2**30 - 16 * 2**30 // 10 and first["gpus"] == 1
    assert set(first) >= {"gpus", "dp", "tp", "pp", "zero", "recompute", "micro_batch", "bytes", "peak", "headroom"}
    assert main(["fit", "--model", "gpt2", "--budget", "16GiB", "--seq", "1024", "--global-batch", "64",
                 "--max-gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split() == ["gpus", "dp", "tp", "pp", "sharding", "recompute", "b", "k", "peak",
                                           "headroom"]


def test_nothing_fits_and_bad_input(capsys):
    assert main(["fit", "--model", "gpt2", "--budget", "1GiB", "--seq", "1024", "--global-batch", "8",
                 "--max-gpus", "1"]) == 1
    assert "no layout of up to 1 GPUs fits" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="global batch = 0 is not valid: expected a positive integer"):
        fit(sm.models.preset("gpt2"), budget(bytes="16GiB"), 1024, 0)


def test_context_parallel_layouts_are_their_estimates():
    # a small Llama at s = 4096, one sequence a step, on 24 MiB - 10%: with --max-cp 4 the search
    # adds cp = 2 (derived on its own) and cp = 4 (from the derivation in the symbol c), beside
    # tp; each such layout's peak is its own numeric derivation's
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, vocab_size=100, max_position_embeddings=1 << 20)
    g = sm.models.from_hf_config(cfg)
    layouts = fit(g, budget(bytes="24MiB"), 4096, 1, max_gpus=4, max_pp=1, max_cp=4)
    assert {x.cp for x in layouts} == {1, 2, 4}
    for x in layouts:
        assert x.gpus == x.dp * x.tp * x.pp * x.cp
        if x.cp > 1:
            assert f"cp={x.cp}" in x.parallel and x.as_dict()["cp"] == x.cp
            own = sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda", recompute=x.recompute, parallel=x.parallel))
            assert own.at(b=x.micro_batch, s=4096).peak == x.peak <= x.usable


def test_expert_parallel_layouts_are_their_estimates():
    # a two-layer Mixtral (8 experts) at s = 256, 4 sequences a step, on 40 MiB - 10%, up to 2
    # GPUs: with --max-ep 2 the search adds ep = 2 beside DDP and beside FSDP (dp = ep = 2: each
    # rank its 4 experts whole, derived with dp a number); each such layout is its own derivation
    from test_expert import MIXTRAL
    g = sm.models.from_hf_config(MIXTRAL)
    layouts = fit(g, budget(bytes="40MiB"), 256, 4, max_gpus=2, max_pp=1, max_ep=2)
    assert {(x.ep, x.sharding) for x in layouts if x.ep > 1} == {(2, "ddp"), (2, "fsdp-full")}
    for x in layouts:
        if x.ep > 1:
            assert "ep=2" in x.parallel and x.as_dict()["ep"] == 2 and x.gpus == x.dp == 2
            own = sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda", recompute=x.recompute,
                                           parallel=x.parallel))
            assert own.at(b=x.micro_batch, s=256).peak == x.peak <= x.usable

    # the states floor fit skips an expert-parallel layout by (over ep beside DDP, over dp beside
    # FSDP) is at most the rank's states
    from symmem.fit import STATES, _states_floor
    one = sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda")).at(b=2, s=256)
    whole = {c: one.bytes.get(c, 0) for c in STATES}
    for parallel, sharding, ep in (("dp=4,ep=2", "ddp", 2), ("dp=4,ep=4", "ddp", 4),
                                   ("dp=4,ep=2,fsdp=full", "fsdp-full", 1)):
        states = sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda", parallel=parallel)).at(b=2, s=256).bytes
        assert _states_floor(whole, 4, 1, sharding) // ep <= sum(states.get(c, 0) for c in STATES), parallel


@pytest.mark.parametrize("parallel", ["dp=4", "dp=4,zero=2", "dp=4,zero=3,offload=optimizer", "dp=4,fsdp=full",
                                      "dp=2,tp=2,sp=true", "pp=2,microbatches=4"])
@pytest.mark.parametrize("precision,recompute", [("bf16-mixed", "none"), ("fp32", "full"), ("bf16", "selective")])
def test_no_peak_below_the_states(parallel, precision, recompute):
    """What fit's shortcut rests on: the step's peak is at least the states every rank keeps
    (fit.STATES: the optimizer step runs with all of them), at every batch."""
    from symmem.fit import STATES
    est = sm.estimate("gpt2", sm.Policy(precision, "adamw", recompute=recompute, parallel=parallel))
    for b in (1, 2, 8):
        ev = est.at(b=b, s=512)
        assert sum(ev.bytes.get(c, 0) for c in STATES) <= ev.peak, b


def test_the_states_shortcut_changes_no_layout(monkeypatch):
    """fit leaves a layout whose states exceed the budget at its first batch, and does not derive
    one whose states floor exceeds it: the same layouts as trying every batch of every layout
    (both shortcuts off: no states counted)."""
    args = (sm.models.preset("gpt2"), budget(bytes="2GiB"), 1024, 16)
    quick = fit(*args, max_gpus=2, max_pp=1)
    monkeypatch.setattr("symmem.fit.STATES", ())
    assert quick == fit(*args, max_gpus=2, max_pp=1) and quick


@pytest.mark.parametrize("parallel,sharding", [("dp=4", "ddp"), ("dp=4,zero=1", "zero-1"), ("dp=4,zero=2", "zero-2"),
                                               ("dp=4,zero=3", "zero-3"), ("dp=4,fsdp=full", "fsdp-full"),
                                               ("dp=2,tp=2,sp=true", "ddp"), ("dp=2,tp=2,sp=true,zero=1", "zero-1"),
                                               ("dp=2,tp=2,sp=true,fsdp=full", "fsdp-full"), ("pp=2,microbatches=4", "ddp"),
                                               ("dp=2,pp=2,zero=1,microbatches=4", "zero-1")])
def test_the_states_floor_is_below_every_rank_s_states(parallel, sharding):
    """fit skips a layout whose _states_floor exceeds the budget without deriving it: the floor,
    from one rank's states, is at most the largest states of a rank (a pipeline's stages each
    derived), so at most its peak (GPT-2, Llama-2-7B)."""
    from symmem.fit import STATES, _states_floor
    for model in ("gpt2", "llama-2-7b"):
        one = sm.estimate(model, sm.Policy("bf16-mixed", "adamw")).at(b=2, s=512)
        whole = {c: one.bytes.get(c, 0) for c in STATES}
        par = sm.Parallel.parse(parallel)
        est = sm.estimate(model, sm.Policy("bf16-mixed", "adamw", parallel=parallel))
        most = max(sum(r.at(b=2, s=512).bytes.get(c, 0) for c in STATES) for r in est.ranks or [est])
        n = (par.tp if isinstance(par.tp, int) else 1) * par.pp
        assert _states_floor(whole, par.dp, n, sharding) <= most, model      # and so below the peak
