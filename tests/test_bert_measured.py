"""BERT against Hugging Face's own ``BertForMaskedLM`` on the CPU: random weights from small
configs (no download), eager and SDPA attention, float32, bfloat16 autocast and a bfloat16
model, dropout on as in training; MLM labels (-100 on the unmasked positions), token types and
an attention mask; parameters and buffers, bytes saved for backward, the training step's peak,
its phase and every phase's maximum, to the byte.
"""
import pytest
import sympy as sp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError, UnknownName  # noqa: E402
from symmem.measure import param_bytes, saved_bytes, training_step  # noqa: E402
from helpers import assert_step_exact, enable_checkpointing  # noqa: E402
from test_gpt2_measured import optimizer  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, f, a, L, V)
POINTS = [
    (2, 16, 32, 64, 4, 2, 100),
    (2, 8, 64, 256, 4, 2, 30),       # wide layers, a small vocabulary: peaks inside the layers
    (3, 12, 48, 96, 6, 2, 100),
    (1, 16, 32, 64, 4, 2, 100),      # b = 1
]


def hf_bert(point, attention, **extra):
    b, s, h, f, a, L, V = point
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_hidden_layers=L,
                                  vocab_size=V, max_position_embeddings=32, attn_implementation=attention, **extra)
    model = transformers.BertForMaskedLM(cfg)
    model.train()
    return cfg, model


def graph_of(cfg, padded=False):
    return sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation,
                                     "padded": padded})


def mlm_batch(b, s, V, padded):
    """Token ids, token types (two segments), the attention mask (the last three tokens of the
    first sequence padding where ``padded``) and MLM labels: -100 but on every third token."""
    ids = torch.randint(0, V, (b, s))
    types = torch.zeros(b, s, dtype=torch.long)
    types[:, s // 2:] = 1
    mask = torch.ones(b, s, dtype=torch.long)
    if padded:
        mask[0, -3:] = 0
    labels = torch.full((b, s), -100, dtype=torch.long)
    labels[:, ::3] = ids[:, ::3]
    return ids, types, mask, labels


def assert_bert_step_exact(est, model, batch, precision, opt, b, s, impl="for-loop"):
    """``assert_hf_step_exact`` for a masked LM: the model called with token types, the
    attention mask and MLM labels (bfloat16 autocast for ``bf16-mixed``): the bytes saved for
    backward, then the whole training step (:func:`helpers.assert_step_exact`)."""
    ids, types, mask, labels = batch

    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model(ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
    assert est.at(b=b, s=s).bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, impl, model.parameters()), extra=batch)
    assert_step_exact(est, report, b, s)


CASES = [
    # point, attention, precision, optimizer, padded
    (POINTS[0], "eager", "fp32", "adamw", False),
    (POINTS[0], "sdpa", "fp32", "adamw", False),
    (POINTS[0], "eager", "bf16-mixed", "adamw", False),
    (POINTS[0], "sdpa", "bf16-mixed", "sgd", False),
    (POINTS[0], "sdpa", "bf16", "adamw", False),
    (POINTS[1], "sdpa", "bf16-mixed", "adamw", False),
    (POINTS[2], "eager", "fp32", "adamw", True),
    (POINTS[2], "eager", "bf16-mixed", "sgd", True),
    (POINTS[1], "eager", "bf16", "adamw", True),
    (POINTS[3], "sdpa", "bf16-mixed", "adamw", False),
    (POINTS[3], "eager", "fp32", "adamw", True),
    # SDPA with padding: sdpa_mask's boolean (b, 1, s, s) mask, converted to a float copy in each
    # layer (dropout on: the math kernel adds it to the scores and drops it)
    (POINTS[2], "sdpa", "fp32", "adamw", True),
    (POINTS[1], "sdpa", "bf16-mixed", "sgd", True),
    (POINTS[3], "sdpa", "bf16", "adamw", True),
]


@pytest.mark.parametrize("point,attention,precision,opt,padded", CASES,
                         ids=[f"h{p[2]}-f{p[3]}-{at}-{pr}-{o}{'-padded' if pad else ''}"
                              for p, at, pr, o, pad in CASES])
def test_bert_exact(point, attention, precision, opt, padded):
    """Parameters and buffers (position_ids and token_type_ids, int64, 32 entries each: 512
    bytes), saved bytes, the peak, its phase and every phase's maximum."""
    b, s, h, f, a, L, V = point
    cfg, model = hf_bert(point, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg, padded), sm.Policy(precision, opt, "cpu", "for-loop"))
    if b == 1:
        est = est.at_one
    ev = est.at(b=b, s=s)
    buffers = sum(t.untyped_storage().nbytes() for t in model.buffers())
    assert buffers == 2 * 32 * 8
    assert (ev.bytes["params"], ev.bytes["buffers"]) == (param_bytes(model), buffers)
    assert_bert_step_exact(est, model, mlm_batch(b, s, V, padded), precision, opt, b, s)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_padding_mask_moment_exact(precision):
    """The moment transformers makes the additive mask (``torch.where``): the boolean copy of
    attention_mask (3*12 = 36 bytes), the boolean (3, 1, 12, 12) mask (432), the zero and the
    minimum as 0-dim tensors (2 * 4 or 2 * 2) beside the (3, 1, 12, 12) output (432 * 4 or
    432 * 2), to the byte."""
    point = POINTS[2]
    b, s, h, f, a, L, V = point
    cfg, model = hf_bert(point, "eager")
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg, True), sm.Policy(precision, "sgd", "cpu", "for-loop"))
    subs = est._subs({"b": b, "s": s})
    predicted = [int(p.total.xreplace(subs)) for p in est.timeline
                 if p.where == "forward attention_mask_4d"]
    batch = mlm_batch(b, s, V, True)
    ids, types, mask, labels = batch
    report = training_step(model, lambda m: m(ids, attention_mask=mask, token_type_ids=types, labels=labels).loss,
                           optimizer("sgd", "for-loop", model.parameters()), extra=batch)
    measured = [x.live_bytes for x in report.timeline if x.phase == "forward" and x.op == "aten.where.self"]
    assert predicted == measured and len(measured) == 1


RECOMPUTED = [
    ("eager", "fp32", False),
    ("sdpa", "bf16-mixed", False),
    ("eager", "bf16", True),
]


@pytest.mark.parametrize("attention,precision,padded", RECOMPUTED,
                         ids=[f"{at}-{pr}{'-padded' if pad else ''}" for at, pr, pad in RECOMPUTED])
def test_bert_recomputed_exact(attention, precision, padded):
    """Hugging Face's gradient checkpointing (``gradient_checkpointing_enable()``, non-reentrant)
    against ``--recompute full``: each layer's checkpoint keeps its input; the mask is an argument
    that needs no gradient."""
    import warnings
    point = POINTS[1]
    b, s, h, f, a, L, V = point
    cfg, model = hf_bert(point, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # an alias in transformers 5
        enable_checkpointing(model)
    est = sm.estimate(graph_of(cfg, padded), sm.Policy(precision, "adamw", "cpu", "for-loop", recompute="full"))
    assert_bert_step_exact(est, model, mlm_batch(b, s, V, padded), precision, "adamw", b, s)


def test_attention_probabilities_are_not_cast():
    """BERT's eager attention does not cast its probabilities to the value's dtype (GPT-2's and
    Llama's do): on CUDA under autocast the float32 softmax is dropped out in float32 and the
    context matmul saves its bfloat16 copy. The prepared graph has no ``probs`` node."""
    g = sm.models.from_hf_config({"model_type": "bert", "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100})
    est = sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda", attention="eager"))
    listing = str(est.prepared)
    assert "layer/attention/self/softmax" in listing and "layer/attention/self/probs" not in listing


# ----------------------------------------------------------------------------- presets

#: parameters of BertForMaskedLM (sum of numel over model.parameters(): the decoder's weight is
#: the word embeddings, its bias cls.predictions.bias, each counted once)
PUBLISHED = {"bert-base": 109_514_298, "bert-large": 335_174_458}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    """bert-base: BertModel has 109,482,240 parameters; BertForMaskedLM has no pooler
    (-(768^2 + 768) = -590,592) and adds the head's transform (768^2 + 768 + 2*768 = 592,128)
    and the decoder's bias (30,522): 109,482,240 - 590,592 + 592,128 + 30,522 = 109,514,298."""
    est = sm.estimate(name, sm.Policy("fp32", "sgd"))
    assert est.at(b=1, s=128).bytes["params"] == 4 * PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_match_transformers(name):
    """The preset's config built by transformers on the meta device: BertModel's count for
    bert-base as published, and BertForMaskedLM's as pinned above."""
    cfg = sm.models.PRESETS[name]
    hf = transformers.BertConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                 num_hidden_layers=cfg.num_hidden_layers,
                                 num_attention_heads=cfg.num_attention_heads, vocab_size=cfg.vocab_size)
    with torch.device("meta"):
        mlm = transformers.BertForMaskedLM(hf)
        base = transformers.BertModel(hf)
    assert sum(p.numel() for p in mlm.parameters()) == PUBLISHED[name]
    if name == "bert-base":
        assert sum(p.numel() for p in base.parameters()) == 109_482_240


def test_hugging_face_ids_offline():
    assert sm.models.preset("google-bert/bert-base-uncased").name == "bert-base"
    assert sm.models.preset("GOOGLE-BERT/BERT-LARGE-UNCASED").name == "bert-large"


def test_config_json_and_symbols(tmp_path):
    """bert-base-uncased's config.json as Google ships it: f and s_max stay symbols, and the
    parameter formula is the architecture's."""
    import json
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1, "gradient_checkpointing": False,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02,
        "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
        "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0, "position_embedding_type": "absolute",
        "transformers_version": "4.6.0.dev0", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522}))
    est = sm.estimate(sm.models.from_hf_config(path), sm.Policy("bf16-mixed", "adamw"))
    assert {sm.symbols.f, sm.symbols.L, sm.symbols.s_max} <= est.components["params"].free_symbols
    assert est.at(b=1, s=128).bytes["params"] == 4 * PUBLISHED["bert-base"]
    B_w, V, h, f, L, s_max = (sm.symbols.B_w, sm.symbols.V, sm.symbols.h, sm.symbols.f, sm.symbols.L,
                              sm.symbols.s_max)
    # embeddings: words V*h, positions s_max*h, 2 token types 2h, LayerNorm 2h; per layer q, k, v
    # and the output dense 4(h^2 + h), two LayerNorms 4h, the feed-forward 2fh + f + h; the head's
    # transform h^2 + h + 2h and the decoder's bias V (its weight is the word embeddings)
    expected = B_w * (V * h + s_max * h + 4 * h + L * (4 * h**2 + 9 * h + 2 * f * h + f) + h**2 + 3 * h + V)
    assert sp.expand(est.components["params"] - expected) == 0


BASE = {"model_type": "bert", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100}


@pytest.mark.parametrize("changes,words", [
    ({"hidden_size": 30}, "hidden_size = 30 is not valid: expected a multiple of the number of attention heads (4)"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0 is not valid: expected a positive integer"),
    ({"hidden_act": "swish"}, "unknown hidden_act 'swish'"),
    ({"hidden_dropout_prob": 1.0}, "hidden_dropout_prob = 1.0 is not valid: expected a dropout probability"),
    ({"position_embedding_type": "relative_key"}, 'position_embedding_type = \'relative_key\' is not valid: '
                                                   'expected "absolute"'),
    ({"is_decoder": True}, "is_decoder = True is not valid: expected false"),
    ({"add_cross_attention": True}, "add_cross_attention = True is not valid"),
    ({"chunk_size_feed_forward": 4}, "chunk_size_feed_forward = 4 is not valid"),
    ({"padded": "yes"}, "padded = 'yes' is not valid: expected true or false"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings = False is not valid: expected true, the only value"),
])
def test_bad_bert_config_is_refused(changes, words):
    with pytest.raises((ConfigError, UnknownName)) as e:
        sm.models.from_hf_config({**BASE, **changes})
    assert words in str(e.value)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_padded_sdpa_without_dropout_exact(precision):
    """Without attention dropout SDPA runs its CPU flash kernel, which keeps the float copy of
    the mask (b*s^2 elements per layer, in the query's dtype) for backward."""
    point = POINTS[2]
    b, s, h, f, a, L, V = point
    cfg, model = hf_bert(point, "sdpa", attention_probs_dropout_prob=0.0)
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg, True), sm.Policy(precision, "sgd", "cpu", "for-loop"))
    assert est.kernels == ("flash",)
    assert_bert_step_exact(est, model, mlm_batch(b, s, V, True), precision, "sgd", b, s)


def test_padded_batches_with_sdpa_on_cuda():
    """Derived, not measured: on CUDA SDPA's flash kernel takes no mask, so a padded batch runs
    the mem-efficient kernel, which keeps the float mask padded to 16 columns: at b = 2, s = 16
    (aligned), bf16 autocast, it keeps 2 * 16 * 16 * 2 = 1,024 bytes per layer beside what the
    unpadded run keeps, and its log-sum-exp has 32 rows (flash's 16: + 2 * 4 * 16 * 4 = 512),
    less flash's 24-byte RNG state. flash_attention_2 (which unpads the batch) is refused."""
    g = sm.models.from_hf_config({**BASE, "padded": True})
    dense = sm.models.from_hf_config({**BASE, "padded": False})
    padded = sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda", attention="sdpa"))
    assert padded.kernels == ("mem-efficient",)
    plain = sm.estimate(dense, sm.Policy("bf16-mixed", "adamw", "cuda", attention="sdpa"))
    n_layers = BASE["num_hidden_layers"]
    heads = BASE["num_attention_heads"]
    assert (padded.at(b=2, s=16).bytes["activations"] - plain.at(b=2, s=16).bytes["activations"]
            == n_layers * (2 * 16 * 16 * 2 + 2 * heads * 16 * 4 - 24))
    with pytest.raises(ConfigError) as e:
        sm.estimate(g, sm.Policy("bf16-mixed", "adamw", "cuda", attention="flash"))
    assert "flash_attention_2 unpads the batch" in str(e.value) and "--attention sdpa or eager" in str(e.value)


@pytest.mark.parametrize("attention,precision", [("eager", "fp32"), ("sdpa", "bf16-mixed")])
def test_without_token_type_ids(attention, precision):
    """BERT called without token_type_ids (symmem's token_types: false): BertEmbeddings gathers
    its zeros buffer at the positions, a (1, s) int64 tensor, expanded over the batch, which
    the token-type embedding saves; the batch has no (b, s) int64 types. Saved bytes and the
    step exact; against the same model called with them, the saved bytes are (b - 1) s * 8 =
    128 lower (b = 2, s = 16: the (2, 16) types saved there, the (1, 16) gather here)."""
    point = POINTS[0]
    b, s, h, f, a, L, V = point
    cfg, model = hf_bert(point, attention)
    est = sm.estimate(sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation,
                                                "token_types": False}),
                      sm.Policy(precision, "adamw", "cpu", "for-loop"))
    ids, _, mask, labels = mlm_batch(b, s, V, False)

    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model(ids, attention_mask=mask, labels=labels).loss
    saved = saved_bytes(fwd, exclude=model).total
    assert est.at(b=b, s=s).bytes["activations"] == saved
    with_types = sm.estimate(graph_of(cfg), sm.Policy(precision, "adamw", "cpu", "for-loop"))
    assert with_types.at(b=b, s=s).bytes["activations"] - saved == (b - 1) * s * 8
    report = training_step(model, lambda m: fwd(), optimizer("adamw", "for-loop", model.parameters()),
                           extra=(ids, mask, labels))
    assert_step_exact(est, report, b, s)
