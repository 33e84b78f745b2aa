"""OPT as Hugging Face's ``OPTForCausalLM`` runs it: the opt family.

transformers 5's ``modeling_opt.py``: token embeddings plus learned positions (``position_ids +
2``: OPT's offset; the ids computed from a float mask of ones, ``cumsum(mask) * mask - 1``),
no embedding dropout; per layer a layer norm before (``do_layer_norm_before``, every OPT but
350m) or after each residual, separate q, k, v projections with biases (the query scaled by
``head_dim ** -0.5`` as a Python number), the attention core (softmax in float32, cast to the
query's dtype), ``out_proj``, dropout, the residual; ``fc1``, ReLU, ``fc2``, dropout, the
residual; a final layer norm; the head tied to the embeddings. Where ``word_embed_proj_dim``
(the symbol ``d_e``) differs from the hidden size (OPT 350m: 512 against 1024), the embeddings and
the head are d_e wide and two linear maps without bias join them to the layers:
``project_in`` after the positions are made, ``project_out`` after the final norm.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph
from ..policy.attention import HF_NAMES
from ..symbols import L, V, a, b, d_e, f, h, s, s_max
from . import checks
from .heads import causal_lm_loss
from .registry import BOOKKEEPING, TRAINING_STEP, Family, Unmodelled, register

__all__ = ["OPTConfig", "build_opt", "PRESETS", "HF_IDS", "FAMILY"]


@dataclass(frozen=True)
class OPTConfig:
    """The fields of Hugging Face's OPTConfig that decide memory, with its defaults (OPT 125m)."""
    hidden_size: int = 768
    num_hidden_layers: int = 12
    ffn_dim: int = 3072
    num_attention_heads: int = 12
    vocab_size: int = 50272
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_function: str = "relu"
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    tie_word_embeddings: bool = True
    attn_implementation: str | None = None
    name: str = "opt"

    def __post_init__(self):
        checks.positive_ints(self, "hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads", "vocab_size",
                             "max_position_embeddings")
        checks.heads_divide("hidden_size", self.hidden_size, self.num_attention_heads,
                            "transformers refuses it too (OPTAttention).")
        checks.known("activation_function", self.activation_function, ("relu",))
        checks.probabilities(self, "dropout", "attention_dropout")
        checks.booleans(self, "do_layer_norm_before", "enable_bias", "layer_norm_elementwise_affine",
                        "tie_word_embeddings")
        checks.attn_implementation(self)

        if self.word_embed_proj_dim is not None:
            checks.positive_ints(self, "word_embed_proj_dim")

    @property
    def projected(self) -> bool:
        """Whether the embeddings are narrower or wider than the layers (OPT 350m)."""
        return self.word_embed_proj_dim not in (None, self.hidden_size)

    def bindings(self) -> dict:
        out = {h: self.hidden_size, L: self.num_hidden_layers, a: self.num_attention_heads,
               V: self.vocab_size, f: self.ffn_dim, s_max: self.max_position_embeddings}
        if self.projected:
            out[d_e] = self.word_embed_proj_dim
        return out


def build_opt(cfg: OPTConfig) -> Graph:
    """The operator graph of one OPTForCausalLM training forward, loss included."""
    g = Graph(cfg.name, cfg.bindings())
    if cfg.attn_implementation is not None:
        g.attention = HF_NAMES[cfg.attn_implementation]
    g.require(s, s_max, "the sequence length cannot exceed max_position_embeddings, the rows of the "
                        "position embedding (less its offset of 2)")
    g.require(a, h, "the attention heads split the hidden size evenly", kind="divides")
    affine, bias = cfg.layer_norm_elementwise_affine, cfg.enable_bias
    width = d_e if cfg.projected else h
    ids = g.input("input_ids", (b, s))
    embed = g.param("embed_tokens.weight", (V, width))
    x = g.add("embedding", ids, params=(embed,), name="embed_tokens")
    # OPTDecoder: a float mask of ones, the position ids cumsum(mask) * mask - 1, then + 2
    mask1 = g.add("ones_like_ids", ids, name="position_attention_mask")
    positions = g.add("cumsum_positions", mask1, name="position_ids")
    causal = g.add("causal_mask", ids, name="causal_mask")
    shifted = g.add("offset_ids", positions, offset=2, name="embed_positions/ids")
    pos = g.add("embedding", shifted, params=(g.param("embed_positions.weight", (s_max + 2, h)),),
                name="embed_positions")
    if cfg.projected:
        x = g.add("linear", x, params=(g.param("project_in.weight", (h, d_e)),), name="project_in")
    embeds = x
    x = g.add("add", x, pos, name="embed")

    def block(g: Graph, x: str) -> str:
        def linear(name, y, n_in, n_out):
            params = (g.param(f"{name}.weight", (n_out, n_in)),)
            if bias:
                params += (g.param(f"{name}.bias", (n_out,)),)
            return g.add("linear", y, params=params, name=f"layers/{name}")

        def layer_norm(name, y):
            params = (g.param(f"{name}.weight", (h,)), g.param(f"{name}.bias", (h,))) if affine else ()
            return g.add("layer_norm", y, params=params, name=f"layers/{name}")

        y = layer_norm("self_attn_layer_norm", x) if cfg.do_layer_norm_before else x
        q = g.add("scale", linear("self_attn.q_proj", y, h, h), name="layers/self_attn/q_scaled")
        key = linear("self_attn.k_proj", y, h, h)
        v = linear("self_attn.v_proj", y, h, h)
        q, key, v = (g.add("heads", t, heads=a, name=f"layers/self_attn/{n}_heads")
                     for t, n in ((q, "q"), (key, "k"), (v, "v")))
        # the layer's `hidden_states, _ = self.self_attn(...)` keeps the attention weights until
        # it returns: after the MLP's residual, or after the final layer norm (post-norm)
        last = "layers/mlp/residual" if cfg.do_layer_norm_before else "layers/final_layer_norm"
        with g.scope(recompute="attention"):
            z = g.add("attention", q, key, v, causal, dropout=cfg.attention_dropout, causal=True,
                      probs_like="query", softmax_float32=True, weights_until=last,
                      returns_after="layers/self_attn/merge", name="layers/self_attn/context")
        z = g.add("merge_heads", z, name="layers/self_attn/merge")
        z = linear("self_attn.out_proj", z, h, h)
        z = g.add("dropout", z, p=cfg.dropout, name="layers/self_attn/dropout")
        x2 = g.add("add", x, z, name="layers/self_attn/residual")
        if not cfg.do_layer_norm_before:
            x2 = layer_norm("self_attn_layer_norm", x2)
        y2 = layer_norm("final_layer_norm", x2) if cfg.do_layer_norm_before else x2
        z2 = g.add("relu", linear("fc1", y2, h, f), name="layers/mlp/relu")
        z2 = g.add("dropout", linear("fc2", z2, f, h), p=cfg.dropout, name="layers/mlp/dropout")
        out = g.add("add", x2, z2, name="layers/mlp/residual")
        if not cfg.do_layer_norm_before:
            out = layer_norm("final_layer_norm", out)
        # OPTAttention's locals until it returns (the scaled query, key and value views); the
        # layer norm's output until the attention returns; the final layer norm's until fc1
        # returns (``hidden_states = self.fc1(hidden_states)`` rebinds it: under no_grad it goes
        # there, in training fc1 saves it); the decoder layer's input until it returns
        # (OPTDecoder rebinds hidden_states to what the layer returns)
        for value in (q, key, v):
            g.hold(value, until="layers/self_attn.out_proj")
        if cfg.do_layer_norm_before:
            g.hold(y, until="layers/self_attn.out_proj")
            g.hold(y2, until="layers/fc1")
        g.hold(x, until=out)
        g.hold(x2, until=out)          # `residual`, the MLP's, until the layer returns
        return out

    x = g.repeat(L, block, x, name="layers")
    if cfg.do_layer_norm_before:
        # OPTDecoder's own final norm (the layers' share its name: decoder.final_layer_norm here)
        params = ((g.param("decoder.final_layer_norm.weight", (h,)), g.param("decoder.final_layer_norm.bias", (h,)))
                  if affine else ())
        x = g.add("layer_norm", x, params=params, name="decoder.final_layer_norm")
    if cfg.projected:
        x = g.add("linear", x, params=(g.param("project_out.weight", (d_e, h)),), name="project_out")
    x = g.output(x)
    head = embed if cfg.tie_word_embeddings else g.param("lm_head.weight", (V, width))
    logits = g.output(g.add("linear", x, params=(head,), name="lm_head"))
    causal_lm_loss(g, logits, ids)
    # OPTDecoder's locals until it returns
    last = "decoder.final_layer_norm" if cfg.do_layer_norm_before else "layers"
    for value in (embeds, mask1, positions, causal, pos):
        g.hold(value, until=last)
    return g


def _opt(name, h_, L_, a_, f_=None):
    return OPTConfig(hidden_size=h_, num_hidden_layers=L_, num_attention_heads=a_, ffn_dim=f_ or 4 * h_, name=name)


#: Meta's OPT checkpoints (Zhang et al. 2022, Table 1) as their config.json files give them.
PRESETS = {"opt-125m": _opt("opt-125m", 768, 12, 12),
           "opt-350m": OPTConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
                                 word_embed_proj_dim=512, do_layer_norm_before=False, name="opt-350m"),
           "opt-1.3b": _opt("opt-1.3b", 2048, 24, 32),
           "opt-6.7b": _opt("opt-6.7b", 4096, 32, 32), "opt-66b": _opt("opt-66b", 9216, 64, 72)}
HF_IDS = {"opt-125m": "facebook/opt-125m", "opt-350m": "facebook/opt-350m", "opt-1.3b": "facebook/opt-1.3b", "opt-6.7b": "facebook/opt-6.7b",
          "opt-66b": "facebook/opt-66b"}

UNMODELLED = (
    Unmodelled("layerdrop", (0.0, 0), "layers skipped at random in training: a random number of layers"),
    Unmodelled("_remove_final_layer_norm", (False,), "an old checkpoint format without the final norm"),
    Unmodelled("gradient_checkpointing", (False,), "use --recompute full"),
)

IGNORED = {
    **BOOKKEEPING,
    **TRAINING_STEP,
    "init_std": "initialisation only",
    "scale_embedding": "no longer read by OPT",
}

FAMILY = register(Family(
    name="opt",
    description="OPT as Hugging Face's OPTForCausalLM runs it (learned positions with an offset of 2, ReLU, "
                "pre- or post-layer norm, tied head)",
    config=OPTConfig,
    build=build_opt,
    model_types=("opt",),
    aliases={"_attn_implementation": "attn_implementation"},
    required=("hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads", "vocab_size",
              "max_position_embeddings"),
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
