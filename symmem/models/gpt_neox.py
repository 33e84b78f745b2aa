"""GPT-NeoX and Pythia as Hugging Face's ``GPTNeoXForCausalLM`` runs them: the gpt_neox family.

transformers 5's ``modeling_gpt_neox.py``: token embeddings (``embed_in``), embedding dropout,
rotary tables for the first ``partial_rotary_factor`` (``rotary_pct``, 0.25 in Pythia) of each
head's dimensions; per layer a fused ``query_key_value`` projection viewed as (b, a, s, 3d) and
chunked into q, k, v, partial rotary embeddings on q and k, the attention core (softmax in
float32 cast like the query), ``dense``, dropout; the MLP (``dense_h_to_4h``, GELU,
``dense_4h_to_h``) on a second layer norm of the layer's input, added in parallel with the
attention (``use_parallel_residual``) or after it; a final layer norm and an untied head
(``embed_out``).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..errors import ConfigError
from ..graph import Graph
from ..policy.attention import HF_NAMES
from ..symbols import L, V, a, b, f, h, s
from . import checks
from .heads import causal_lm_loss
from .registry import BOOKKEEPING, TRAINING_STEP, Family, Unmodelled, register

__all__ = ["GPTNeoXConfig", "build_gpt_neox", "PRESETS", "HF_IDS", "FAMILY"]

ACTIVATIONS = {"gelu": "gelu"}


@dataclass(frozen=True)
class GPTNeoXConfig:
    """The fields of Hugging Face's GPTNeoXConfig that decide memory, with its defaults
    (GPT-NeoX 20B's shape). The rotated fraction of a head is ``rope_parameters``'
    ``partial_rotary_factor`` or, in older config.json files, ``rotary_pct``."""
    hidden_size: int = 6144
    num_hidden_layers: int = 44
    num_attention_heads: int = 64
    intermediate_size: int = 24576
    vocab_size: int = 50432
    hidden_act: str = "gelu"
    rotary_pct: float = 0.25
    rope_parameters: dict | None = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    use_parallel_residual: bool = True
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    attn_implementation: str | None = None
    name: str = "gpt_neox"

    def __post_init__(self):
        checks.positive_ints(self, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                             "vocab_size")
        checks.heads_divide("hidden_size", self.hidden_size, self.num_attention_heads,
                            "transformers refuses it too (validate_architecture).")
        checks.known("hidden_act", self.hidden_act, ACTIVATIONS)
        factor = self.rotary_factor
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise ConfigError("partial_rotary_factor", factor, "a fraction of the head dimension in (0, 1]")
        rotated = self.hidden_size // self.num_attention_heads * factor
        if rotated != int(rotated) or int(rotated) % 2:
            raise ConfigError("partial_rotary_factor", factor, "a fraction that rotates an even whole number of the "
                              f"head's {self.hidden_size // self.num_attention_heads} dimensions")
        checks.probabilities(self, "attention_dropout", "hidden_dropout")
        checks.booleans(self, "use_parallel_residual", "attention_bias", "tie_word_embeddings")
        checks.attn_implementation(self)

    @property
    def rotary_factor(self) -> float:
        return (self.rope_parameters or {}).get("partial_rotary_factor", self.rotary_pct)

    def bindings(self) -> dict:
        return {h: self.hidden_size, L: self.num_hidden_layers, a: self.num_attention_heads,
                V: self.vocab_size, f: self.intermediate_size}


def build_gpt_neox(cfg: GPTNeoXConfig) -> Graph:
    """The operator graph of one GPTNeoXForCausalLM training forward, loss included."""
    g = Graph(cfg.name, cfg.bindings())
    if cfg.attn_implementation is not None:
        g.attention = HF_NAMES[cfg.attn_implementation]
    g.require(a, h, "the attention heads split the hidden size evenly", kind="divides")
    d = h / a
    rotary = sp.nsimplify(cfg.rotary_factor) * d
    ids = g.input("input_ids", (b, s))
    embed = g.param("embed_in.weight", (V, h))
    x = g.add("embedding", ids, params=(embed,), name="embed_in")
    positions = g.add("positions", ids, layer_kwarg=True, name="position_ids")
    mask = g.add("causal_mask", ids, layer_kwarg=True, name="causal_mask")
    x = g.add("dropout", x, p=cfg.hidden_dropout, name="emb_dropout")
    for name in ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"):
        g.buffer(name, (rotary / 2,), dtype="param")
    cos = g.add("rotary", positions, x, dim=rotary, which="cos", layer_kwarg=True, name="rotary_emb/cos")
    sin = g.add("rotary", positions, x, dim=rotary, which="sin", layer_kwarg=True, name="rotary_emb/sin")

    def block(g: Graph, x: str) -> str:
        def linear(name, y, n_in, n_out, bias=True):
            params = (g.param(f"{name}.weight", (n_out, n_in)),)
            if bias:
                params += (g.param(f"{name}.bias", (n_out,)),)
            return g.add("linear", y, params=params, name=f"layers/{name}")

        def ln(name, y):
            return g.add("layer_norm", y, params=(g.param(f"{name}.weight", (h,)), g.param(f"{name}.bias", (h,))),
                         name=f"layers/{name}")

        y = ln("input_layernorm", x)
        qkv = linear("attention.query_key_value", y, h, 3 * h, cfg.attention_bias)
        heads = g.add("heads", qkv, heads=a, name="layers/attention/heads")      # (b, a, s, 3d)
        q, key, v = (g.add("split", heads, parts=3, index=i, name=f"layers/attention/{n}")
                     for i, n in enumerate("qkv"))
        q = g.add("rope", q, cos, sin, name="layers/attention/q_rope")
        key = g.add("rope", key, cos, sin, name="layers/attention/k_rope")
        with g.scope(recompute="attention"):
            z = g.add("attention", q, key, v, mask, dropout=cfg.attention_dropout, causal=True,
                      probs_like="query", softmax_float32=True, weights_until="layers/residual",
                      returns_after="layers/attention/merge", name="layers/attention/context")
        z = g.add("merge_heads", z, name="layers/attention/merge")
        z = linear("attention.dense", z, h, h, cfg.attention_bias)
        attn = g.add("dropout", z, p=cfg.hidden_dropout, name="layers/post_attention_dropout")
        if cfg.use_parallel_residual:
            y2 = ln("post_attention_layernorm", x)
        else:
            attn = g.add("add", attn, x, name="layers/attention/residual")
            y2 = ln("post_attention_layernorm", attn)
        m = g.add("gelu", linear("mlp.dense_h_to_4h", y2, h, f), name="layers/mlp/act")
        m = g.add("dropout", linear("mlp.dense_4h_to_h", m, f, h), p=cfg.hidden_dropout,
                  name="layers/post_mlp_dropout")
        if cfg.use_parallel_residual:      # mlp_output + attn_output + hidden_states
            out = g.add("add", g.add("add", m, attn, name="layers/mlp/sum"), x, name="layers/residual")
        else:
            out = g.add("add", m, attn, name="layers/residual")
        # GPTNeoXAttention's locals until it returns (qkv and its views, the rotated q and k);
        # GPTNeoXLayer's input and its attention and MLP outputs until it returns
        # (and its argument, the input layer norm's output, as in
        # `self.attention(self.input_layernorm(hidden_states), ...)`)
        for value in (y, qkv, q, key):
            g.hold(value, until="layers/attention.dense")
        for value in (x, attn, m):         # hidden_states, attn_output, mlp_output
            g.hold(value, until=out)
        # GPTNeoXMLP's argument, `self.mlp(self.post_attention_layernorm(...))`, until it returns
        g.hold(y2, until="layers/mlp.dense_4h_to_h")
        return out

    x = g.repeat(L, block, x, name="layers")
    x = g.output(g.add("layer_norm", x, params=(g.param("final_layer_norm.weight", (h,)),
                                                   g.param("final_layer_norm.bias", (h,))), name="final_layer_norm"))
    head = embed if cfg.tie_word_embeddings else g.param("embed_out.weight", (V, h))
    logits = g.output(g.add("linear", x, params=(head,), name="embed_out"))
    causal_lm_loss(g, logits, ids)
    # GPTNeoXModel's locals until it returns
    for value in ("embed_in", positions, mask, cos, sin):
        g.hold(value, until="final_layer_norm")
    return g


def _pythia(name, h_, L_, a_, V_=50304):
    return GPTNeoXConfig(hidden_size=h_, num_hidden_layers=L_, num_attention_heads=a_, intermediate_size=4 * h_,
                         vocab_size=V_, name=name)


#: EleutherAI's checkpoints (Black et al. 2022; Biderman et al. 2023) as their config.json files give them.
PRESETS = {"pythia-160m": _pythia("pythia-160m", 768, 12, 12, 50304),
           "pythia-1b": _pythia("pythia-1b", 2048, 16, 8, 50304),
           "pythia-12b": _pythia("pythia-12b", 5120, 36, 40, 50688),
           "gpt-neox-20b": GPTNeoXConfig(name="gpt-neox-20b")}
HF_IDS = {"pythia-160m": "EleutherAI/pythia-160m", "pythia-1b": "EleutherAI/pythia-1b",
          "pythia-12b": "EleutherAI/pythia-12b", "gpt-neox-20b": "EleutherAI/gpt-neox-20b"}

UNMODELLED = (Unmodelled("gradient_checkpointing", (False,), "use --recompute full"),)

_ROPE = "the rotary tables' values, not their size"
IGNORED = {
    **BOOKKEEPING,
    **TRAINING_STEP,
    "max_position_embeddings": "rotary positions have no table: nothing sized by it",
    "rotary_emb_base": _ROPE, "rope_theta": _ROPE, "rope_scaling": _ROPE,
    "layer_norm_eps": "a number inside layer norm, not a tensor",
    "initializer_range": "initialisation only",
    "classifier_dropout": "read only by the classification heads; symmem models GPTNeoXForCausalLM",
    "is_decoder": "read only by generation",
}

FAMILY = register(Family(
    name="gpt_neox",
    description="GPT-NeoX and Pythia as Hugging Face's GPTNeoXForCausalLM runs them (parallel residual, "
                "partial rotary embeddings, fused QKV, untied head)",
    config=GPTNeoXConfig,
    build=build_gpt_neox,
    model_types=("gpt_neox",),
    aliases={"_attn_implementation": "attn_implementation"},
    required=("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"),
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
