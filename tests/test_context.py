"""Context parallelism (symmem.passes.context): what the pass does to a step's formulas, and
the layouts it refuses. The bytes themselves are measured in tests/test_context_measured.py."""

import pytest
import sympy as sp

import symmem as sm
from symmem.errors import ConfigError
from symmem.symbols import c, s

LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=100, max_position_embeddings=64, use_cache=False)


def _estimate(cp, precision="bf16-mixed", device="cuda", **policy):
    return sm.estimate(sm.models.from_hf_config(LLAMA),
                       sm.Policy(precision, "adamw", device, attention="sdpa", parallel=f"cp={cp}", **policy))


def test_a_symbolic_degree_is_the_numbers_it_is_bound_to():
    # a symbolic c is taken as more than two ranks: at c = 4 and 8 it is the numeric layout
    sym = _estimate("c")
    assert c in sym.peak.free_symbols
    for n in (4, 8):
        assert sym.at(b=2, s=64, c=n).peak == _estimate(n).at(b=2, s=64).peak


def test_the_model_states_are_whole_and_the_activations_shrink():
    one, two = _estimate(1).at(b=2, s=64), _estimate(2).at(b=2, s=64)
    for part in ("params", "grads", "master", "optimizer"):
        assert one.bytes[part] == two.bytes[part]
    assert two.peak < one.peak


def test_every_activation_is_of_s_over_c_positions():
    # with the ring's buffers set aside, the step of c ranks on s positions holds what one
    # device holds on s / c: the embedding's output, a layer's saved tensors, the logits
    est = _estimate(2)
    plan = str(est.plan)
    assert "value:input_ids  8*b*s/c  batch" in plan           # the rank's s / c token ids, int64
    assert "(ring: first step)" in plan and "(ring: half queries)" in plan


def test_the_sequence_must_split_into_2c_chunks():
    with pytest.raises(ConfigError) as e:
        _estimate(2).at(b=2, s=66)
    assert "s = 66 is not valid: expected a multiple of 4: context parallelism cuts each sequence into 2c " \
           "load-balanced chunks" in str(e.value)


@pytest.mark.parametrize("config,policy,message", [
    (LLAMA, dict(attention="eager"), "cp = 2 is not valid: expected 1 with the eager attention kernel: ring "
                                     "attention merges the log-sum-exp of a fused kernel (flash, mem-efficient, "
                                     "cudnn)."),
    (LLAMA, dict(attention="sdpa", mode="inference"), "parallel with --mode inference = 'cp=2' is not valid: "
                                                      "expected none."),
    (dict(model_type="bert", hidden_size=32, intermediate_size=40, num_attention_heads=4, num_hidden_layers=2,
          vocab_size=100, max_position_embeddings=64), dict(attention="sdpa"),
     "expected 1 with non-causal attention in "),
])
def test_layouts_ring_attention_does_not_run_are_refused(config, policy, message):
    with pytest.raises(ConfigError) as e:
        sm.estimate(sm.models.from_hf_config(config), sm.Policy("bf16-mixed", "adamw", "cuda", parallel="cp=2",
                                                                **policy))
    assert message in str(e.value)


def test_beside_tensor_parallelism_the_ring_splits_over_the_heads():
    both = sm.estimate(sm.models.from_hf_config(LLAMA), sm.Policy("bf16-mixed", "adamw", "cuda", attention="sdpa",
                                                                  parallel="cp=2,tp=2"))
    assert both.at(b=2, s=64).peak < _estimate(2).at(b=2, s=64).peak


@pytest.mark.parametrize("precision,first,merge", [
    # b = 2, s = 64, c = 4: n = 16 positions a rank, a = 4 heads of d = 8, k = 2 key-value heads.
    # fp32: Q = 4 * 2 * 4 * 16 * 8 = 4,096, KV = 2 * 4 * 2 * 2 * 16 * 8 = 4,096, L = 4 * 2 * 4 * 16
    # = 512; HF's k and v are transposed views, so the ring copies both (KVc = 4,096).
    # first step: the kernel's output and log-sum-exp, c*KV + KV + KVc = 4,096 + 512 + 16,384 +
    # 4,096 + 4,096; merge: c*KV + 3 Qf + 2 L = 16,384 + 12,288 + 1,024.
    ("fp32", 29_184, 29_696),
    # bf16-mixed: Q = 2,048, KV = 2,048, KVc = 2,048, Qf = 4,096; the kernel also holds autocast's
    # bfloat16 copies of q and k (2,048 + 1,024; v comes from its projection in bfloat16):
    # first step 2,048 + 3,072 + 512 + 8,192 + 2,048 + 2,048 + Qf (c > 2) 4,096; merge c*KV +
    # 4 Qf + 2 L = 8,192 + 16,384 + 1,024.
    ("bf16-mixed", 22_016, 25_600)])
def test_the_ring_moments_of_a_layer(precision, first, merge):
    from symmem.plan import Compute, Mark, flat
    est = _estimate(4, precision, "cpu")
    subs = est._subs({"b": 2, "s": 64})
    events = list(flat(est.plan.forward))
    mark = next(e for e in events if isinstance(e, Mark) and e.node.endswith("context (ring: first step)"))
    compute = next(e for e in events if isinstance(e, Compute) and e.node.endswith("self_attn/context"))
    assert sum(x for _, x in mark.extra).xreplace(subs) == first
    assert compute.temp.xreplace(subs) == merge


def test_the_fewest_context_parallel_ranks_that_fit():
    # Llama-3-8B, 262,144 tokens in one sequence, FSDP full over 8 ranks, full recomputation:
    # c = 8 holds 86.85 GiB, over 80 GiB less its 10% reserve (72 GiB); c = 16 58.38 GiB. Only
    # the c with 2c | s are tried (the divisors of s / 2).
    from symmem.solve import solve
    est = sm.estimate(sm.models.preset("llama-3-8b"), sm.Policy("bf16-mixed", "adamw", "cuda", recompute="full",
                                                                parallel="dp=8,fsdp=full,cp=c"))
    sol = solve(est, "c", "80GiB", direction="min", b=1, s=262_144)
    assert (sol.value, sol.step) == (16, 8)
    assert sol.at_value.peak <= sol.usable < sol.past_value.peak
    assert sol.at_value.peak == sm.estimate(sm.models.preset("llama-3-8b"), sm.Policy(
        "bf16-mixed", "adamw", "cuda", recompute="full", parallel="dp=8,fsdp=full,cp=16")).at(b=1, s=262_144).peak
