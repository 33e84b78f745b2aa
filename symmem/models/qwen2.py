"""Qwen2 as Hugging Face's ``Qwen2ForCausalLM`` runs it: the qwen2 family.

transformers 5's ``modeling_qwen2.py`` is Llama's decoder (:func:`~symmem.models.llama.build_decoder`)
with a bias on the q, k and v projections (not on o_proj, nor in the MLP). Its sliding window
is off unless ``use_sliding_window`` is true, which is refused (:data:`UNMODELLED`): the
window's layers (from ``max_window_layers`` on) then materialise their mask.
"""
from __future__ import annotations

from dataclasses import dataclass

from .llama import IGNORED as LLAMA_IGNORED, UNMODELLED as LLAMA_UNMODELLED, Decoder, build_decoder, check_decoder
from .registry import Family, Unmodelled, register

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
    attn_implementation: str | None = None
    name: str = "qwen2"

    def __post_init__(self):
        check_decoder(self)

    def decoder(self) -> Decoder:
        return Decoder(self.name, self.hidden_size, self.intermediate_size, self.num_hidden_layers,
                       self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads,
                       self.vocab_size, qkv_bias=True, dropout=self.attention_dropout,
                       tie=self.tie_word_embeddings, attn_implementation=self.attn_implementation)


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

UNMODELLED = LLAMA_UNMODELLED + (
    Unmodelled("use_sliding_window", (False,),
               "the layers from max_window_layers on attend through a materialised sliding-window mask"),
)

_WINDOW = "read only with use_sliding_window, which symmem refuses"
IGNORED = {**LLAMA_IGNORED, "sliding_window": _WINDOW, "max_window_layers": _WINDOW, "layer_types": _WINDOW}

FAMILY = register(Family(
    name="qwen2",
    description="Qwen2 as Hugging Face's Qwen2ForCausalLM runs it (Llama's decoder with q, k, v biases)",
    config=Qwen2Config,
    build=build_qwen2,
    model_types=("qwen2",),
    aliases={"_attn_implementation": "attn_implementation"},
    required=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
