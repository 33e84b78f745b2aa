"""Models: a registry of families, each one file (see :mod:`symmem.models.registry`).

    import symmem as sm
    g = sm.models.preset("gpt2")                         # or "openai-community/gpt2", any case
    g = sm.models.from_hf_config("path/to/config.json")  # a local file, a folder or a dict
    sm.models.families()                                  # what is registered
    sm.models.PRESETS                                     # preset name -> config, read-only

``from_hf_config`` dispatches on the config's ``model_type`` to the family that claims
it; the family reads the keys (Hugging Face's generic names too), refuses keys that
change memory in ways it does not model, and builds the graph.

Adding a family: write ``symmem/models/<family>.py`` ending in ``register(Family(...))``
(``gpt2.py`` is the example) and import it below; nothing else changes.
"""
from __future__ import annotations

from .registry import (BOOKKEEPING, PRESETS, REGISTRY, DuplicateName, Family, PresetSummary,
                       Registry, Unmodelled, families, family, from_hf_config, hf_config,
                       model_types, preset, preset_config, register, summaries)

# The family modules: importing one registers it.
# (in the order `symmem models` lists them: gpt2 first, the decoders, then the others)
from . import gpt2, gpt_neox, llama, mistral, mixtral, opt, qwen2  # noqa: E402  (after the registry)
from . import bert, t5, resnet, vit  # noqa: E402
from .gpt2 import GPT2Config, build_gpt2  # noqa: E402
from .llama import LlamaConfig, build_llama  # noqa: E402
from .gpt_neox import GPTNeoXConfig  # noqa: E402
from .mistral import MistralConfig  # noqa: E402
from .opt import OPTConfig  # noqa: E402
from .qwen2 import Qwen2Config  # noqa: E402
from .mixtral import MixtralConfig  # noqa: E402
from .bert import BertConfig, build_bert  # noqa: E402
from .resnet import ResNetConfig  # noqa: E402
from .vit import ViTConfig  # noqa: E402
from .t5 import T5Config  # noqa: E402

__all__ = ["preset", "from_hf_config", "hf_config", "preset_config", "families", "family",
           "model_types", "summaries", "register", "PRESETS", "REGISTRY", "Registry", "Family",
           "Unmodelled", "PresetSummary", "DuplicateName", "BOOKKEEPING", "GPT2Config",
           "build_gpt2", "gpt2", "LlamaConfig", "build_llama", "llama", "MistralConfig", "mistral",
           "Qwen2Config", "qwen2", "OPTConfig", "opt", "GPTNeoXConfig", "gpt_neox",
           "MixtralConfig", "mixtral",
           "BertConfig", "build_bert", "bert",
           "ResNetConfig", "resnet", "ViTConfig", "vit",
           "T5Config", "t5"]
