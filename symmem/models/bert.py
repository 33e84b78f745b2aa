"""BERT as Hugging Face's ``BertForMaskedLM`` runs it: the bert family of the model registry.

Why ``BertForMaskedLM``: it is the model a user trains BERT as today (the ``architectures`` of
google-bert/bert-base-uncased's config.json, ``AutoModelForMaskedLM`` of transformers'
``run_mlm.py``), masked-language-model pre-training or domain adaptation. ``BertForPreTraining``
adds the pooler (h^2 + h) and the next-sentence head (2h + 2) and needs sentence-pair labels,
which later recipes (RoBERTa) dropped; symmem does not model it.

The model (transformers 5.24's ``modeling_bert.py``):

* ``BertEmbeddings``: word, token-type and learned position embeddings summed, LayerNorm,
  dropout (``hidden_dropout_prob``); the position ids are a slice of the module's
  ``position_ids`` buffer; called without token types (symmem's ``token_types: false``) it
  gathers its ``token_type_ids`` buffer at them, (1, s) expanded over the batch; two int64 buffers (``position_ids``, ``token_type_ids``) of
  ``max_position_embeddings`` entries each;
* the attention mask: ``create_bidirectional_mask`` (:func:`~symmem.rules.encoders.padding_mask_rule`);
  without padding (symmem's ``padded: false``, the default: texts packed into full
  sequences, as ``run_mlm.py`` groups them) it is skipped; with padding
  (``padded: true``) eager attention gets the additive (b, 1, s, s) mask, SDPA the boolean
  one, which it converts to a float copy in each layer (:func:`symmem.passes.attention._masked`;
  flash_attention_2, which unpads the batch, is refused);
* ``L`` layers: q, k, v projections with biases, non-causal attention (one ``attention``
  node the policy's kernel replaces; eager runs ``softmax(q k^T * scale + mask)`` without a
  cast of the probabilities, dropout ``attention_probs_dropout_prob``), the output dense,
  dropout, ``LayerNorm(x + residual)`` (post-norm), the feed-forward (``intermediate_size``,
  ``hidden_act``), dense, dropout, ``LayerNorm(x + residual)``;
* the masked-LM head: dense h x h, the activation, LayerNorm, and the decoder tied to the word
  embeddings with its own bias of V (``tie_word_embeddings`` false is refused: transformers then
  keeps ``cls.predictions.bias`` as a parameter the forward never reads);
* the loss: ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))`` on MLM labels
  (-100 where a token is not masked): log_softmax over every position, nll_loss averaging
  over the masked ones; what it saves does not depend on how many are masked.

Every dimension stays a symbol: ``b, s, h, a, L, V, f, s_max``; the token-type vocabulary
(``type_vocab_size``, 2) is a number.

What a ``config.json`` key does here: modelled, the fields of :class:`BertConfig`; refused
unless at the default (:data:`UNMODELLED`): ``position_embedding_type`` other than absolute,
``is_decoder``, ``add_cross_attention``, ``chunk_size_feed_forward``,
``gradient_checkpointing``; ignored (:data:`IGNORED`), each with its reason.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..graph import Graph
from ..policy.attention import HF_NAMES
from ..symbols import L, V, a, b, f, h, s, s_max
from . import checks
from .registry import BOOKKEEPING, TRAINING_STEP, Family, Unmodelled, register

__all__ = ["BertConfig", "build_bert", "ACTIVATIONS", "PRESETS", "HF_IDS", "ALIASES", "REQUIRED", "UNMODELLED",
           "IGNORED", "FAMILY", "SYMMEM_FIELDS"]

#: Fields symmem adds to transformers' BertConfig (a config.json may set them too).
SYMMEM_FIELDS = ("padded", "token_types")

#: Hugging Face activation names -> the op symmem models them with.
ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu_new", "relu": "relu"}


@dataclass(frozen=True)
class BertConfig:
    """The fields of Hugging Face's BertConfig that decide memory, with its defaults
    (bert-base-uncased's shape). ``padded`` (symmem's, not transformers'): the batches carry
    padding (some ``attention_mask`` entry is 0), so transformers materialises a
    (b, 1, s, s) mask (additive for eager, boolean for SDPA); false: full sequences, no mask.
    ``token_types`` (symmem's too): the batches carry ``token_type_ids`` (a tokenizer's output,
    the default); false: the model is called without them and ``BertEmbeddings`` gathers its
    zeros buffer at the positions, a (1, s) int64 tensor the embedding saves, expanded over the
    batch (no (b, s) int64 input)."""
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    tie_word_embeddings: bool = True
    attn_implementation: str | None = None
    padded: bool = False
    token_types: bool = True
    name: str = "bert"

    def __post_init__(self):
        checks.positive_ints(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                             "intermediate_size", "max_position_embeddings", "type_vocab_size")
        checks.heads_divide("hidden_size", self.hidden_size, self.num_attention_heads,
                            "Change hidden_size or num_attention_heads so that hidden_size / num_attention_heads "
                            "is an integer; transformers refuses it too (BertSelfAttention).")
        checks.known("hidden_act", self.hidden_act, ACTIVATIONS)
        checks.probabilities(self, "hidden_dropout_prob", "attention_probs_dropout_prob")
        checks.booleans(self, "tie_word_embeddings", "padded", "token_types")
        checks.attn_implementation(self)
        if not self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings", False, "true, the only value symmem models (untied, "
                              "transformers gives the decoder its own weight and bias and keeps "
                              "cls.predictions.bias as a parameter the forward never reads: no gradient, no "
                              "optimizer state)", "Remove the key or set it to true.")

    def bindings(self) -> dict:
        return {h: self.hidden_size, L: self.num_hidden_layers, a: self.num_attention_heads, V: self.vocab_size,
                f: self.intermediate_size, s_max: self.max_position_embeddings}


def build_bert(cfg: BertConfig) -> Graph:
    """The operator graph of one BertForMaskedLM training forward, the MLM loss included."""
    g = Graph(cfg.name, cfg.bindings())
    if cfg.attn_implementation is not None:
        g.attention = HF_NAMES[cfg.attn_implementation]
    act = ACTIVATIONS[cfg.hidden_act]
    n_t = cfg.type_vocab_size
    g.require(s, s_max, "the sequence length cannot exceed max_position_embeddings, the rows of the position "
                        "embedding")
    g.require(a, h, "the attention heads split the hidden size evenly", kind="divides")
    # the batch: token ids, token types, the attention mask and the MLM labels (b, s) each
    ids = g.input("input_ids", (b, s))
    types = g.input("token_type_ids", (b, s)) if cfg.token_types else None
    mask_2d = g.input("attention_mask", (b, s))
    labels = g.input("labels", (b, s))
    # BertEmbeddings' buffers: position_ids (arange) and token_type_ids (zeros), int64
    pos_buffer = g.buffer("embeddings.position_ids", (1, s_max), dtype="int64")
    type_buffer = g.buffer("embeddings.token_type_ids", (1, s_max), dtype="int64")
    if types is None:   # called without them: the buffer gathered at the positions, expanded over the batch
        types = g.add("mask_expand", g.add("buffer_slice", type_buffer, ids, gather=True, name="embeddings/token_types"),
                      ids, name="embeddings/token_types_expanded")
    word = g.param("embeddings.word_embeddings.weight", (V, h))
    positions = g.add("buffer_slice", pos_buffer, ids, name="embeddings/position_ids")
    x_word = g.add("embedding", ids, params=(word,), name="embeddings/word")
    x_type = g.add("embedding", types, params=(g.param("embeddings.token_type_embeddings.weight", (n_t, h)),),
                   name="embeddings/token_type")
    x = g.add("add", x_word, x_type, name="embeddings/sum")
    x_pos = g.add("position_embedding", positions,
                  params=(g.param("embeddings.position_embeddings.weight", (s_max, h)),), name="embeddings/position")
    x = g.add("add", x, x_pos, name="embeddings/sum_positions")

    def layer_norm(g, name, y):
        return g.add("layer_norm", y, params=(g.param(f"{name}.weight", (h,)), g.param(f"{name}.bias", (h,))),
                     name=name.replace(".", "/"))

    def linear(g, name, y, n_in, n_out):
        return g.add("linear", y, params=(g.param(f"{name}.weight", (n_out, n_in)), g.param(f"{name}.bias", (n_out,))),
                     name=name.replace(".", "/"))

    x = layer_norm(g, "embeddings.LayerNorm", x)
    x = g.add("dropout", x, p=cfg.hidden_dropout_prob, name="embeddings/dropout")
    # BertEmbeddings' locals until it returns
    for value in (x_word, x_type, x_pos):
        g.hold(value, until=x)
    embedded = x
    mask = g.add("padding_mask", mask_2d, x, padded=cfg.padded, name="attention_mask_4d")

    def block(g: Graph, x: str) -> str:
        y_q, y_k, y_v = (linear(g, f"layer.attention.self.{n}", x, h, h) for n in ("query", "key", "value"))
        q, k, v = (g.add("heads", y, heads=a, name=f"layer/attention/self/{n}_heads")
                   for y, n in zip((y_q, y_k, y_v), "qkv"))
        # the attention core, as the policy's kernel computes it (symmem.passes.attention):
        # eager runs softmax(q k^T * scaling + mask) in the scores' dtype with no cast after it,
        # then dropout; it returns the probabilities, which BertLayer keeps in `_` until it returns
        with g.scope(recompute="attention"):
            z = g.add("attention", q, k, v, *((mask,) if cfg.padded else ()), dropout=cfg.attention_probs_dropout_prob,
                      causal=False, probs_like="keep", padded=cfg.padded,
                      weights_until="layer/output/LayerNorm", name="layer/attention/self/context")
        # eager's attn_output.transpose(1, 2).contiguous(); the reshape after it is a view
        z = g.add("merge_heads", z, name="layer/attention/self/merge")
        z = linear(g, "layer.attention.output.dense", z, h, h)
        z = g.add("dropout", z, p=cfg.hidden_dropout_prob, name="layer/attention/output/dropout")
        z = g.add("add", z, x, name="layer/attention/output/residual")
        attended = layer_norm(g, "layer.attention.output.LayerNorm", z)
        y = linear(g, "layer.intermediate.dense", attended, h, f)
        y = g.add(act, y, name=f"layer/intermediate/{act}")
        y = linear(g, "layer.output.dense", y, f, h)
        y = g.add("dropout", y, p=cfg.hidden_dropout_prob, name="layer/output/dropout")
        y = g.add("add", y, attended, name="layer/output/residual")
        out = layer_norm(g, "layer.output.LayerNorm", y)
        # BertSelfAttention's query, key and value views until it returns (after the merge);
        # BertLayer's attention_output until it returns
        for value in (q, k, v):
            g.hold(value, until="layer/attention/self/merge")
        g.hold(attended, until=out)
        return out

    x = g.repeat(L, block, x, name="layer")
    # BertModel's last_hidden_state, which BertForMaskedLM's `outputs` holds until it returns
    # (the same tensor: a name the hold below can refer to)
    x = g.add("carry", x, name="sequence_output")
    # BertModel's locals until it returns (after the encoder): the embeddings' output, the mask
    for value in (embedded, mask):
        g.hold(value, until="layer")
    # the MLM head (BertOnlyMLMHead): transform (dense, activation, LayerNorm), then the decoder
    # tied to the word embeddings, with its bias (cls.predictions.bias)
    y = linear(g, "cls.predictions.transform.dense", x, h, h)
    y = g.add(act, y, name=f"cls/predictions/transform/{act}")
    y = layer_norm(g, "cls.predictions.transform.LayerNorm", y)
    logits = g.output(g.add("linear", y, params=(word, g.param("cls.predictions.bias", (V,))),
                            name="cls/predictions/decoder"))
    # CrossEntropyLoss()(logits.view(-1, V), labels.view(-1)): F.cross_entropy is log_softmax and
    # nll_loss (ignore_index -100); the labels are the target as given (no shift)
    z = g.add("cross_entropy_cast", logits, name="loss/autocast")
    logp = g.add("log_softmax", z, name="loss/log_softmax")
    g.add("nll_loss", logp, labels, shifted=True, name="loss")
    # autocast's float32 copy is an argument of aten's cross_entropy_loss until it returns
    g.hold(z, until="loss")
    g.hold(x, until="loss")
    return g


def _bert(name, h_, L_, a_, f_, V_=30522):
    return BertConfig(hidden_size=h_, num_hidden_layers=L_, num_attention_heads=a_, intermediate_size=f_,
                      vocab_size=V_, name=name)


#: Google's checkpoints (Devlin et al. 2019) as their config.json files give them.
PRESETS: dict[str, BertConfig] = {
    "bert-base": _bert("bert-base", 768, 12, 12, 3072),
    "bert-large": _bert("bert-large", 1024, 24, 16, 4096),
}

HF_IDS = {"bert-base": "google-bert/bert-base-uncased", "bert-large": "google-bert/bert-large-uncased"}

#: transformers' generic name of the attention implementation.
ALIASES = {"_attn_implementation": "attn_implementation"}

#: The sizes a config.json must give; every other field takes transformers' default.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")

UNMODELLED = (
    Unmodelled("position_embedding_type", ("absolute",),
               "relative_key and relative_key_query add a (2 * max_position_embeddings - 1) x head_dim "
               "distance embedding and b*a*s^2 position scores per layer"),
    Unmodelled("is_decoder", (False,),
               "a decoder BERT (BertLMHeadModel) runs causal attention with a KV cache"),
    Unmodelled("add_cross_attention", (False,),
               "cross-attention adds a second attention, its output dense and LayerNorm to every layer: "
               "4*h^2 + 6*h parameters more per layer"),
    Unmodelled("chunk_size_feed_forward", (0,),
               "transformers then runs the feed-forward on chunks of the sequence"),
    Unmodelled("gradient_checkpointing", (False,),
               "transformers then recomputes every layer in backward: use --recompute full"),
)

_CLASSIFIER = "read only by the classification heads; symmem models BertForMaskedLM"

IGNORED = {
    **BOOKKEEPING,
    **TRAINING_STEP,
    "layer_norm_eps": "a number inside layer norm, not a tensor",
    "initializer_range": "initialisation only",
    "is_encoder_decoder": "read only by generation",
    **{k: _CLASSIFIER for k in ("classifier_dropout", "num_labels", "problem_type")},
}

FAMILY = register(Family(
    name="bert",
    description="BERT as Hugging Face's BertForMaskedLM runs it (post-norm encoder, token types, learned "
                "positions, masked-LM head tied to the embeddings)",
    config=BertConfig,
    build=build_bert,
    model_types=("bert",),
    aliases=ALIASES,
    required=REQUIRED,
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
