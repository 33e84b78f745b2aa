"""GPT-2 (and GPT-3's dense architecture) as Hugging Face's ``GPT2LMHeadModel`` runs it:
the GPT-2 family of the model registry. Its attention core is one ``attention`` node that
the policy's kernel (eager, SDPA, flash, ...) replaces when the step is estimated.

Every dimension stays a symbol (``b, s, h, a, L, V, s_max`` and ``f`` when the config
sets ``n_inner``); the config's numbers travel beside the graph as bindings.

What a ``config.json`` key does here (checked against transformers 5's
``configuration_gpt2.py`` and ``modeling_gpt2.py``, and measured on the CPU with
``symmem.measure``; ``tests/test_models.py`` holds the checks):

* modelled: the fields of :class:`GPT2Config` (sizes, ``n_inner``, the activation,
  the three dropout probabilities, ``tie_word_embeddings``, ``attn_implementation``:
  the kernel ``--attention auto`` takes; and symmem's own ``shared_qkv``), also under
  Hugging Face's generic names
  (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``max_position_embeddings``, ``_attn_implementation``);
* refused unless at the default (:data:`UNMODELLED`): ``reorder_and_upcast_attn``
  (float32 copies of Q, K and the scores), ``add_cross_attention`` (a second attention
  per layer: 4h^2 + 6h parameters), ``gradient_checkpointing`` (recomputation);
* ignored (:data:`IGNORED`, each with its reason): among others ``scale_attn_weights``
  and ``scale_attn_by_inverse_layer_idx`` (transformers 5 folds both into the one
  scalar eager attention always multiplies by), ``layer_norm_epsilon``, ``use_cache``
  (a training step keeps only the loss) and the ``summary_*`` keys of the
  double-heads model.

The presets are OpenAI's four GPT-2 checkpoints, DistilGPT2 and GPT-3 175B's shape.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph
from ..policy.attention import HF_NAMES
from ..symbols import L, V, a, b, f, h, s, s_max
from . import checks
from .heads import causal_lm_loss
from .registry import BOOKKEEPING, TRAINING_STEP, Family, Unmodelled, register

__all__ = ["GPT2Config", "build_gpt2", "ACTIVATIONS", "PRESETS", "HF_IDS", "ALIASES", "REQUIRED",
           "UNMODELLED", "IGNORED", "FAMILY", "SYMMEM_FIELDS"]

#: Fields symmem adds to transformers' GPT2Config (a config.json may set them too).
SYMMEM_FIELDS = ("shared_qkv",)

#: Hugging Face activation names -> the op symmem models them with.
ACTIVATIONS = {"gelu_new": "gelu_new", "gelu": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}


@dataclass(frozen=True)
class GPT2Config:
    """The fields of Hugging Face's GPT2Config that decide memory, with its defaults.

    ``n_inner`` None means ``4 * n_embd`` (Hugging Face's rule); ``name`` names the graph.
    ``shared_qkv`` (symmem's, not transformers'): one n_embd x n_embd projection whose output
    is the query, the key and the value at once (the seed's shared QKV projection)."""
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    vocab_size: int = 50257
    n_positions: int = 1024
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    tie_word_embeddings: bool = True
    attn_implementation: str | None = None
    shared_qkv: bool = False
    name: str = "gpt2"

    def __post_init__(self):
        checks.positive_ints(self, "n_embd", "n_layer", "n_head", "vocab_size", "n_positions", optional=("n_inner",))
        checks.heads_divide("n_embd", self.n_embd, self.n_head,
                            "Change n_embd or n_head so that n_embd / n_head is an integer.", heads_key="n_head")
        checks.known("activation_function", self.activation_function, ACTIVATIONS)
        checks.probabilities(self, "resid_pdrop", "embd_pdrop", "attn_pdrop")
        checks.booleans(self, "tie_word_embeddings", "shared_qkv")
        checks.attn_implementation(self)

    def bindings(self) -> dict:
        out = {h: self.n_embd, L: self.n_layer, a: self.n_head, V: self.vocab_size,
               s_max: self.n_positions}
        if self.n_inner is not None:
            out[f] = self.n_inner
        return out


def build_gpt2(cfg: GPT2Config) -> Graph:
    """The operator graph of one GPT-2 training forward, loss included."""
    g = Graph(cfg.name, cfg.bindings())
    if cfg.attn_implementation is not None:
        g.attention = HF_NAMES[cfg.attn_implementation]
    ffn = f if cfg.n_inner is not None else 4 * h
    act = ACTIVATIONS[cfg.activation_function]
    g.require(s, s_max, "the sequence length cannot exceed n_positions, the rows of the position embedding")
    g.require(a, h, "the attention heads split the hidden size evenly", kind="divides")
    ids = g.input("input_ids", (b, s))
    wte = g.param("wte.weight", (V, h))
    wpe = g.param("wpe.weight", (s_max, h))
    tok = g.add("embedding", ids, params=(wte,), name="wte")
    positions = g.add("positions", ids, name="position_ids")
    pos = g.add("position_embedding", positions, params=(wpe,), name="wpe")
    x = g.add("add", tok, pos, name="embed")
    mask = g.add("causal_mask", ids, name="causal_mask")
    x = g.add("dropout", x, p=cfg.embd_pdrop, name="drop")

    def block(g: Graph, x: str) -> str:
        def ln(name, y):
            w_, b_ = g.param(f"{name}.weight", (h,)), g.param(f"{name}.bias", (h,))
            return g.add("layer_norm", y, params=(w_, b_), name=f"h/{name}")

        def conv1d(name, y, n_in, n_out):
            w_, b_ = g.param(f"{name}.weight", (n_in, n_out)), g.param(f"{name}.bias", (n_out,))
            return g.add("linear", y, params=(w_, b_), conv1d=True, name=f"h/{name}")

        y = ln("ln_1", x)
        if cfg.shared_qkv:          # one projection, its heads view the query, key and value
            qkv = conv1d("attn.c_attn", y, h, h)
            q = k = v = g.add("heads", qkv, heads=a, name="h/attn/qkv_heads")
        else:
            qkv = conv1d("attn.c_attn", y, h, 3 * h)
            q, k, v = (g.add("heads", g.add("split", qkv, parts=3, index=i, name=f"h/attn/{n}"),
                             heads=a, name=f"h/attn/{n}_heads") for i, n in enumerate("qkv"))
        # the attention core, as the policy's kernel computes it (symmem.passes.attention);
        # eager multiplies by `scaling` whatever scale_attn_weights says (1.0 when it is
        # false): the same tensors either way. GPT2Block keeps the returned attention
        # weights (eager's probabilities) until it returns. What selective recomputation redoes.
        with g.scope(recompute="attention"):
            z = g.add("attention", q, k, v, mask, dropout=cfg.attn_pdrop, causal=True,
                      weights_until="h/mlp/residual", name="h/attn/context")
        z = g.add("merge_heads", z, name="h/attn/merge")
        z = conv1d("attn.c_proj", z, h, h)
        z = g.add("dropout", z, p=cfg.resid_pdrop, name="h/attn/resid_dropout")
        x = g.add("add", z, x, name="h/attn/residual")
        y = ln("ln_2", x)
        y = conv1d("mlp.c_fc", y, h, ffn)
        y = g.add(act, y, name=f"h/mlp/{act}")
        y = conv1d("mlp.c_proj", y, ffn, h)
        y = g.add("dropout", y, p=cfg.resid_pdrop, name="h/mlp/dropout")
        out = g.add("add", y, x, name="h/mlp/residual")
        # GPT2Block's and GPT2Attention's locals, alive until they return: the query, key and
        # value views of c_attn's output; the attention weights (returned, then kept in `_`);
        # the layer norms' outputs (until `hidden_states` is reassigned); `attn_output`
        g.hold(qkv, until="h/attn/resid_dropout")
        g.hold("h/ln_1", until="h/attn/residual")
        g.hold("h/attn/resid_dropout", until=out)
        g.hold("h/ln_2", until=out)
        return out

    x = g.repeat(L, block, x, name="h")
    # The final hidden states stay referenced by the model's output until forward ends.
    x = g.output(g.add("layer_norm", x, params=(g.param("ln_f.weight", (h,)), g.param("ln_f.bias", (h,))),
                       name="ln_f"))
    head = wte if cfg.tie_word_embeddings else g.param("lm_head.weight", (V, h))
    logits = g.output(g.add("linear", x, params=(head,), name="lm_head"))
    # transformers' ForCausalLMLoss (symmem.models.heads)
    causal_lm_loss(g, logits, ids)
    # GPT2Model's locals, alive until it returns (after ln_f)
    for value in (positions, tok, pos, mask):
        g.hold(value, until="ln_f")
    return g


#: Published configurations. GPT-2: Radford et al. 2019 and the Hugging Face checkpoints;
#: DistilGPT2: Sanh et al. 2019 (6 layers); GPT-3 175B: Brown et al. 2020, Table 2.1 (n_ctx 2048).
PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(name="gpt2"),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16, name="gpt2-medium"),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20, name="gpt2-large"),
    "gpt2-xl": GPT2Config(n_embd=1600, n_layer=48, n_head=25, name="gpt2-xl"),
    "distilgpt2": GPT2Config(n_layer=6, name="distilgpt2"),
    "gpt3-175b": GPT2Config(n_embd=12288, n_layer=96, n_head=96, n_positions=2048, name="gpt3-175b"),
}

#: Hugging Face repositories of the presets (GPT-3's weights were never published).
HF_IDS = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
          "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl",
          "distilgpt2": "distilbert/distilgpt2"}

#: Hugging Face's GPT2Config.attribute_map: the generic names map onto GPT-2's own.
ALIASES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
           "num_attention_heads": "n_head", "max_position_embeddings": "n_positions",
           "_attn_implementation": "attn_implementation"}

#: The sizes a config.json must give; every other field takes transformers' default.
REQUIRED = ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")

#: Keys that change memory in GPT2LMHeadModel and that symmem models at one setting only.
UNMODELLED = (
    Unmodelled("reorder_and_upcast_attn", (False,),
               "the reordered attention runs baddbmm and softmax in float32 and saves float32 "
               "copies of Q, K and the scores"),
    Unmodelled("add_cross_attention", (False,),
               "cross-attention adds a second attention and layer norm to every layer: "
               "4*h^2 + 6*h parameters more per layer"),
    Unmodelled("gradient_checkpointing", (False,),
               "transformers then recomputes every block in backward; symmem models no "
               "recomputation yet"),
)

_DOUBLE_HEADS = "read only by GPT2DoubleHeadsModel's multiple-choice head; symmem models GPT2LMHeadModel"
_CLASSIFIER = "read only by the classification heads; symmem models GPT2LMHeadModel"

#: Keys read and deliberately ignored: none changes a tensor of a GPT2LMHeadModel training
#: step (the scale and use_cache decisions are measured in tests/test_models.py).
IGNORED = {
    **BOOKKEEPING,
    **TRAINING_STEP,
    "scale_attn_weights": "eager attention multiplies the scores by `scaling` either way (1.0 "
                          "when false): the same tensors",
    "scale_attn_by_inverse_layer_idx": "folded into the same `scaling` scalar: the same tensors",
    "layer_norm_epsilon": "a number inside layer norm, not a tensor",
    "initializer_range": "initialisation only",
    "chunk_size_feed_forward": "GPT-2 never chunks its feed-forward",
    "is_encoder_decoder": "GPT-2 is a decoder; read only by generation",
    "n_ctx": "an old name of n_positions that transformers no longer reads",
    "n_special": "an old key transformers no longer reads",
    "predict_special_tokens": "an old key transformers no longer reads",
    **{k: _DOUBLE_HEADS for k in ("summary_type", "summary_use_proj", "summary_activation",
                                  "summary_proj_to_labels", "summary_first_dropout",
                                  "summary_last_dropout")},
    **{k: _CLASSIFIER for k in ("problem_type", "num_labels", "classifier_dropout", "hidden_dropout")},
}

FAMILY = register(Family(
    name="gpt2",
    description="GPT-2 and GPT-3's dense architecture, as Hugging Face's GPT2LMHeadModel runs "
                "them (eager attention, Conv1D projections, learned positions, tied head)",
    config=GPT2Config,
    build=build_gpt2,
    model_types=("gpt2",),
    aliases=ALIASES,
    required=REQUIRED,
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
