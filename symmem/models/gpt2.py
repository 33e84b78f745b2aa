"""GPT-2 (and GPT-3's dense architecture) as Hugging Face's ``GPT2LMHeadModel`` runs it
with ``attn_implementation="eager"``.

Every dimension stays a symbol (``b, s, h, a, L, V, s_max`` and ``f`` when the config
sets ``n_inner``); the config's numbers travel beside the graph as bindings.
"""
from __future__ import annotations

from dataclasses import dataclass


from ..errors import ConfigError, UnknownName
from ..graph import Graph
from ..symbols import L, V, a, b, f, h, s, s_max

__all__ = ["GPT2Config", "build_gpt2", "ACTIVATIONS", "PRESETS"]

#: Hugging Face activation names -> the op symmem models them with.
ACTIVATIONS = {"gelu_new": "gelu_new", "gelu": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}


@dataclass(frozen=True)
class GPT2Config:
    """The fields of Hugging Face's GPT2Config that decide memory, with its defaults."""
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
    scale_attn_weights: bool = True
    tie_word_embeddings: bool = True
    name: str = "gpt2"

    def __post_init__(self):
        for key in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"):
            _positive_int(key, getattr(self, key))
        if self.n_inner is not None:
            _positive_int("n_inner", self.n_inner)
        if self.n_embd % self.n_head:
            raise ConfigError("n_embd", self.n_embd,
                              f"a multiple of the number of attention heads n_head ({self.n_head})",
                              "Change n_embd or n_head so that n_embd / n_head is an integer.")
        if self.activation_function not in ACTIVATIONS:
            raise UnknownName("activation_function", self.activation_function, tuple(ACTIVATIONS))
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            p = getattr(self, key)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
                raise ConfigError(key, p, "a dropout probability in [0, 1)")

    def bindings(self) -> dict:
        out = {h: self.n_embd, L: self.n_layer, a: self.n_head, V: self.vocab_size,
               s_max: self.n_positions}
        if self.n_inner is not None:
            out[f] = self.n_inner
        return out


def _positive_int(key, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(key, value, "a positive integer")


def build_gpt2(cfg: GPT2Config) -> Graph:
    """The operator graph of one GPT-2 training forward, loss included."""
    g = Graph(cfg.name, cfg.bindings())
    ffn = f if cfg.n_inner is not None else 4 * h
    act = ACTIVATIONS[cfg.activation_function]
    g.require(s, s_max, "the sequence length cannot exceed n_positions, the rows of the position embedding")
    ids = g.input("input_ids", (b, s))
    wte = g.param("wte.weight", (V, h))
    wpe = g.param("wpe.weight", (s_max, h))
    tok = g.add("embedding", ids, params=(wte,), name="wte")
    pos = g.add("position_embedding", ids, params=(wpe,), name="wpe")
    x = g.add("add", tok, pos, name="embed")
    x = g.add("dropout", x, p=cfg.embd_pdrop, name="drop")
    mask = g.add("causal_mask", ids, name="causal_mask")

    def block(g: Graph, x: str) -> str:
        def ln(name, y):
            w_, b_ = g.param(f"{name}.weight", (h,)), g.param(f"{name}.bias", (h,))
            return g.add("layer_norm", y, params=(w_, b_), name=f"h/{name}")

        def conv1d(name, y, n_in, n_out):
            w_, b_ = g.param(f"{name}.weight", (n_in, n_out)), g.param(f"{name}.bias", (n_out,))
            return g.add("linear", y, params=(w_, b_), conv1d=True, name=f"h/{name}")

        y = ln("ln_1", x)
        qkv = conv1d("attn.c_attn", y, h, 3 * h)
        q, k, v = (g.add("heads", g.add("split", qkv, parts=3, index=i, name=f"h/attn/{n}"),
                         heads=a, name=f"h/attn/{n}_heads") for i, n in enumerate("qkv"))
        z = g.add("matmul", q, k, transpose_b=True, name="h/attn/scores")
        if cfg.scale_attn_weights:
            z = g.add("scale", z, name="h/attn/scale")
        z = g.add("add", z, mask, name="h/attn/mask")
        z = g.add("softmax", z, name="h/attn/softmax")
        z = g.add("to_compute", z, name="h/attn/probs")
        z = g.add("dropout", z, p=cfg.attn_pdrop, name="h/attn/attn_dropout")
        z = g.add("matmul", z, v, name="h/attn/context")
        z = g.add("merge_heads", z, name="h/attn/merge")
        z = conv1d("attn.c_proj", z, h, h)
        z = g.add("dropout", z, p=cfg.resid_pdrop, name="h/attn/resid_dropout")
        x = g.add("add", z, x, name="h/attn/residual")
        y = ln("ln_2", x)
        y = conv1d("mlp.c_fc", y, h, ffn)
        y = g.add(act, y, name=f"h/mlp/{act}")
        y = conv1d("mlp.c_proj", y, ffn, h)
        y = g.add("dropout", y, p=cfg.resid_pdrop, name="h/mlp/dropout")
        return g.add("add", y, x, name="h/mlp/residual")

    x = g.repeat(L, block, x, name="h")
    # The final hidden states stay referenced by the model's output until forward ends.
    x = g.output(g.add("layer_norm", x, params=(g.param("ln_f.weight", (h,)), g.param("ln_f.bias", (h,))),
                       name="ln_f"))
    head = wte if cfg.tie_word_embeddings else g.param("lm_head.weight", (V, h))
    logits = g.output(g.add("linear", x, params=(head,), name="lm_head"))
    logits = g.add("to_float32", logits, name="logits_float")
    logp = g.add("log_softmax", logits, name="log_softmax")
    g.add("nll_loss", logp, ids, name="loss")
    return g


#: Published configurations. GPT-3 175B: Brown et al. 2020, Table 2.1 (n_ctx 2048).
PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(name="gpt2"),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16, name="gpt2-medium"),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20, name="gpt2-large"),
    "gpt2-xl": GPT2Config(n_embd=1600, n_layer=48, n_head=25, name="gpt2-xl"),
    "gpt3-175b": GPT2Config(n_embd=12288, n_layer=96, n_head=96, n_positions=2048, name="gpt3-175b"),
}
