"""Expert parallelism (symmem.passes.expert): what the pass does to a Mixtral's step, and the
layouts it refuses. The bytes themselves are measured in tests/test_expert_measured.py."""

import pytest

import symmem as sm
from symmem.errors import ConfigError
from symmem.symbols import e

MIXTRAL = dict(model_type="mixtral", hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, vocab_size=100, num_local_experts=8, num_experts_per_tok=2)


def _estimate(ep, config=MIXTRAL, **parallel):
    spec = ",".join([f"ep={ep}"] + [f"{k}={v}" for k, v in parallel.items()])
    return sm.estimate(sm.models.from_hf_config(config), sm.Policy("bf16-mixed", "adamw", "cuda", parallel=spec))


def test_the_experts_states_are_split():
    # Mixtral 8x7B: 3 * 8 * 14336 * 4096 expert weights a layer, 32 layers: 45,097,156,608 of its
    # 46,702,792,704 parameters; at ep = 8 a rank holds one expert a layer
    one = sm.estimate("mixtral-8x7b", sm.Policy("bf16-mixed", "adamw", "cuda")).at(b=1, s=4096)
    eight = sm.estimate("mixtral-8x7b", sm.Policy("bf16-mixed", "adamw", "cuda", parallel="ep=8")).at(b=1, s=4096)
    experts = 3 * 8 * 14336 * 4096 * 32
    assert one.bytes["params"] == 4 * 46_702_792_704
    assert eight.bytes["params"] == 4 * (46_702_792_704 - experts + experts // 8)
    assert eight.bytes["optimizer"] == 2 * eight.bytes["params"]


def test_a_symbolic_degree_is_the_numbers_it_is_bound_to():
    sym = _estimate("e")
    assert e in sym.peak.free_symbols
    for n in (2, 4, 8):
        assert sym.at(b=2, s=16, e=n).peak == _estimate(n).at(b=2, s=16).peak


def test_the_degree_must_divide_the_experts():
    with pytest.raises(ConfigError) as err:
        _estimate(3)
    assert "ep = 3 is not valid: expected a divisor of the 8 experts (num_local_experts)." in str(err.value)
    with pytest.raises(ConfigError) as err:
        _estimate("e").at(b=2, s=16, e=3)
    assert "E = 8 is not valid: expected a multiple of 3: each expert-parallel rank holds E / e whole experts" \
        in str(err.value)


@pytest.mark.parametrize("config,parallel,message", [
    (dict(model_type="llama", hidden_size=32, intermediate_size=40, num_attention_heads=4, num_hidden_layers=2,
          vocab_size=100), {}, "ep = 2 is not valid: expected 1 for llama: it has no mixture of experts (Mixtral's, "
                               "with the default experts_implementation grouped_mm) to split. Leave --ep out."),
    ({**MIXTRAL, "experts_implementation": "batched_mm"}, {},
     "ep = 2 is not valid: expected 1 for mixtral: it has no mixture of experts (Mixtral's, with the default "
     "experts_implementation grouped_mm) to split."),
    (MIXTRAL, {"tp": 2}, "ep = 2 is not valid: expected 1 beside --tp (expert parallelism with them is not modelled "
                         "yet). Use --ep alone, beside --dp (DDP) or beside --fsdp full|grad-op."),
    (MIXTRAL, {"dp": 8, "zero": 2}, "ep = 2 is not valid: expected 1 with ZeRO, FSDP's hybrid shard or offload"),
    (MIXTRAL, {"dp": 8, "fsdp": "hybrid"}, "ep = 2 is not valid: expected 1 with ZeRO, FSDP's hybrid shard or "
                                           "offload"),
    (MIXTRAL, {"dp": 8, "fsdp": "full", "offload": "optimizer"}, "Use --ep beside --dp (DDP) or --fsdp full|grad-op."),
])
def test_layouts_not_modelled_are_refused(config, parallel, message):
    with pytest.raises(ConfigError) as err:
        _estimate(2, config, **parallel)
    assert message in str(err.value)


def test_worst_routing_is_e_times_the_rows_and_is_named():
    balanced, worst = _estimate(4), _estimate(4, ep_load="worst")
    assert worst.at(b=2, s=16).peak > balanced.at(b=2, s=16).peak
    assert "worst routing" in worst.policy.describe()
    with pytest.raises(ConfigError) as err:
        sm.Parallel(ep=2, ep_load="skewed")
    assert "ep_load = 'skewed' is not valid: expected one of balanced, worst." in str(err.value)


def test_beside_fsdp_each_rank_holds_a_dth_of_every_parameter():
    # The experts are sharded over the d / e ranks holding the same E / e of them: where every
    # dim 0 divides, a rank holds 1 / d of every parameter, with or without expert parallelism
    # (Mixtral 8x7B, d = 8: 46,702,792,704 / 8 = 5,837,849,088 parameters, float32 under bf16-mixed)
    for e_ in (1, 2, 8):
        est = sm.estimate("mixtral-8x7b", sm.Policy("bf16-mixed", "adamw", "cuda",
                                                    parallel=f"dp=8,ep={e_},fsdp=full")).at(b=1, s=4096)
        assert est.bytes["params"] == 4 * 46_702_792_704 // 8 == 4 * 5_837_849_088


def test_beside_fsdp_few_experts_on_many_ranks_are_padded():
    # FSDP2 shards the experts' (E / e, 2f, h) and (E / e, h, f) weights on dim 0, padded to a
    # multiple of the d / e ranks: at d = 64, e = 2 a rank holds ceiling(4 / 32) = 1 whole expert
    # a layer (28 of the 32 rows padding), 3 * 14336 * 4096 = 176,160,768 parameters, 32 layers;
    # and the router's (8, 4096) over 64 ranks one row of 4096 each (7 / 8 padding); the other
    # 1,605,636,096 - 32 * 8 * 4096 non-expert parameters divide by 64
    est = sm.estimate("mixtral-8x7b", sm.Policy("bf16-mixed", "adamw", "cuda",
                                                parallel="dp=64,ep=2,fsdp=full")).at(b=1, s=4096)
    router = 32 * 8 * 4096
    others = (46_702_792_704 - 45_097_156_608 - router) // 64
    assert est.bytes["params"] == 4 * (32 * 176_160_768 + 32 * 4096 + others) == 4 * 5_662_347_328


def test_beside_fsdp_the_degree_must_divide_the_ranks():
    with pytest.raises(ConfigError) as err:
        _estimate(4, dp=6, fsdp="full").at(b=2, s=16)
    assert "is not valid: expected a multiple of 4: the experts are sharded over the d / e ranks holding the same " \
           "ones" in str(err.value)
