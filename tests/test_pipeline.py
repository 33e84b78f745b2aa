"""Pipeline parallelism (symmem.passes.pipeline): the stages' parameters counted, the micro-batches
each schedule keeps in flight (Korthikanti et al. 2022, sec. 4.2.3, as special cases of the
per-stage formulas), the most loaded stage named, bad layouts refused with their values."""
import json

import pytest
import sympy as sp

import symmem as sm
from symmem.cli import main
from symmem.errors import ConfigError
from symmem.passes.pipeline import in_flight
from symmem.solve import max_batch
from symmem.symbols import L


@pytest.fixture(scope="module")
def gelu_gpt2():
    return sm.models.build_gpt2(sm.models.GPT2Config(activation_function="gelu", n_layer=24))


def _estimate(graph, parallel="none", attention="eager", **kw):
    return sm.estimate(graph, sm.Policy("bf16-mixed", "adamw", "cuda", attention=attention, parallel=parallel, **kw))


@pytest.fixture(scope="module")
def llama_pp4():
    """Llama-2-7B over 4 stages, 8 micro-batches, SDPA (flash on CUDA)."""
    return _estimate(sm.models.preset("llama-2-7b"), "pp=4,microbatches=8", attention="sdpa")


def _per_layer(expr):
    """The bytes of the activations that grow with the layers: their coefficient of L."""
    return sp.expand(sp.expand(expr).coeff(L))


@pytest.mark.parametrize("schedule,p,v,m,r,counts,steady", [
    ("1f1b", 4, 1, 8, 0, (4,), True),      # p - r warm-up and steady micro-batches on the first
    ("1f1b", 4, 1, 8, 3, (1,), True),      # one on the last
    ("1f1b", 4, 1, 2, 0, (2,), False),     # m < p: every forward before the first backward
    ("1f1b", 4, 1, 3, 1, (3,), False),     # m - w = 1: the one steady forward runs before any backward
    ("gpipe", 4, 1, 8, 2, (8,), False),
    # interleaved, first rank: 2(p-1) + (v-1)p + 1 = 11 chunk forwards, chunk 0 of micro-batches
    # 0-3 and 4-6 (7), chunk 1 of 0-3 (4)
    ("interleaved", 4, 2, 8, 0, (7, 4), True),
    ("interleaved", 4, 2, 8, 3, (4, 1), True),     # last rank: (v-1)p + 1 = 5
])
def test_micro_batches_in_flight(schedule, p, v, m, r, counts, steady):
    assert in_flight(schedule, p, v, m, r) == (counts, steady)


def test_stage_parameters_llama_2_7b(llama_pp4):
    # per layer 4*4096^2 + 3*4096*11008 + 2*4096 = 202,383,360; 8 layers a stage = 1,619,066,880;
    # the embedding and the output layer 32000*4096 = 131,072,000 each, the final norm 4096
    est = llama_pp4
    counts = [int(rank.prepared.param_count().xreplace(rank.bindings)) for rank in est.ranks]
    assert counts == [1_750_138_880, 1_619_066_880, 1_619_066_880, 1_750_142_976]
    assert sum(counts) == 6_738_415_616                  # Llama-2-7B, every weight on one stage
    params = [rank.at(b=2, s=4096).bytes["params"] for rank in est.ranks]
    assert params == [4 * n for n in counts]             # float32 weights under bf16-mixed


def test_tied_output_layer_keeps_its_own_copy(gelu_gpt2):
    # GPT-2 ties lm_head to wte: the last stage holds a copy (Megatron's shared_embedding), so the
    # stages hold V*h = 50257*768 = 38,597,376 more than the model (24 layers: 12 a stage)
    est = _estimate(gelu_gpt2, "pp=2,microbatches=2")
    counts = [int(rank.prepared.param_count().xreplace(rank.bindings)) for rank in est.ranks]
    whole = int(gelu_gpt2.param_count().xreplace(gelu_gpt2.bindings))
    assert sum(counts) - whole == 50257 * 768


@pytest.mark.parametrize("p", [2, 4])
def test_first_stage_holds_the_whole_models_layers(gelu_gpt2, p):
    """Korthikanti et al. sec. 4.2.3: under 1F1B with m >= p the first stage holds p micro-batches
    of its L/p layers: L layers' activations, whatever p."""
    one = _per_layer(_estimate(gelu_gpt2).components["activations"])
    first = _estimate(gelu_gpt2, f"pp={p},microbatches={2 * p}").ranks[0]
    assert sp.expand(_per_layer(first.components["activations"]) - one) == 0


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 3)])
def test_interleaved_first_stage_factor(gelu_gpt2, p, v):
    """... and under the interleaved schedule L (1 + (p - 1)/(p v)) layers' (their eq. 4)."""
    one = _per_layer(_estimate(gelu_gpt2).components["activations"])
    first = _estimate(gelu_gpt2, f"pp={p},schedule=interleaved,virtual_stages={v},microbatches={2 * p}").ranks[0]
    factor = 1 + sp.Rational(p - 1, p * v)
    assert sp.expand(_per_layer(first.components["activations"]) - factor * one) == 0


def test_gpipe_holds_every_micro_batch(gelu_gpt2):
    # GPipe: m micro-batches of L/p layers on every stage, m/p of the model's layers
    one = _per_layer(_estimate(gelu_gpt2).components["activations"])
    est = _estimate(gelu_gpt2, "pp=4,schedule=gpipe,microbatches=6")
    for rank in est.ranks:
        assert sp.expand(_per_layer(rank.components["activations"]) - sp.Rational(6, 4) * one) == 0


def test_most_loaded_stage_is_the_peak(llama_pp4):
    est = llama_pp4
    evs = [rank.at(b=2, s=4096) for rank in est.ranks]
    top = est.at(b=2, s=4096)
    assert top.peak == max(e.peak for e in evs)
    assert top.peak_point.rank == "0"                    # 4 micro-batches in flight and the embedding
    assert [e.peak for e in evs] == sorted((e.peak for e in evs), reverse=True)
    # each stage's activations: 4, 3, 2, 1 micro-batches of the same layers (the first's
    # embedding and the last's output layer apart)
    acts = [e.bytes["activations"] for e in evs]
    assert acts[1] - acts[2] == acts[2] // 2


def test_largest_batch_fits_every_stage(gelu_gpt2):
    # GPT-2 (24 layers) over 4 stages, GPipe: the last stage's logits in flight make it the
    # most loaded; the largest batch fits every stage and the next does not fit that one
    est = _estimate(gelu_gpt2, "pp=4,schedule=gpipe,microbatches=4", attention="sdpa")
    sol = max_batch(est, 24 * 2**30, s=1024)
    usable, b_max = sol.total - sol.reserve, sol.value     # the budget less the default reserve
    assert b_max >= 2
    peaks = [rank.at(b=b_max, s=1024).peak for rank in est.ranks]
    assert max(peaks) <= usable
    assert max(rank.at(b=b_max + 1, s=1024).peak for rank in est.ranks) > usable
    assert est.at(b=b_max, s=1024).peak == max(peaks)


def test_layer_count_must_divide():
    graph = sm.models.preset("llama-2-7b")                 # 32 layers
    with pytest.raises(ConfigError) as e:
        _estimate(graph, "pp=3,microbatches=3")
    assert str(e.value).startswith("pp = 3 is not valid: expected a divisor of the 32 layers of llama-2-7b "
                                   "(pipeline stages: 3).")
    with pytest.raises(ConfigError, match="pp = 64 is not valid: expected a divisor of the 32 layers"):
        _estimate(graph, "pp=64")
    with pytest.raises(ConfigError, match=r"pipeline stages times virtual stages: 48"):
        _estimate(graph, "pp=8,schedule=interleaved,virtual_stages=6,microbatches=8")


def test_unsupported_combinations_name_the_values():
    with pytest.raises(ConfigError, match=r"pp = 2 is not valid: expected 1 for t5-small: stages are cut from "
                                          r"one repeated block of layers and it has 2"):
        _estimate(sm.models.preset("t5-small"), "pp=2")
    with pytest.raises(ConfigError, match=r"accumulate with --pp = 4 is not valid: .* Give --microbatches 8"):
        sm.Policy(parallel="pp=2,microbatches=2", accumulate=4)
    with pytest.raises(ConfigError, match=r"pp with sharded gradients = 'pp=2, zero stage 2' is not valid"):
        sm.Policy(parallel="pp=2,dp=2,zero=2")
    with pytest.raises(ConfigError, match=r"keep_fp32 with --pp"):
        sm.Policy("bf16-mixed", parallel="pp=2", keep_fp32="lm_head")
    sm.Policy(parallel="pp=2,dp=4,zero=1,tp=2,microbatches=4")          # Megatron's usual layout


def test_cli_reports_every_stage(capsys):
    args = ["estimate", "--model", "gpt2", "--batch", "2", "--seq", "512", "--pp", "2", "--microbatches", "4"]
    assert main(args + ["--format", "json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert [x["stage"] for x in j["ranks"]] == [0, 1]
    assert j["bytes"] == j["ranks"][j["most_loaded"]]["bytes"]
    assert j["bytes"]["peak"] == max(x["bytes"]["peak"] for x in j["ranks"])
    assert j["batch_per_step"] == 8                   # 4 micro-batches of 2
    assert j["parameters"] == 124_439_808             # GPT-2, the last stage's copy of wte once
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"{j['most_loaded']} (most loaded)" in out
    assert "pipeline over pp = 2 stages (1f1b, 4 micro-batches per step)" in " ".join(out.split())
