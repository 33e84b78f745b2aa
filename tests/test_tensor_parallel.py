"""Megatron's tensor and sequence parallelism (symmem.passes.tensor): Korthikanti et al.'s
Table 2 reproduced, the split parameters counted, t = 1 the single device, bad layouts refused."""
import pytest
import sympy as sp

import symmem as sm
from symmem.errors import ConfigError
from symmem.symbols import B_a, L, a, b, h, s, t


@pytest.fixture(scope="module")
def gelu_gpt2():
    return sm.models.build_gpt2(sm.models.GPT2Config(activation_function="gelu"))


def _per_layer(graph, parallel, recompute="none"):
    est = sm.estimate(graph, sm.Policy("fp32", "adam", "cuda", attention="eager", parallel=parallel,
                                       recompute=recompute))
    return sp.expand(sp.expand(est.components["activations"]).coeff(L).subs(B_a, 2))


# Korthikanti et al. 2022, Table 2 (2-byte activations, 1-byte dropout masks), per layer, plus
# the layer norms' float32 mean and rstd symmem counts and they leave out: 2 norms * 2 * 4 *
# s*b = 16*s*b, split along the sequence with sp.
TABLE_2 = {
    ("tp=t", "none"): s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) + 16 * s * b,
    ("tp=t,sp=1", "none"): s * b * h * (34 / t + 5 * a * s / (h * t)) + 16 * s * b / t,
    ("tp=t", "selective"): s * b * h * (10 + 24 / t) + 16 * s * b,
    ("tp=t,sp=1", "selective"): s * b * h * 34 / t + 16 * s * b / t,
}


@pytest.mark.parametrize("parallel,recompute", list(TABLE_2))
def test_korthikanti_table_2(gelu_gpt2, parallel, recompute):
    # tensor parallel: 10*s*b*h whole (the two layer-norm inputs 4, the QKV and MLP inputs 4,
    # the two dropout masks 2) and 24*s*b*h/t split (Q, K, V copies 6, the attention output 2,
    # the MLP's 4h input and GELU output 16); the a*s^2 terms split with the heads
    assert sp.expand(_per_layer(gelu_gpt2, parallel, recompute) - TABLE_2[parallel, recompute]) == 0


def test_split_parameters_of_llama_2_7b():
    # Every weight of the layers, the embedding and the head split in two; the norms whole:
    # 2 * 4096 * 32 + 4096 = 266,240. (6,738,415,616 - 266,240) / 2 + 266,240 = 3,369,340,928
    # parameters a rank, float32 (bf16-mixed keeps float32 weights): 13,477,363,712 bytes.
    est = sm.estimate(sm.models.preset("llama-2-7b"), sm.Policy("bf16-mixed", "adamw", parallel="tp=2"))
    ev = est.at(b=1, s=4096)
    assert ev.bytes["params"] == ev.bytes["grads"] == 4 * 3_369_340_928 == 13_477_363_712
    assert ev.bytes["optimizer"] == 2 * 13_477_363_712       # exp_avg, exp_avg_sq (steps on the host)


@pytest.mark.parametrize("name,precision,impl", [("gpt2", "bf16-mixed", "foreach"),
                                                 ("llama-2-7b", "fp32", "for-loop")])
def test_t_equal_to_one_is_one_device(name, precision, impl):
    g = sm.models.preset(name)
    one = sm.estimate(g, sm.Policy(precision, "adamw", "cuda", impl))
    split = sm.estimate(g, sm.Policy(precision, "adamw", "cuda", impl, parallel="tp=t"))
    assert t in split.peak.free_symbols
    x, y = one.at(b=2, s=512), split.at(b=2, s=512, t=1)
    assert (x.bytes, x.peak_parts) == (y.bytes, y.peak_parts)


def test_sequence_parallel_splits_every_layer_value():
    # With sp every value a layer keeps is split along the sequence: the per-layer
    # activations (the coefficient of L) are exactly one device's over t; tp alone keeps the
    # norms' and residuals' whole, so it stays above that.
    g = sm.models.preset("llama-2-7b")
    ests = {p: sm.estimate(g, sm.Policy("bf16-mixed", "adamw", parallel=p)) for p in ("none", "tp=t", "tp=t,sp=1")}
    per_layer = {p: sp.expand(e.components["activations"]).coeff(L) for p, e in ests.items()}
    assert sp.expand(per_layer["tp=t,sp=1"] - per_layer["none"] / t) == 0
    kept_whole = (per_layer["tp=t"] - per_layer["none"] / t).xreplace(ests["tp=t"]._subs({"b": 1, "s": 4096, "t": 8}))
    assert kept_whole > 0
    # and the whole step at b = 1, s = 4096, t = 8: sp below tp alone below one device
    act = {p: e.at(b=1, s=4096, **({} if p == "none" else {"t": 8})).bytes["activations"] for p, e in ests.items()}
    assert act["tp=t,sp=1"] < act["tp=t"] < act["none"]


def test_bad_layouts_are_refused_with_the_values():
    g = sm.models.preset("llama-2-7b")
    with pytest.raises(ConfigError, match="a = 32 is not valid: expected a multiple of 3: Megatron splits"):
        sm.estimate(g, sm.Policy("bf16-mixed", "adamw", parallel="tp=3")).at(b=1, s=128)
    with pytest.raises(ConfigError, match=r"sp = True is not valid: expected tensor parallelism beside it"):
        sm.Policy("bf16-mixed", "adamw", parallel="sp=1")
    for layout in ("tp=2,dp=2,zero=3,offload=params", "tp=2,dp=2,fsdp=full,offload=both"):
        with pytest.raises(ConfigError, match="expected 1 with parameter offload"):
            sm.estimate(g, sm.Policy("bf16-mixed", "adamw", parallel=layout))
    with pytest.raises(ConfigError, match="expected 1 with lora"):
        sm.estimate(g, sm.Policy("bf16-mixed", "adamw", lora=8, parallel="tp=2"))
    with pytest.raises(ConfigError, match="expected 1 for resnet-50: it has no attention or MLP layer"):
        sm.estimate(sm.models.preset("resnet-50"), sm.Policy("bf16-mixed", "sgd", parallel="tp=2"))
    with pytest.raises(ConfigError, match="parallel with --mode inference = 'tp=2' is not valid"):
        sm.estimate(g, sm.Policy("bf16", "adamw", mode="inference", parallel="tp=2"))


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_beside_tensor_parallelism_shards_the_ranks_own_states(gelu_gpt2, zero):
    """ZeRO 1-2 over d ranks, each a tensor-parallel rank (Megatron-DeepSpeed; Megatron's
    distributed optimizer is ZeRO-1): the rank's master copy and optimizer states (and from
    stage 2 its gradients) are its tensor-parallel states / d; the step's float32 gradients
    too. ZeRO-1's forward is the tensor-parallel rank's at every moment, less those states."""
    policy = dict(precision="bf16-master", optimizer="adamw", device="cuda", attention="eager")
    tp = sm.estimate(gelu_gpt2, sm.Policy(**policy, parallel="tp=t,sp=1"))
    zr = sm.estimate(gelu_gpt2, sm.Policy(**policy, parallel=f"tp=t,sp=1,dp=d,zero={zero}"))
    d = sm.symbols.d
    sharded = ("master", "optimizer") + (("grads",) if zero == 2 else ())
    for k in ("params", "grads", "master", "optimizer"):
        assert sp.expand(zr.components[k] - tp.components[k] / (d if k in sharded else 1)) == 0, k
    saved = sp.expand(sum(tp.components[k] for k in ("master", "optimizer")) * (1 - 1 / d))
    if zero == 1:
        fwd = [(p.where, p.total) for p in tp.timeline if p.phase == "forward"]
        assert [(p.where, sp.expand(p.total + saved)) for p in zr.timeline if p.phase == "forward"] == \
            [(w, sp.expand(x)) for w, x in fwd]
    # the step's float32 copy of the gradients: the rank's partition
    from symmem.plan import Alloc
    whole, part = [[e.nbytes for e in x.plan.optimizer if isinstance(e, Alloc) and e.key.kind == "master grads"]
                   for x in (tp, zr)]
    assert len(whole) == len(part) == 1 and sp.expand(whole[0] - part[0] * d) == 0
    # ZeRO-Offload: the partitions of the master copy, the states and the float32 gradients on
    # the host, as much of the rank's as ZeRO-1 or 2 keeps on the device
    off = sm.estimate(gelu_gpt2, sm.Policy(**policy, parallel=f"tp=t,sp=1,dp=d,zero={zero},offload=optimizer"))
    host = (2 * tp.components["master"] + tp.components["optimizer"]) / d
    assert sp.expand(off.components["host"] - host) == 0 and off.components["master"] == 0
    # llama-2-7b at t = 8, d = 4: the rank's 842,534,912 parameters ((6,738,415,616 - 266,240
    # norms) / 8 + 266,240), bfloat16 weights and gradients 2 bytes each, master 4 / 4 and
    # AdamW 8 / 4 a parameter: 1,685,069,824 + 1,685,069,824 (ZeRO-2: / 4) + 842,534,912 +
    # 1,685,069,824 bytes
    ev = sm.estimate(sm.models.preset("llama-2-7b"),
                     sm.Policy(**policy, parallel=f"tp=8,sp=1,dp=4,zero={zero}")).at(b=1, s=4096)
    n = 842_534_912
    assert [ev.bytes[k] for k in ("params", "grads", "master", "optimizer")] == \
        [2 * n, 2 * n // (4 if zero == 2 else 1), n, 2 * n]


def test_smallest_tensor_parallel_degree_that_fits():
    # t must divide the heads (32): 1, 2, 4, 8, 16, 32. Llama-2-7B's
    # states alone are 100.41 GiB on one device (16 bytes a parameter with AdamW's steps on the
    # host); at t = 8 with sp 15.69 GiB fit 24 GiB - 10%, t = 4 (31.38 GiB) does not.
    from symmem.solve import solve
    g = sm.models.preset("llama-2-7b")
    est = sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda", parallel="tp=t,sp=1"))
    sol = solve(est, "t", "24GiB", direction="min", b=1, s=4096)
    assert (sol.value, sol.step) == (8, 4)
    assert sol.at_value.peak <= sol.usable < sol.past_value.peak


def test_cli_names_the_flag_of_a_symbolic_degree(capsys):
    from symmem.cli import main
    assert main(["estimate", "--model", "gpt2", "--batch", "8", "--seq", "1024", "--tp", "t"]) != 0
    assert "the formulas of gpt2 use t (t: tensor-parallel degree). Pass --tp T." in capsys.readouterr().err
