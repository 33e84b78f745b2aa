"""Qwen2 as Hugging Face's ``Qwen2ForCausalLM`` runs it: the qwen2 family.

transformers 5's ``modeling_qwen2.py`` is Llama's decoder (:func:`~symmem.models.llama.build_decoder`)
with a bias on the q, k and v projections (not on o_proj, nor in the MLP).

Its sliding window (checked against transformers 5.24's ``configuration_qwen2.py``,
``modeling_qwen2.py`` and ``masking_utils.py``): ``sliding_window`` is kept only with
``use_sliding_window``; layer i slides when ``layer_types[i]`` is ``sliding_attention``, by
default for i >= ``max_window_layers`` (an explicit ``layer_types`` must be that pattern: m
full layers, then sliding ones). With no sliding layer the model is plain Qwen2. With some,
``Qwen2Model.forward`` makes two masks, ``create_causal_mask`` and
``create_sliding_window_causal_mask``, both locals until it returns: in eager attention two
(b, 1, s, s) float masks whatever the layers (the window's differs in its values only); for
SDPA the full one is None (``is_causal``) and the window's is None below the window, which
the formulas require (s < sliding_window), and from the window on is the boolean mask
Mistral's sliding layers get (the estimate's ``past_window`` region,
:func:`~symmem.passes.attention.past_window`). A sliding layer's attention differs from a
full one only in that mask (eager ignores the ``sliding_window`` argument; SDPA has none).
All layers sliding (``max_window_layers`` 0) is one block of Mistral's layers; mixed layers
are the block split before layer ``max_window_layers`` (:meth:`~symmem.graph.Graph.split_layers`),
its first part attending to every position. Gradient checkpointing keeps each layer's own
mask (its keyword argument) until the layer's backward; mixed layers are modelled with every
layer checkpointed only (``recompute="full"``: layer ranges and groups would cut each part on
its own, refused), and refuse pipeline stages (two blocks).
Inference: sliding layers cache in ``DynamicSlidingWindowLayer``, full ones in
``DynamicLayer`` (:mod:`symmem.passes.inference`, per layer).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .llama import IGNORED as LLAMA_IGNORED, UNMODELLED as LLAMA_UNMODELLED, Decoder, build_decoder, check_decoder
from .registry import Family, register

__all__ = ["Qwen2Config", "build_qwen2", "PRESETS", "HF_IDS", "FAMILY"]


@dataclass(frozen=True)
class Qwen2Config:
    """The fields of Hugging Face's Qwen2Config that decide memory, with its defaults."""
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    vocab_size: int = 151936
    hidden_act: str = "silu"
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: tuple | None = None
    attn_implementation: str | None = None
    name: str = "qwen2"

    def __post_init__(self):
        check_decoder(self, ("use_sliding_window",))
        if isinstance(self.max_window_layers, bool) or not isinstance(self.max_window_layers, int) \
                or self.max_window_layers < 0:
            raise ConfigError("max_window_layers", self.max_window_layers, "a whole number of layers, 0 or more")
        if self.layer_types is not None:
            if isinstance(self.layer_types, list):          # a config.json's list, kept hashable
                object.__setattr__(self, "layer_types", tuple(self.layer_types))
            self._check_layer_types()

    def _check_layer_types(self) -> None:
        kinds, n = list(self.layer_types), self.num_hidden_layers
        if len(kinds) != n or any(t not in ("full_attention", "sliding_attention") for t in kinds):
            raise ConfigError("layer_types", self.layer_types, f"{n} entries (num_hidden_layers), each "
                              "full_attention or sliding_attention")
        m = kinds.index("sliding_attention") if "sliding_attention" in kinds else n
        if any(t != "sliding_attention" for t in kinds[m:]):
            raise ConfigError("layer_types", self.layer_types, "full_attention layers first, then "
                              "sliding_attention ones (the pattern max_window_layers gives)",
                              "symmem models one split of the layers; leave layer_types out and set "
                              "max_window_layers to the number of full-attention layers, if that is the model.")
        if m < n and (not self.use_sliding_window or self.sliding_window is None):
            raise ConfigError("layer_types", self.layer_types, "full_attention only without a sliding window "
                              "(use_sliding_window true and a sliding_window)",
                              "transformers drops sliding_window unless use_sliding_window is true, and its "
                              "sliding layers then fail to build their mask; set use_sliding_window true and "
                              "sliding_window.")

    @property
    def full_layers(self) -> int:
        """How many leading layers attend to every position (all of them without a window)."""
        n = self.num_hidden_layers
        if not self.use_sliding_window or self.sliding_window is None:
            return n
        if self.layer_types is not None:
            kinds = list(self.layer_types)
            return kinds.index("sliding_attention") if "sliding_attention" in kinds else n
        return min(self.max_window_layers, n)

    def decoder(self) -> Decoder:
        m = self.full_layers
        window = self.sliding_window if m < self.num_hidden_layers else None
        return Decoder(self.name, self.hidden_size, self.intermediate_size, self.num_hidden_layers,
                       self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads,
                       self.vocab_size, qkv_bias=True, dropout=self.attention_dropout,
                       tie=self.tie_word_embeddings, attn_implementation=self.attn_implementation,
                       window=window, full_layers=m if window else 0, full_mask=True)


def build_qwen2(cfg: Qwen2Config):
    """The operator graph of one Qwen2ForCausalLM training forward, loss included."""
    return build_decoder(cfg.decoder())


def _qwen2(name, h_, f_, L_, a_, k_, V_=152064, tie=False):
    return Qwen2Config(hidden_size=h_, intermediate_size=f_, num_hidden_layers=L_, num_attention_heads=a_,
                       num_key_value_heads=k_, vocab_size=V_, tie_word_embeddings=tie, name=name)


#: Alibaba's checkpoints (Qwen2 technical report, Yang et al. 2024) as their config.json files give them.
PRESETS = {"qwen2-0.5b": _qwen2("qwen2-0.5b", 896, 4864, 24, 14, 2, 151936, tie=True),
           "qwen2-7b": _qwen2("qwen2-7b", 3584, 18944, 28, 28, 4),
           "qwen2-72b": _qwen2("qwen2-72b", 8192, 29568, 80, 64, 8)}
HF_IDS = {"qwen2-0.5b": "Qwen/Qwen2-0.5B", "qwen2-7b": "Qwen/Qwen2-7B", "qwen2-72b": "Qwen/Qwen2-72B"}

IGNORED = LLAMA_IGNORED

FAMILY = register(Family(
    name="qwen2",
    description="Qwen2 as Hugging Face's Qwen2ForCausalLM runs it (Llama's decoder with q, k, v biases; "
                "sliding-window layers from max_window_layers on with use_sliding_window)",
    config=Qwen2Config,
    build=build_qwen2,
    model_types=("qwen2",),
    aliases={"_attn_implementation": "attn_implementation"},
    required=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=LLAMA_UNMODELLED,
    ignored=IGNORED,
))
