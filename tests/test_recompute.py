"""Activation recomputation and gradient accumulation as passes over the plan: the specs,
the formulas they give, repeat equal to unrolled, and clear errors. (Against PyTorch:
tests/test_recompute_measured.py.)"""
import pytest
import sympy as sp

import symmem as sm
from helpers import assert_repeat_matches_unrolled
from symmem import passes
from symmem.errors import ConfigError, UnknownName
from symmem.policy import Recompute
from symmem.symbols import B_a, L, V, a, b, h, s

TINY = sm.models.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=500, n_positions=64)
SPECS = ["full", "full,reentrant", "every:2", "every:2,reentrant", "last:1", "last:3,reentrant",
         "selective", "selective,reentrant", Recompute.layers(1, 3)]


def gpt2(n=4):
    return sm.models.build_gpt2(sm.models.GPT2Config(n_embd=64, n_layer=n, n_head=4, vocab_size=500,
                                                     n_positions=64))


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("policy", [("fp32", "adamw", "cpu", "eager"), ("bf16-mixed", "sgd", "cuda", "eager"),
                                    ("bf16-mixed", "adamw", "cpu", "sdpa"), ("bf16-mixed", "sgd", "cuda", "sdpa")],
                         ids="-".join)
def test_repeat_equals_unrolled(spec, policy):
    """The block walked as three copies, extrapolated in L, against the graph written out
    (the passes prepare the same layers: grouped, split) at L = 2 and 4; with eager attention
    and with SDPA (its math kernel on the CPU, whose C++ locals are held; flash on CUDA)."""
    *rest, attention = policy
    pol = sm.Policy(*rest, recompute=spec, attention=attention)
    rep = sm.estimate(gpt2(), pol)
    for n in (2, 4):
        if any(r.broken({L: n}) for r in rep.requirements):
            continue
        unrolled = passes.prepare(gpt2(n), pol).unrolled()
        assert_repeat_matches_unrolled(rep, sm.estimate(unrolled, pol), n, points=((1, 1), (3, 7), (8, 64)))


def test_full_recomputation_keeps_each_layers_input():
    """CUDA, fp32 (1-byte dropout masks, no saved scalars). Saved when forward ends: each
    layer's input, held by its checkpoint (L * 4bsh), the mask every checkpoint holds (4bs^2),
    and outside the layers: input ids 8bs, position ids 8s, the embedding dropout's mask bsh,
    ln_f's input 4bsh and statistics 2 * 4bs, lm_head's input 4bsh, the log-probabilities 4bsV,
    the shifted labels 8bs and the loss's total weight 4."""
    est = sm.estimate(sm.models.preset("gpt2"), sm.Policy("fp32", "sgd", "cuda", recompute="full", attention="eager"))
    expected = L * 4 * b * s * h + 4 * b * s**2 + 8 * b * s + 8 * s + b * s * h + 4 * b * s * h + 8 * b * s \
        + 4 * b * s * h + 4 * b * s * V + 8 * b * s + 4
    assert sp.expand(est.components["activations"].subs(B_a, 4) - expected) == 0
    # every:2 keeps every other layer's input
    est2 = sm.estimate(sm.models.preset("gpt2"), sm.Policy("fp32", "sgd", "cuda", recompute="every:2", attention="eager"))
    assert sp.expand(est2.components["activations"].subs(B_a, 4) - expected.subs(L, L / 2)) == 0
    # the step with it: backward holds a recomputed layer's saved tensors beside the kept inputs
    assert any(p.node.endswith("(recomputed)") for p in est.timeline)
    ev = est.at(b=8, s=1024)
    none = sm.estimate(sm.models.preset("gpt2"), sm.Policy("fp32", "sgd", "cuda", attention="eager")).at(b=8, s=1024)
    assert ev.bytes["activations"] < none.bytes["activations"] / 10 and ev.peak < none.peak


def test_selective_recomputation_drops_the_attention_terms():
    """Korthikanti et al.'s selective recomputation: the a*b*s^2 tensors of the attention
    core (scores, probabilities, dropout) are recomputed, the rest is kept: no saved term
    depends on the number of heads a."""
    pol = sm.Policy("bf16-mixed", "adamw", "cuda", attention="eager")
    none = sm.estimate(sm.models.preset("gpt2"), pol).components["activations"]
    sel = sm.estimate(sm.models.preset("gpt2"), sm.Policy("bf16-mixed", "adamw", "cuda",
                                                          recompute="selective", attention="eager")).components["activations"]
    assert a in none.free_symbols and a not in sel.free_symbols
    # what selective drops, per layer: a*b*s^2 * (B_a (scores copy? no: the softmax output,
    # float32 under CUDA autocast: 4) + 1 (dropout mask) + B_a (dropout output)), minus the
    # q, k, v copies (3 * B_a * b*s*h) the checkpoint replaces with the qkv output itself
    layer = sp.expand((none - sel).coeff(L))
    assert sp.expand(layer - (4 * a * b * s**2 + a * b * s**2 + B_a * a * b * s**2)) == 0


def test_last_n_keeps_the_last_layers():
    """last:N: the first L - N layers are recomputed, the last N keep their activations; the
    formula holds for L > N (a requirement), and N equal to the model's layers recomputes
    nothing."""
    g = sm.models.preset("gpt2")
    est = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", recompute="last:4", attention="eager"))
    assert [r.name for r in passes.prepare(g, est.policy).repeats()] == ["h[:L - 4]", "h[L - 4:]"]
    full = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", recompute="full", attention="eager")).at(b=4, s=512)
    none = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", attention="eager")).at(b=4, s=512)
    assert full.bytes["activations"] < est.at(b=4, s=512).bytes["activations"] < none.bytes["activations"]
    same = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", recompute="last:12", attention="eager")).at(b=4, s=512)
    assert same.bytes == none.bytes


@pytest.mark.parametrize("n", [1, 2, 3])
def test_small_models_are_derived_with_their_layers_bound(n):
    """Where a block's first or last iteration differs, the formula in L holds from two
    iterations on; a model with fewer is derived with its count bound, exactly (the same
    as the unrolled graph)."""
    pol = sm.Policy("fp32", "adamw", "cpu", recompute="full", attention="eager")
    g = gpt2(n)
    est = sm.estimate(g, pol)
    assert_repeat_matches_unrolled(est, sm.estimate(passes.prepare(g, pol).unrolled(), pol), n,
                                   points=((1, 1), (3, 7)))


def test_nodes_and_layer_ranges_from_python():
    g = sm.models.preset("gpt2")
    mlp = Recompute.nodes("h/mlp.c_fc", "h/mlp/gelu_new", "h/mlp.c_proj")
    est = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", recompute=mlp, attention="eager"))
    assert est.plan.notes[0].startswith("recompute nodes(h/mlp.c_fc, h/mlp/gelu_new, h/mlp.c_proj): 3 regions")
    none = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", attention="eager")).at(b=4, s=512)
    assert est.at(b=4, s=512).bytes["activations"] < none.bytes["activations"]
    part = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", recompute=Recompute.layers(0, 6), attention="eager"))
    assert part.plan.notes[0].startswith("recompute layers(0:6)")


def test_nth_checkpoints_the_first_layer_of_each_group():
    """nth:N (transformers' every_n_layers=N): layers 0, N, 2N, ... are checkpointed, so nth:1
    is full and nth:L is Recompute.layers(0, 1)."""
    g, pol = gpt2(4), dict(precision="fp32", optimizer="adamw", device="cpu", attention="eager")
    at = {"b": 4, "s": 32}

    def peak_and_saved(spec):
        ev = sm.estimate(g, sm.Policy(**pol, recompute=spec)).at(**at)
        return ev.peak, ev.bytes["activations"]
    assert peak_and_saved("nth:1") == peak_and_saved("full")
    assert peak_and_saved("nth:4") == peak_and_saved(Recompute.layers(0, 1))
    none, full, nth = (peak_and_saved(s)[1] for s in ("none", "full", "nth:2"))
    assert full < nth < none          # (exact against transformers: test_recompute_measured.py)


def test_bad_recompute_specs_are_refused_clearly():
    accepted = "expected none, full, every:K, nth:N, selective or last:N, each optionally followed by ,reentrant."
    with pytest.raises(ConfigError) as e:
        sm.Policy(recompute="sometimes", attention="eager")
    assert str(e.value) == f"recompute = 'sometimes' is not valid: {accepted}"
    with pytest.raises(ConfigError, match=r"^recompute = 'every:0' is not valid: expected every:K with K a "
                                          r"whole number >= 1 \(e.g. every:2\)."):
        sm.Policy(recompute="every:0", attention="eager")
    with pytest.raises(ConfigError, match="every:K takes a number of layers, e.g. every:2."):
        sm.Policy(recompute="every", attention="eager")
    with pytest.raises(ConfigError, match=r"^recompute = 'last:13' is not valid: expected last:N with N at "
                                          r"most the 12 layers of block 'h'. Keep fewer layers"):
        sm.estimate(sm.models.preset("gpt2"), sm.Policy(recompute="last:13", attention="eager"))
    with pytest.raises(ConfigError, match=r"^recompute = 'every:5' is not valid: expected every:K with K dividing "
                                          r"the 12 layers of block 'h'. For example every:1, every:2, every:3, "
                                          r"every:4, every:6, every:12.$"):
        sm.estimate(sm.models.preset("gpt2"), sm.Policy(recompute="every:5", attention="eager"))
    with pytest.raises(ConfigError, match=r"^recompute = 'nth:5' is not valid: expected nth:K with K dividing "
                                          r"the 12 layers of block 'h'. For example nth:1, nth:2, nth:3, "
                                          r"nth:4, nth:6, nth:12.$"):
        sm.estimate(sm.models.preset("gpt2"), sm.Policy(recompute="nth:5", attention="eager"))
    with pytest.raises(ConfigError, match=r"^recompute = 'nth:2' is not valid: expected a model with a repeated "
                                          r"block of layers. Use Recompute.layers"):
        sm.estimate(gpt2().unrolled(), sm.Policy(recompute="nth:2", attention="eager"))
    with pytest.raises(ConfigError, match=r"^recompute = 'layers\(12:\)' is not valid: expected layers within "
                                          r"the 12 layers of block 'h'."):
        sm.estimate(sm.models.preset("gpt2"), sm.Policy(recompute=Recompute.layers(12), attention="eager"))
    with pytest.raises(UnknownName, match="unknown node to recompute 'h/mlp/gelu'. Did you mean 'h/mlp/gelu_new'"):
        sm.estimate(sm.models.preset("gpt2"), sm.Policy(recompute=Recompute.nodes("h/mlp/gelu"), attention="eager"))
    untagged = sm.Graph("untagged", {h: 8, V: 11})
    ids = untagged.input("ids", (b, s))
    x = untagged.add("embedding", ids, params=(untagged.param("emb", (V, h)),), name="embed")
    untagged.add("nll_loss", untagged.add("log_softmax", untagged.add(
        "linear", x, params=(untagged.param("head", (V, h)),), name="head"), name="logp"), ids, name="loss")
    with pytest.raises(ConfigError, match=r"recompute = 'selective' is not valid: expected a model that tags "
                                          r"its attention core \(recompute='attention'\)"):
        sm.estimate(untagged, sm.Policy(recompute="selective", attention="eager"))
    with pytest.raises(ConfigError, match="^accumulate = 0 is not valid: expected a whole number of "
                                          "micro-batches >= 1. 1 means no gradient accumulation."):
        sm.Policy(accumulate=0, attention="eager")


# ----- gradient accumulation ------------------------------------------------------------------

def test_accumulation_holds_the_gradients_through_later_micro_batches():
    """fp32 SGD (no optimizer temporaries). From the second micro-batch on, forward runs with
    every gradient alive (4N bytes more than the first micro-batch at the same moment), and
    each parameter's new gradient is a temporary added into .grad."""
    g = sm.models.preset("gpt2")
    one = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", attention="eager"))
    four = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", accumulate=4, attention="eager"))
    ev1, ev4 = one.at(b=8, s=512), four.at(b=8, s=512)
    assert ev4.peak_point.micro == "2" and ev4.peak_point.where.endswith("(micro-batch 2)")
    N4 = int(one.components["grads"].xreplace(one.bindings))
    fwd1 = next(p for p in one.timeline if p.phase == "forward" and p.node == "log_softmax").total
    fwd2 = [p for p in four.timeline if p.phase == "forward" and p.node == "log_softmax" and p.micro == "2"][0].total
    subs = one._subs({"b": 8, "s": 512})
    # the scaled loss of micro-batch 1 (4 bytes) is still referenced during micro-batch 2's forward
    assert int(fwd2.xreplace(subs)) - int(fwd1.xreplace(subs)) == N4 + 4
    assert ev4.bytes["activations"] == ev1.bytes["activations"]      # per micro-batch
    assert ev4.peak > ev1.peak
    assert "accumulate 4: micro-batches 1, 2 (each of 2 to 3) and 4" in four.plan.notes[0]
    assert [mb.label for mb in four.plan.later] == ["2", "4"]
    two = sm.estimate(g, sm.Policy("fp32", "sgd", "cuda", accumulate=2, attention="eager"))
    assert [mb.label for mb in two.plan.later] == ["2"] and two.at(b=8, s=512).peak == ev4.peak


def test_accumulation_with_recomputation():
    g = sm.models.preset("gpt2")
    pol = sm.Policy("bf16-mixed", "adamw", "cuda", recompute="full", accumulate=3, attention="eager")
    est = sm.estimate(g, pol)
    assert len(est.plan.notes) == 2 and est.plan.notes[1].startswith("accumulate 3")
    assert est.at(b=8, s=1024).peak > sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda",
                                                              recompute="full", attention="eager")).at(b=8, s=1024).peak
