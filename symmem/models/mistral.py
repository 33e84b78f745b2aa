"""Mistral as Hugging Face's ``MistralForCausalLM`` runs it: the mistral family.

transformers 5's ``modeling_mistral.py`` is Llama's decoder (:func:`~symmem.models.llama.build_decoder`)
without biases and with a sliding window of attention (``sliding_window``, 4096 in Mistral 7B
v0.1, none from v0.3). Eager attention gets the same (b, 1, s, s) float mask whatever the
window (its values differ). SDPA gets no mask and ``is_causal`` while the sequence is shorter
than the window (``create_sliding_window_causal_mask`` returns None), which the formulas of
every kernel but eager require (``s < sliding_window``, in ``est.requirements``, from the
attention pass): a longer one materialises the window's mask, which is not modelled yet.
"""
from __future__ import annotations

from dataclasses import dataclass

from .llama import IGNORED as LLAMA_IGNORED, UNMODELLED, Decoder, build_decoder, check_decoder
from .registry import Family, register

__all__ = ["MistralConfig", "build_mistral", "PRESETS", "HF_IDS", "FAMILY"]


@dataclass(frozen=True)
class MistralConfig:
    """The fields of Hugging Face's MistralConfig that decide memory, with its defaults
    (Mistral 7B's shape)."""
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    vocab_size: int = 32000
    head_dim: int | None = None
    hidden_act: str = "silu"
    sliding_window: int | None = 4096
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    attn_implementation: str | None = None
    name: str = "mistral"

    def __post_init__(self):
        check_decoder(self)

    def decoder(self) -> Decoder:
        return Decoder(self.name, self.hidden_size, self.intermediate_size, self.num_hidden_layers,
                       self.num_attention_heads, self.num_key_value_heads, self.vocab_size, self.head_dim,
                       dropout=self.attention_dropout, tie=self.tie_word_embeddings,
                       attn_implementation=self.attn_implementation, window=self.sliding_window)


def build_mistral(cfg: MistralConfig):
    """The operator graph of one MistralForCausalLM training forward, loss included."""
    return build_decoder(cfg.decoder())


#: Mistral AI's checkpoints as their config.json files give them.
PRESETS = {"mistral-7b": MistralConfig(name="mistral-7b"),
           "mistral-7b-v0.3": MistralConfig(vocab_size=32768, sliding_window=None, name="mistral-7b-v0.3")}
HF_IDS = {"mistral-7b": "mistralai/Mistral-7B-v0.1", "mistral-7b-v0.3": "mistralai/Mistral-7B-v0.3"}

FAMILY = register(Family(
    name="mistral",
    description="Mistral as Hugging Face's MistralForCausalLM runs it (Llama's decoder, no biases, a "
                "sliding window: eager at any length, SDPA below it)",
    config=MistralConfig,
    build=build_mistral,
    model_types=("mistral",),
    aliases={"_attn_implementation": "attn_implementation"},
    required=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=LLAMA_IGNORED,
))
