"""Llama 1, 2 and 3 as Hugging Face's ``LlamaForCausalLM`` runs them: the llama family of the
model registry.

A decoder layer (``LlamaDecoderLayer``, transformers 5's ``modeling_llama.py``): RMSNorm (its
float32 upcast, :func:`~symmem.rules.normalization.rms_norm_rule`), separate q, k and v
projections (``num_key_value_heads`` k of them for k and v: grouped-query attention, k < a;
multi-query, k = 1), rotary position embeddings on q and k (the cos and sin tables made once
per forward, :func:`~symmem.rules.embeddings.rotary_rule`, applied by
:func:`~symmem.rules.embeddings.rope_rule`), the attention core (one ``attention`` node the
policy's kernel replaces; eager repeats k and v to a heads with ``repeat_kv``), ``o_proj``, a
residual add, RMSNorm, the SwiGLU MLP ``down(silu(gate(x)) * up(x))`` and a residual add.
The output head is untied by default (``tie_word_embeddings``).

Every dimension stays a symbol: ``b, s, h, a, L, V``, ``f`` (``intermediate_size``), ``k``
(``num_key_value_heads``) and, where a config sets a ``head_dim`` other than h/a, ``d_h``.

What a ``config.json`` key does here (checked against transformers 5.24's
``configuration_llama.py`` and ``modeling_llama.py``; ``tests/test_llama_measured.py``
measures the model):

* modelled: the fields of :class:`LlamaConfig`;
* refused unless at the default (:data:`UNMODELLED`): ``hidden_act`` other than silu;
* ignored (:data:`IGNORED`, each with its reason), among others ``rope_theta``,
  ``rope_scaling`` and ``rope_parameters`` (they change the numbers in the rotary tables,
  not their size), ``rms_norm_eps``, ``pretraining_tp`` (transformers 5 no longer splits
  the projections) and ``max_position_embeddings`` (rotary positions have no table).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..graph import Graph
from ..policy.attention import HF_NAMES
from ..symbols import L, V, a, b, d_h, f, h, k, s
from . import checks
from .heads import causal_lm_loss
from .registry import BOOKKEEPING, TRAINING_STEP, Family, Unmodelled, register

__all__ = ["LlamaConfig", "Decoder", "build_llama", "build_decoder", "check_decoder", "PRESETS", "HF_IDS",
           "REQUIRED", "UNMODELLED", "IGNORED", "FAMILY"]


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of Hugging Face's LlamaConfig that decide memory, with its defaults
    (Llama 2 7B's shape). ``num_key_value_heads`` None means ``num_attention_heads`` and
    ``head_dim`` None means ``hidden_size // num_attention_heads``, as transformers sets them."""
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    vocab_size: int = 32000
    head_dim: int | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    attn_implementation: str | None = None
    name: str = "llama"

    def __post_init__(self):
        check_decoder(self, ("attention_bias", "mlp_bias"))

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    def decoder(self) -> "Decoder":
        return Decoder(self.name, self.hidden_size, self.intermediate_size, self.num_hidden_layers,
                       self.num_attention_heads, self.kv_heads, self.vocab_size, self.head_dim,
                       qkv_bias=self.attention_bias, o_bias=self.attention_bias, mlp_bias=self.mlp_bias,
                       dropout=self.attention_dropout, tie=self.tie_word_embeddings,
                       attn_implementation=self.attn_implementation)

    def bindings(self) -> dict:
        return self.decoder().bindings()


def check_decoder(cfg, flags=()) -> None:
    """Validate a Llama-type config by transformers' key names (Llama, Mistral and Qwen2 share
    them): sizes positive, heads dividing the hidden size, kv heads dividing the heads, the
    activation silu, a dropout probability, booleans ``flags`` and ``tie_word_embeddings``."""
    checks.positive_ints(cfg, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "vocab_size", optional=("num_key_value_heads", "head_dim", "sliding_window"))
    checks.heads_divide("hidden_size", cfg.hidden_size, cfg.num_attention_heads,
                        "transformers refuses it too (validate_architecture).")
    kv = cfg.num_key_value_heads or cfg.num_attention_heads
    if cfg.num_attention_heads % kv:
        raise ConfigError("num_key_value_heads", kv,
                          f"a divisor of the number of attention heads ({cfg.num_attention_heads})",
                          "Each key/value head serves a whole group of query heads.")
    checks.known("hidden_act", cfg.hidden_act, ("silu",))
    checks.probabilities(cfg, "attention_dropout")
    checks.booleans(cfg, *flags, "tie_word_embeddings")
    checks.attn_implementation(cfg)


@dataclass(frozen=True)
class Decoder:
    """What :func:`build_decoder` needs of a Llama-type config (Llama, Mistral, Qwen2 read
    their own keys into it): sizes, which projections have a bias, the attention's dropout,
    a tied head, the attention implementation and a sliding window (None: none).

    ``full_layers``: with a window, how many leading layers attend to every position instead
    (Qwen2's ``max_window_layers``); ``full_mask``: the model also builds the full causal mask
    beside the window's (Qwen2's ``create_causal_mask``, made whatever its layers), each one a
    local of the model's forward until it returns."""
    name: str
    hidden: int
    inter: int
    layers: int
    heads: int
    kv: int
    vocab: int
    head_dim: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    dropout: float = 0.0
    tie: bool = False
    attn_implementation: str | None = None
    window: int | None = None
    full_layers: int = 0
    full_mask: bool = False

    @property
    def own_head_dim(self) -> bool:
        """Does the config set a head dimension other than h/a (then the symbol d_h)?"""
        return self.head_dim is not None and self.head_dim * self.heads != self.hidden

    def bindings(self) -> dict:
        out = {h: self.hidden, L: self.layers, a: self.heads, k: self.kv, V: self.vocab, f: self.inter}
        if self.own_head_dim:
            out[d_h] = self.head_dim
        return out


def build_llama(cfg: LlamaConfig) -> Graph:
    """The operator graph of one LlamaForCausalLM training forward, loss included."""
    return build_decoder(cfg.decoder())


def build_decoder(cfg: Decoder, mlp=None) -> Graph:
    """The operator graph of one training forward of a Llama-type causal LM (Llama, Mistral,
    Qwen2: transformers' modeling files differ in the biases and the sliding window only).
    ``mlp(g, y) -> z``: the layer's feed-forward part on the post-attention norm's output ``y``
    (default the SwiGLU MLP; Mixtral's mixture of experts replaces it), holding ``y`` as the
    decoder layer does until it returns."""
    g = Graph(cfg.name, cfg.bindings())
    if cfg.attn_implementation is not None:
        g.attention = HF_NAMES[cfg.attn_implementation]
    d = d_h if cfg.own_head_dim else h / a
    g.require(a, h, "the attention heads split the hidden size evenly", kind="divides")
    g.require(k, a, "each key/value head serves a whole group of query heads", kind="divides")
    ids = g.input("input_ids", (b, s))
    embed = g.param("embed_tokens.weight", (V, h))
    x = g.add("embedding", ids, params=(embed,), name="embed_tokens")
    positions = g.add("positions", ids, layer_kwarg=True, name="position_ids")
    # LlamaModel passes the position ids, the mask and the rotary tables to each layer as
    # keyword arguments
    # (Qwen2 with sliding layers: create_causal_mask, then create_sliding_window_causal_mask,
    # each layer given its own: a keyword of the layers that read it, layer_kwarg="read";
    # Mistral's one mask is the window's)
    two = cfg.window is not None and cfg.full_mask
    full = g.add("causal_mask", ids, layer_kwarg="read" if two else True, name="causal_mask")
    mask = g.add("causal_mask", ids, layer_kwarg="read", name="sliding_causal_mask") if two else full
    # LlamaRotaryEmbedding's buffers (inv_freq and its original copy, d/2 each, float32 or the
    # dtype model.to() gave the weights) and the cos and sin tables it makes once per forward,
    # read by every layer
    for name in ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"):
        g.buffer(name, (d / 2,), dtype="param")
    cos = g.add("rotary", positions, x, dim=d, which="cos", layer_kwarg=True, name="rotary_emb/cos")
    sin = g.add("rotary", positions, x, dim=d, which="sin", layer_kwarg=True, name="rotary_emb/sin")

    def block(g: Graph, x: str) -> str:
        x_in = x

        def norm(name, y):       # its input also feeds the residual add
            return g.add("rms_norm", y, params=(g.param(f"{name}.weight", (h,)),), residual=True,
                         name=f"layers/{name}")

        def linear(name, y, n_in, n_out, bias):
            params = (g.param(f"{name}.weight", (n_out, n_in)),)
            if bias:
                params += (g.param(f"{name}.bias", (n_out,)),)
            return g.add("linear", y, params=params, name=f"layers/{name}")

        y = norm("input_layernorm", x)
        q, key, v = (linear(f"self_attn.{n}_proj", y, h, heads * d, cfg.qkv_bias)
                     for n, heads in (("q", a), ("k", k), ("v", k)))
        q = g.add("heads", q, heads=a, name="layers/self_attn/q_heads")
        key = g.add("heads", key, heads=k, name="layers/self_attn/k_heads")
        v = g.add("heads", v, heads=k, name="layers/self_attn/v_heads")
        q = g.add("rope", q, cos, sin, name="layers/self_attn/q_rope")
        key = g.add("rope", key, cos, sin, name="layers/self_attn/k_rope")
        # the attention core, as the policy's kernel computes it (symmem.passes.attention):
        # eager repeats k and v to a heads, softmax in float32 cast to the query's dtype, and
        # makes the output contiguous (the merge) before it returns; LlamaDecoderLayer keeps the
        # returned weights in `_` until it returns
        with g.scope(recompute="attention"):
            z = g.add("attention", q, key, v, mask, dropout=cfg.dropout, causal=True, groups=a / k,
                      probs_like="query", softmax_float32=True, weights_until="layers/mlp/residual",
                      returns_after="layers/self_attn/merge", window=cfg.window,
                      name="layers/self_attn/context")
        z = g.add("merge_heads", z, name="layers/self_attn/merge")
        z = linear("self_attn.o_proj", z, a * d, h, cfg.o_bias)
        x = g.add("add", x, z, name="layers/self_attn/residual")
        y2 = norm("post_attention_layernorm", x)
        if mlp is None:
            # act_fn(gate_proj(x)) * up_proj(x), in that order
            act = g.add("silu", linear("mlp.gate_proj", y2, h, f, cfg.mlp_bias), name="layers/mlp/act")
            up = linear("mlp.up_proj", y2, h, f, cfg.mlp_bias)
            z2 = g.add("mul", act, up, name="layers/mlp/gated")
            z2 = linear("mlp.down_proj", z2, f, h, cfg.mlp_bias)
            g.hold(y2, until="layers/mlp.down_proj")
        else:
            z2 = mlp(g, y2)
        out = g.add("add", x, z2, name="layers/mlp/residual")
        # LlamaAttention's locals until it returns (after o_proj): the rotated query and key,
        # the value view; LlamaDecoderLayer's `hidden_states` (each norm's output) until the
        # attention or the MLP returns
        for value in (q, key, v):
            g.hold(value, until="layers/self_attn.o_proj")
        g.hold(y, until="layers/self_attn.o_proj")
        # the layer's input: LlamaModel's loop passes `hidden_states` and rebinds it to what the
        # layer returns, so it lives until the layer's end (the norms save a float32 copy of a
        # half input, not the input)
        g.hold(x_in, until=out)
        return out

    x = g.repeat(L, block, x, name="layers")
    if cfg.window is not None and cfg.full_layers:
        g = _full_first(g, cfg.full_layers, full)
    x = g.output(g.add("rms_norm", x, params=(g.param("norm.weight", (h,)),), name="norm"))
    head = embed if cfg.tie else g.param("lm_head.weight", (V, h))
    logits = g.output(g.add("linear", x, params=(head,), name="lm_head"))
    # transformers' ForCausalLMLoss (symmem.models.heads)
    causal_lm_loss(g, logits, ids)
    # LlamaModel's locals until it returns (after the final norm)
    for value in dict.fromkeys(("embed_tokens", positions, full, mask, cos, sin)):
        g.hold(value, until="norm")
    return g


def _full_first(g: Graph, m: int, full: str) -> Graph:
    """The block of layers split before layer ``m`` (:meth:`~symmem.graph.Graph.split_layers`):
    the first ``m`` layers' attention without the window, reading the full causal mask
    ``full``; the others keep the window and its mask. Checkpointed, every layer only
    (``recompute="full"``): layer ranges and groups would cut each part on its own."""
    part = Graph.part_name("layers", 0, m, L)
    split = g.split_layers("layers", [m])

    def rewrite(node, sub) -> bool:
        if node.op != "attention" or not node.name.startswith(part + "/"):
            return False
        attrs = tuple((key, value) for key, value in node.attrs if key != "window")
        sub.items.append(replace(node, inputs=(*node.inputs[:3], full), attrs=attrs))
        return True
    out = split.rewritten(rewrite)
    for rep in out.repeats():
        if rep.name == part and full not in rep.body.externals:
            rep.body.externals = rep.body.externals + (full,)
    out.checkpointing = (f"its first {m} layers attend to every position and the others through a sliding "
                         "window (two blocks of layers, which layer ranges and groups of layers would cut "
                         "each on its own: not modelled)")
    return out


def _llama(name, h_, f_, L_, a_, k_, V_):
    return LlamaConfig(hidden_size=h_, intermediate_size=f_, num_hidden_layers=L_, num_attention_heads=a_,
                       num_key_value_heads=k_, vocab_size=V_, name=name)


#: Meta's checkpoints (Touvron et al. 2023; Grattafiori et al. 2024, the Llama 3 herd) as their
#: config.json files give them; Llama 3.1's rope_scaling changes no tensor's size.
PRESETS: dict[str, LlamaConfig] = {
    "llama-2-7b": _llama("llama-2-7b", 4096, 11008, 32, 32, 32, 32000),
    "llama-2-13b": _llama("llama-2-13b", 5120, 13824, 40, 40, 40, 32000),
    "llama-2-70b": _llama("llama-2-70b", 8192, 28672, 80, 64, 8, 32000),
    "llama-3-8b": _llama("llama-3-8b", 4096, 14336, 32, 32, 8, 128256),
    "llama-3-70b": _llama("llama-3-70b", 8192, 28672, 80, 64, 8, 128256),
    "llama-3.1-8b": _llama("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128256),
    "llama-3.1-70b": _llama("llama-3.1-70b", 8192, 28672, 80, 64, 8, 128256),
    "llama-3.1-405b": _llama("llama-3.1-405b", 16384, 53248, 126, 128, 8, 128256),
}

HF_IDS = {"llama-2-7b": "meta-llama/Llama-2-7b-hf", "llama-2-13b": "meta-llama/Llama-2-13b-hf",
          "llama-2-70b": "meta-llama/Llama-2-70b-hf", "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
          "llama-3-70b": "meta-llama/Meta-Llama-3-70B", "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
          "llama-3.1-70b": "meta-llama/Llama-3.1-70B", "llama-3.1-405b": "meta-llama/Llama-3.1-405B"}

#: The sizes a config.json must give; every other field takes transformers' default.
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

UNMODELLED = (
    Unmodelled("gradient_checkpointing", (False,),
               "transformers then recomputes every layer in backward: use --recompute full"),
)

_ROPE = "the rotary tables' values (frequencies, scaling), not their size"

IGNORED = {
    **BOOKKEEPING,
    **TRAINING_STEP,
    "max_position_embeddings": "rotary positions have no table: nothing sized by it",
    "rope_theta": _ROPE, "rope_scaling": _ROPE, "rope_parameters": _ROPE,
    "rms_norm_eps": "a number inside RMSNorm, not a tensor",
    "initializer_range": "initialisation only",
    "pretraining_tp": "transformers 5 no longer splits the projections by it",
}

FAMILY = register(Family(
    name="llama",
    description="Llama 1, 2 and 3 as Hugging Face's LlamaForCausalLM runs them (RMSNorm, rotary "
                "embeddings, grouped-query attention, SwiGLU, untied head)",
    config=LlamaConfig,
    build=build_llama,
    model_types=("llama",),
    aliases={"_attn_implementation": "attn_implementation"},
    required=REQUIRED,
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
