"""Model builders, presets, and ``from_hf_config`` for Hugging Face ``config.json`` files."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from ..errors import ConfigError, UnknownName
from ..graph import Graph
from .gpt2 import PRESETS, GPT2Config, build_gpt2

__all__ = ["from_hf_config", "preset", "PRESETS", "GPT2Config", "build_gpt2"]

# Hugging Face's GPT2Config.attribute_map: the generic names map onto GPT-2's own.
_GPT2_ALIASES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                 "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}
_GPT2_REQUIRED = ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")
_BUILDERS = {"gpt2": build_gpt2}


def preset(name: str) -> Graph:
    """A published model by name (``symmem models`` lists them)."""
    if name not in PRESETS:
        raise UnknownName("model", name, tuple(PRESETS))
    return build_gpt2(PRESETS[name])


def from_hf_config(config, name: str | None = None) -> Graph:
    """Build a model from a Hugging Face config: a dict, or the path of a local
    ``config.json`` (or of the folder holding it). Nothing is downloaded."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError("config", str(config), "a local config.json file or a folder holding one",
                              "No such file was found.")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError("config", str(path), f"valid JSON ({e.msg} at line {e.lineno})") from None
        except UnicodeDecodeError:
            raise ConfigError("config", str(path), "a UTF-8 text file (as Hugging Face writes them)") from None
        name = name or path.parent.name or "model"
    if not isinstance(config, dict):
        raise ConfigError("config", type(config).__name__, "a dict or a path to config.json")
    model_type = config.get("model_type")
    if model_type is None:
        raise ConfigError("model_type", None, f"one of {', '.join(_BUILDERS)}",
                          "Add \"model_type\" to the config.")
    if model_type not in _BUILDERS:
        raise UnknownName("model_type", model_type, tuple(_BUILDERS))
    cfg = {_GPT2_ALIASES.get(k, k): v for k, v in config.items()}
    missing = [k for k in _GPT2_REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(missing[0], None, "a positive integer (the key is missing from the config)",
                          f"Missing keys: {', '.join(missing)}.")
    known = {fl.name for fl in fields(GPT2Config)} - {"name"}
    kwargs = {k: v for k, v in cfg.items() if k in known}
    return build_gpt2(GPT2Config(name=name or config.get("_name_or_path") or model_type, **kwargs))
