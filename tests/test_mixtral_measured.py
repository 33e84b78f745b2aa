"""Mixtral against Hugging Face's own ``MixtralForCausalLM`` on the CPU: random weights from small
configs (no download), eager and SDPA attention, float32, bfloat16 autocast and a bfloat16 model,
K = 1, K = 2 and K = E, grouped-query and multi-query attention; parameters, bytes saved for
backward, the training step's peak, its phase and every phase's maximum, to the byte, under
three routings: as the random router sends the tokens, all tokens on the same K experts (the
worst case for one expert) and exactly balanced (every expert b s K / E pairs); the experts
through transformers' default ``grouped_mm`` and through ``batched_mm``.
"""
import warnings

import pytest
import sympy as sp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError, UnknownName  # noqa: E402
from symmem.measure import param_bytes  # noqa: E402
from helpers import assert_hf_step_exact, enable_checkpointing  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, f, a, k, L, V, E, K)
POINTS = [
    (2, 8, 32, 64, 4, 2, 2, 100, 4, 2),
    (2, 16, 32, 16, 4, 4, 2, 400, 8, 2),    # a large vocabulary, narrow experts: the peak at the head
    (3, 8, 32, 64, 4, 1, 2, 50, 4, 1),      # K = 1, multi-query
    (1, 16, 32, 48, 4, 2, 2, 100, 3, 3),    # b = 1, K = E: every token on every expert
]


def hf_mixtral(point, attention, routing="random", **extra):
    """The model, and the tokens per expert in each layer, counted in a forward before the step.
    ``worst``: the router's weights zeroed, so every probability ties and topk takes the same K
    experts for every token; ``balanced``: a forward hook on the router rewrites its indices in
    place (through ``.data``: no allocation, no version bump) to expert (n K + j) mod E for
    token n's j-th pick."""
    b, s, h, f, a, k, L, V, E, K = point
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=k,
                                     num_hidden_layers=L, vocab_size=V, num_local_experts=E, num_experts_per_tok=K,
                                     attn_implementation=attention, use_cache=False, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=None, **extra)
    model = transformers.MixtralForCausalLM(cfg)
    model.train()
    # transformers' default, else as asked
    assert model.config._experts_implementation == extra.get("experts_implementation", "grouped_mm")

    def balanced(module, args, out):
        flat = out[2].data.view(-1)
        torch.arange(flat.numel(), out=flat)
        flat.remainder_(E)
    for layer in model.model.layers:
        if routing == "worst":
            with torch.no_grad():
                layer.mlp.gate.weight.zero_()
        elif routing == "balanced":
            layer.mlp.gate.register_forward_hook(balanced)
    return cfg, model


def tokens_per_expert(model, ids, E):
    counts = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, args, out: counts.append(sorted(torch.bincount(out[2].reshape(-1), minlength=E).tolist())))
        for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for hk in hooks:
        hk.remove()
    return counts


def graph_of(cfg):
    return sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation,
                                     "experts_implementation": cfg._experts_implementation})


CASES = [
    # point, attention, precision, optimizer, implementation, routing
    (POINTS[0], "eager", "fp32", "adamw", "for-loop", "random"),
    (POINTS[0], "eager", "fp32", "sgd", "for-loop", "worst"),
    (POINTS[0], "eager", "bf16", "sgd-momentum", "for-loop", "balanced"),
    (POINTS[1], "sdpa", "bf16-mixed", "adamw", "foreach", "worst"),
    (POINTS[1], "sdpa", "bf16", "adam", "foreach", "balanced"),
    (POINTS[2], "eager", "bf16-mixed", "sgd", "for-loop", "random"),
    (POINTS[3], "sdpa", "fp32", "adamw", "for-loop", "random"),
    (POINTS[3], "eager", "bf16-mixed", "sgd", "for-loop", "random"),
]


@pytest.mark.parametrize("point,attention,precision,opt,impl,routing", CASES,
                         ids=[f"b{p[0]}-V{p[7]}-E{p[8]}-K{p[9]}-{at}-{pr}-{o}-{i}-{r}"
                              for p, at, pr, o, i, r in CASES])
def test_mixtral_exact(point, attention, precision, opt, impl, routing):
    """Parameters (E h router + 3 E f h experts per layer), the rotary buffers, saved bytes, the
    peak, its phase and every phase's maximum, whatever the routing: the grouped_mm path holds
    (S, .) tensors for the S = b s K pairs however they fall on the experts."""
    b, s, h, f, a, k, L, V, E, K = point
    cfg, model = hf_mixtral(point, attention, routing)
    if precision == "bf16":
        model.to(torch.bfloat16)
    ids = torch.randint(0, V, (b, s))
    counts = tokens_per_expert(model, ids, E)
    if routing == "worst":       # b s tokens on each of K experts, none on the others
        assert counts == [[0] * (E - K) + [b * s] * K] * L
    elif routing == "balanced":
        assert counts == [[b * s * K // E] * E] * L
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", impl))
    if b == 1:
        est = est.at_one
    ev = est.at(b=b, s=s)
    buffers = sum(t.untyped_storage().nbytes() for t in model.buffers())
    assert (ev.bytes["params"], ev.bytes["buffers"]) == (param_bytes(model), buffers)
    assert_hf_step_exact(est, model, ids, precision, opt, b, s, impl=impl)


RECOMPUTED = [
    (POINTS[0], "eager", "fp32", "full"),
    (POINTS[0], "sdpa", "bf16", "full"),
    (POINTS[0], "sdpa", "bf16-mixed", "last:1"),
]


@pytest.mark.parametrize("point,attention,precision,spec", RECOMPUTED,
                         ids=[f"{sp_}-{at}-{pr}" for p, at, pr, sp_ in RECOMPUTED])
def test_mixtral_recomputed_exact(point, attention, precision, spec):
    """Hugging Face's gradient checkpointing (non-reentrant; ``last:N``: off on the last N
    layers): nothing of a checkpointed mixture is saved, so its forward holds only what its
    Python locals keep (the gathered rows and weights, the offsets, the last ``proj_out`` and
    ``weighted_out`` until the experts return), and backward runs it again."""
    b, s, h, f, a, k, L, V, E, K = point
    cfg, model = hf_mixtral(point, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # an alias in transformers 5
        enable_checkpointing(model)
    if spec.startswith("last:"):
        for layer in list(model.model.layers)[L - int(spec[5:]):]:
            layer.gradient_checkpointing = False
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "sgd", "cpu", "for-loop", recompute=spec))
    assert_hf_step_exact(est, model, torch.randint(0, V, (b, s)), precision, "sgd", b, s)


BATCHED = [
    # point, attention, precision, optimizer, routing, recompute
    (POINTS[0], "eager", "fp32", "adamw", "balanced", "none"),
    (POINTS[0], "sdpa", "bf16-mixed", "sgd", "worst", "none"),
    (POINTS[2], "eager", "bf16", "adamw", "balanced", "none"),      # K = 1
    (POINTS[3], "sdpa", "fp32", "sgd", "random", "none"),           # b = 1, K = E
    (POINTS[0], "sdpa", "bf16-mixed", "sgd", "random", "full"),
    # few pairs, many experts: backward's peak where a gathered weight's gradient becomes the
    # parameter's (index_put's result beside the zeros it started from)
    ((2, 2, 32, 64, 4, 2, 2, 50, 8, 1), "eager", "bf16-mixed", "sgd", "random", "none"),
]


@pytest.mark.parametrize("point,attention,precision,opt,routing,spec", BATCHED,
                         ids=[f"b{p[0]}-E{p[8]}-K{p[9]}-{at}-{pr}-{o}-{r}-{sp_}" for p, at, pr, o, r, sp_ in BATCHED])
def test_mixtral_batched_mm_exact(point, attention, precision, opt, routing, spec):
    """``experts_implementation="batched_mm"``: saved bytes and every phase's maximum, whatever
    the routing (every tensor has S = b s K or N rows). Under autocast the float32 gathered
    weights are not saved (their half copies are) but ``selected_weights`` keeps the gate-up
    ones until the down ones are gathered, in the recomputation too (``full``)."""
    b, s, h, f, a, k, L, V, E, K = point
    cfg, model = hf_mixtral(point, attention, routing, experts_implementation="batched_mm")
    if precision == "bf16":
        model.to(torch.bfloat16)
    if spec == "full":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable_checkpointing(model)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", "for-loop", recompute=spec))
    if b == 1:
        est = est.at_one
    assert_hf_step_exact(est, model, torch.randint(0, V, (b, s)), precision, opt, b, s)


def test_batched_mm_saved_bytes_pinned_by_hand():
    """POINTS[0] in float32 (N = 16 tokens, S = 32 pairs, E = 4, h = 32, f = 64), the experts
    per layer. grouped_mm saves 42,576 - 704 (the router's, below) = 41,872 bytes; batched_mm
    saves the repeated rows S h 4 = 4096, the gathered gate-up weights S 2f h 4 = 524,288, the
    gate-up output S 2f 4 = 16,384, silu's output and the gated product 2 S f 4 = 16,384, the
    gathered down weights S h f 4 = 262,144, the down output S h 4 = 4096 and the top-k weights
    themselves N K 4 = 128 (their gather in grouped_mm): 827,520, 785,648 more a layer."""
    b, s, h, f, a, k, L, V, E, K = POINTS[0]
    N, S = b * s, b * s * K
    batched = S * h * 4 + S * 2 * f * h * 4 + S * 2 * f * 4 + 2 * S * f * 4 + S * h * f * 4 + S * h * 4 + N * K * 4
    assert batched == 827_520
    cfg = hf_mixtral(POINTS[0], "eager")[0]
    grouped = sm.estimate(graph_of(cfg), sm.Policy("fp32", "sgd", "cpu"))
    cfg._experts_implementation = "batched_mm"
    est = sm.estimate(graph_of(cfg), sm.Policy("fp32", "sgd", "cpu"))
    assert est.at(b=b, s=s).bytes["activations"] - grouped.at(b=b, s=s).bytes["activations"] \
        == L * (batched - 41_872) == 2 * 785_648


def test_saved_bytes_pinned_by_hand():
    """POINTS[0] in float32, eager, per layer, of the mixture alone (N = b s = 16 tokens, S = N K
    = 32 pairs, E = 4, h = 32, f = 64): the router's softmax output N E 4 = 256, the topk indices
    N K 8 = 256, the renormalisation's divisor N 4 = 64 and its copy of the values N K 4 = 128;
    the gather indices (perm // K, perm, the inverse permutation) 3 S 8 = 768 and the offsets
    E 4 = 16; the gathered rows S h 4 = 4096, the gate-up output S 2f 4 = 16384, silu's output
    and the gated product 2 S f 4 = 16384, the expert output S h 4 = 4096 and the gathered
    weights S 4 = 128: 42,576 bytes. (The router reads the norm's output, which the layer keeps.)"""
    b, s, h, f, a, k, L, V, E, K = POINTS[0]
    est = sm.estimate(graph_of(hf_mixtral(POINTS[0], "eager")[0]), sm.Policy("fp32", "sgd", "cpu"))
    N, S = b * s, b * s * K
    moe = N * E * 4 + N * K * 8 + N * 4 + N * K * 4 + 3 * S * 8 + E * 4 + S * h * 4 + S * 2 * f * 4 \
        + 2 * S * f * 4 + S * h * 4 + S * 4
    assert moe == 42_576
    mistral = {"model_type": "mistral", "hidden_size": h, "intermediate_size": f, "num_hidden_layers": L,
               "num_attention_heads": a, "num_key_value_heads": k, "vocab_size": V, "sliding_window": None,
               "attn_implementation": "eager"}
    dense = sm.estimate(sm.models.from_hf_config(mistral), sm.Policy("fp32", "sgd", "cpu"))
    # Mistral's MLP saves the norm's output (as the router does), gate_proj's and up_proj's
    # outputs, silu's output and the product: 4 N f 4 = 16,384 per layer
    assert est.at(b=b, s=s).bytes["activations"] - dense.at(b=b, s=s).bytes["activations"] \
        == L * (moe - 4 * N * f * 4) == 2 * 26_192


def test_formula_in_E_and_K():
    """The activations are linear in K (S = b s K pairs) and depend on E only through the
    router's (b s, E) tensors and the (E,) offsets."""
    est = sm.estimate(sm.models.from_hf_config({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
                                                "num_hidden_layers": 2, "num_attention_heads": 4,
                                                "num_key_value_heads": 4, "vocab_size": 100}),
                      sm.Policy("fp32", "sgd"))
    act = est.components["activations"]
    E, K, b, s = sm.symbols.E, sm.symbols.K, sm.symbols.b, sm.symbols.s
    assert {E, K} <= act.free_symbols
    assert sp.degree(sp.expand(act), K) == 1
    assert sp.expand(sp.diff(act, E, 2)) == 0


# ----------------------------------------------------------------------------- presets and configs

def test_preset_parameter_count():
    """Mixtral 8x7B: embeddings and head 2*32000*4096 = 262,144,000; 32 layers of q and o
    (2*4096^2), k and v (2*4096*1024), the router (8*4096), the experts (3*8*14336*4096) and two
    norms: 1,451,270,144 each; the final norm 4096: 46,702,792,704 (the published checkpoint)."""
    est = sm.estimate("mixtral-8x7b", sm.Policy("fp32", "sgd"))
    assert est.at(b=1, s=128).bytes["params"] == 4 * 46_702_792_704
    assert sm.models.preset("mistralai/Mixtral-8x7B-v0.1").name == "mixtral-8x7b"


def test_preset_count_matches_transformers():
    """The preset's config built by transformers on the meta device: the same count."""
    cfg = sm.models.PRESETS["mixtral-8x7b"]
    hf = transformers.MixtralConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                    num_hidden_layers=cfg.num_hidden_layers,
                                    num_attention_heads=cfg.num_attention_heads,
                                    num_key_value_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size,
                                    num_local_experts=cfg.num_local_experts,
                                    num_experts_per_tok=cfg.num_experts_per_tok)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(hf)
    assert sum(p.numel() for p in model.parameters()) == 46_702_792_704


def test_config_json_keys():
    """Mixtral 8x7B's config.json as published: every key is read, aliased, or ignored with a
    reason; ``num_experts`` is transformers' alias of ``num_local_experts``."""
    published = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                 "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                 "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
                 "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                 "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
                 "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
                 "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                 "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
    fam, cfg = sm.models.hf_config(published)
    assert fam.name == "mixtral" and cfg == sm.models.PRESETS["mixtral-8x7b"].__class__(
        **{**vars(sm.models.PRESETS["mixtral-8x7b"]), "name": "mixtral"})
    assert {k: fam.classify(k) for k in ("num_experts", "router_aux_loss_coef", "output_router_logits")} == \
        {"num_experts": "alias", "router_aux_loss_coef": "ignored", "output_router_logits": "field"}
    _, cfg = sm.models.hf_config({**published, "num_local_experts": None, "num_experts": 4} | {"num_local_experts": 4})
    assert cfg.num_local_experts == 4


BASE = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


@pytest.mark.parametrize("changes,words", [
    ({"num_local_experts": 2, "num_experts_per_tok": 3},
     "num_experts_per_tok = 3 is not valid: expected at most the number of experts num_local_experts (2)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads = 3 is not valid: expected a divisor of the number of "
                                 "attention heads (4)"),
    ({"num_local_experts": 0}, "num_local_experts = 0 is not valid: expected a positive integer"),
    ({"output_router_logits": 1}, "output_router_logits = 1 is not valid: expected true or false"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1 is not valid: expected 0.0 or 0"),
    ({"experts_implementation": "eager"}, "experts_implementation = 'eager' is not valid: expected \"grouped_mm\" "
                                          "(transformers' default, or null), \"batched_mm\". The others (eager's"),
    ({"experts_implementation": "sonicmoe"}, "experts_implementation = 'sonicmoe' is not valid"),
    ({"hidden_act": "gelu"}, "unknown hidden_act 'gelu'"),
])
def test_bad_mixtral_config_is_refused(changes, words):
    with pytest.raises((ConfigError, UnknownName)) as e:
        sm.models.from_hf_config({**BASE, **changes})
    assert words in str(e.value)


def test_experts_implementation_is_read():
    """transformers' key and its private attribute (``config._experts_implementation``); null
    is its default, grouped_mm."""
    for key, value in (("experts_implementation", "batched_mm"), ("_experts_implementation", "batched_mm"),
                       ("experts_implementation", None), ("experts_implementation", "grouped_mm")):
        _, cfg = sm.models.hf_config({**BASE, key: value})
        assert cfg.experts_implementation == value
    nodes = {n.op for n in sm.models.from_hf_config({**BASE, "experts_implementation": "batched_mm"}).nodes()}
    assert {"gather_param", "batched_linear"} <= nodes and "grouped_mm" not in nodes
