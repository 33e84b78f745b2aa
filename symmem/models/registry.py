"""The model-family registry: how a Hugging Face config becomes a symmem graph.

A *family* is one architecture as one Hugging Face model class runs it (GPT-2 as
``GPT2LMHeadModel``, Llama as ``LlamaForCausalLM``, ...). It is a :class:`Family` value
that bundles everything symmem knows about that architecture:

* ``config``: a frozen dataclass whose fields are the config keys that decide memory,
  named and defaulted exactly as the transformers config class names and defaults
  them, validated in ``__post_init__`` (e.g. ``GPT2Config``);
* ``build``: ``config -> Graph``, the operator graph of one training forward;
* ``model_types``: the ``model_type`` strings of ``config.json`` it accepts;
* ``aliases``: Hugging Face's generic key names mapped onto the config's own
  (the transformers class's ``attribute_map``: ``hidden_size -> n_embd``);
* ``required``: keys a ``config.json`` must give (the sizes); every other field takes
  the transformers default;
* ``unmodelled``: keys that change memory but that symmem does not model; a value
  other than the supported ones is refused with a :class:`~symmem.errors.ConfigError`
  naming the key, instead of being silently ignored;
* ``ignored``: keys read and deliberately ignored, each with the reason it does not
  change memory (checked against the transformers modelling code, or measured);
* ``presets``: published configurations by name, with their Hugging Face repository
  ids in ``hf_ids`` so that ``preset("openai-community/gpt2")`` works offline.

A key of a ``config.json`` that is none of these (a field, an alias, unmodelled,
ignored) is one the transformers class does not read either, so it cannot change
memory; it is ignored too. ``Family.classify(key)`` says which case a key is.

Each family lives in one file of ``symmem/models/`` that ends with
``register(Family(...))``; ``symmem/models/__init__.py`` imports the files so they
register. The :class:`Registry` refuses a second family of the same name, a
``model_type`` two families claim and a preset name or Hugging Face id used twice
(case-insensitively): a :class:`DuplicateName` says who has it already.

Questions go to the global registry through the module functions:
``preset(name)``, ``from_hf_config(path_or_dict)``, ``families()``, ``summaries()``,
and the read-only mapping ``PRESETS`` (preset name -> config).
This module imports only :mod:`symmem.errors` and :mod:`symmem.symbols`: family files
import it, never the other way round.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from ..errors import ConfigError, UnknownName
from ..symbols import L, V, a, h, s_max

if TYPE_CHECKING:
    from ..graph import Graph

__all__ = ["Family", "Unmodelled", "PresetSummary", "Registry", "DuplicateName", "BOOKKEEPING", "TRAINING_STEP",
           "REGISTRY", "PRESETS", "register", "families", "family", "preset", "preset_config",
           "hf_config", "from_hf_config", "summaries", "model_types"]

#: Keys every Hugging Face config.json may carry that describe the checkpoint (where it
#: came from, its tokenizer's special tokens, label names), not the network's tensors.
#: Families merge this into their ``ignored`` mapping.
BOOKKEEPING: Mapping[str, str] = MappingProxyType({
    "model_type": "selects the family (dispatch), nothing else",
    "_name_or_path": "where the checkpoint came from",
    "architectures": "the class names that saved the checkpoint",
    "transformers_version": "the library version that wrote the file",
    "_attn_implementation_autoset": "a flag transformers 4 kept while loading",
    "task_specific_params": "generation settings",
    "bos_token_id": "a token id, not a size", "eos_token_id": "a token id, not a size",
    "pad_token_id": "a token id, not a size", "sep_token_id": "a token id, not a size",
    "decoder_start_token_id": "a token id, not a size",
    "tokenizer_class": "the tokenizer's name", "prefix": "a generation prompt",
    "id2label": "label names of classification heads", "label2id": "label names",
    "return_dict": "the type of the returned container only",
})


#: Keys every causal LM's config may carry that a training step does not see: what the forward
#: returns besides the loss, and the dtype weights are loaded in. Families merge this too.
TRAINING_STEP: Mapping[str, str] = MappingProxyType({
    "use_cache": "a training step keeps only the loss, so the KV cache goes with the output "
                 "before backward; symmem models use_cache=False",
    "output_attentions": "the returned tensors go with the output before backward",
    "output_hidden_states": "the returned tensors go with the output before backward",
    "dtype": "the weights' dtype when loading: the precision policy prices every role instead",
    "torch_dtype": "the weights' dtype when loading: the precision policy prices every role instead",
})


@dataclass(frozen=True)
class Unmodelled:
    """A config key that changes memory but that symmem models only at ``supported``
    values: any other value raises :meth:`error`.

    ``why`` says what the other values do that symmem does not model; ``fix`` tells the
    user what to do (by default: remove the key or set it to the first supported value)."""
    key: str
    supported: tuple
    why: str
    fix: str = ""

    def __post_init__(self):
        object.__setattr__(self, "supported", tuple(self.supported))
        if not self.supported:
            raise ConfigError("Unmodelled.supported", self.supported, "at least one value")

    def accepts(self, value) -> bool:
        return any(value is v or (type(value) is type(v) and value == v) for v in self.supported)

    def error(self, value) -> ConfigError:
        shown = " or ".join(_json_repr(v) for v in self.supported)
        only = "the only value" if len(self.supported) == 1 else "the only values"
        usual = next((v for v in self.supported if v is not None), self.supported[0])
        fix = self.fix or f"Remove the key or set it to {_json_repr(usual)}."
        return ConfigError(self.key, value, f"{shown}, {only} symmem models ({self.why})", fix)


def _json_repr(v) -> str:
    """A value as config.json writes it: false, null, "eager"."""
    return json.dumps(v, default=repr)


class DuplicateName(ConfigError):
    """A registration that would make a name ambiguous: ``kind`` (family name,
    model_type, preset name or Hugging Face id) ``name`` already belongs to family
    ``owner``."""

    def __init__(self, kind: str, name: str, owner: str, family: str):
        self.kind, self.name, self.owner, self.family = kind, name, owner, family
        rename = "Choose another name" if kind == "family name" else f"Rename it in family {family!r}"
        super().__init__(kind, name, f"a {kind} that no registered family uses (family {owner!r} "
                                     "has it)", f"{rename}, or register into a fresh Registry() "
                                                "to try a variant.")


@dataclass(frozen=True, eq=False)
class Family:
    """One model architecture: see the module docstring for each field's meaning."""
    name: str
    description: str
    config: type
    build: Callable[[Any], "Graph"]
    model_types: tuple[str, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    presets: Mapping[str, Any] = field(default_factory=dict)
    hf_ids: Mapping[str, str] = field(default_factory=dict)
    unmodelled: tuple[Unmodelled, ...] = ()
    ignored: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        def bad(what, value, expected, fix=None):
            return ConfigError(f"family {self.name!r}: {what}", value, expected, fix)
        for attr in ("model_types", "required", "unmodelled"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))
        for attr in ("aliases", "presets", "hf_ids", "ignored"):
            object.__setattr__(self, attr, MappingProxyType(dict(getattr(self, attr))))
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("family name", self.name, "a non-empty string")
        if not (isinstance(self.config, type) and dataclasses.is_dataclass(self.config)
                and "name" in {f.name for f in dataclasses.fields(self.config)}):
            raise bad("config", self.config, "a dataclass with a 'name' field (the model's name)")
        if not self.model_types:
            raise bad("model_types", self.model_types, "at least one Hugging Face model_type")
        fields_ = set(self.fields)
        for alias, target in self.aliases.items():
            if target not in fields_:
                raise bad(f"alias {alias!r}", target, f"a field of {self.config.__name__}")
            if alias in fields_:
                raise bad("alias", alias, f"a name that is not itself a field of {self.config.__name__}")
        for key in self.required:
            if key not in fields_:
                raise bad("required key", key, f"a field of {self.config.__name__}")
        decided = [u.key for u in self.unmodelled] + list(self.ignored)
        for key in decided:
            if key in fields_ or key in self.aliases:
                raise bad("unmodelled or ignored key", key,
                          "a key that is not a field or an alias (those are modelled)")
            if decided.count(key) > 1:
                raise bad("unmodelled or ignored key", key, "a key decided once",
                          "List it either in unmodelled or in ignored.")
        for name, cfg in self.presets.items():
            if not isinstance(cfg, self.config):
                raise bad(f"preset {name!r}", type(cfg).__name__, f"a {self.config.__name__}")
            if cfg.name != name:
                raise bad(f"preset {name!r}", cfg.name, "the preset's own name in its config's name field")
        for name in self.hf_ids:
            if name not in self.presets:
                raise bad("hf_ids", name, "the name of one of the family's presets")

    @property
    def fields(self) -> tuple[str, ...]:
        """The config keys the family models: the config class's fields but ``name``."""
        return tuple(f.name for f in dataclasses.fields(self.config) if f.name != "name")

    def classify(self, key: str) -> str:
        """What the family does with a config.json key: ``"field"`` (modelled),
        ``"alias"`` (read as its field), ``"unmodelled"`` (refused unless supported),
        ``"ignored"`` (listed, with the reason) or ``"unread"`` (unknown to the family
        and to the transformers class: ignored)."""
        if key in self.fields:
            return "field"
        if key in self.aliases:
            return "alias"
        if any(u.key == key for u in self.unmodelled):
            return "unmodelled"
        return "ignored" if key in self.ignored else "unread"

    def read(self, hf: Mapping, name: str | None = None):
        """The family's config from the keys of a Hugging Face config (a mapping):
        aliases resolved, unmodelled values refused, required keys checked, every
        other field at the transformers default."""
        values: dict = {}
        for key, value in hf.items():
            target = self.aliases.get(key, key)
            if target in values and values[target] != value:
                other = next(k for k in hf if k != key and self.aliases.get(k, k) == target)
                raise ConfigError(key, value, f"the value of {other!r} ({values[target]!r}): both "
                                              f"name {self.config.__name__}.{target}",
                                  "Give one of the two keys, or the same value to both.")
            values[target] = value
        missing = [k for k in self.required if k not in values]
        if missing:
            raise ConfigError(missing[0], None, "a positive integer (the key is missing from the config)",
                              f"Missing keys: {', '.join(missing)}.")
        for u in self.unmodelled:
            if u.key in hf and not u.accepts(hf[u.key]):
                raise u.error(hf[u.key])
        kwargs = {k: v for k, v in values.items() if k in self.fields}
        name = name or hf.get("_name_or_path") or hf.get("model_type") or self.model_types[0]
        return self.config(name=name, **kwargs)


@dataclass(frozen=True)
class PresetSummary:
    """One preset as ``symmem models`` lists it: the exact parameter count and the
    sizes the graph binds (``None`` where the family has no such dimension)."""
    family: str
    name: str
    hf_id: str | None
    parameters: int
    layers: int | None
    hidden: int | None
    heads: int | None
    vocab: int | None
    positions: int | None


class Registry:
    """Families by name, with lookups by model_type, preset name and Hugging Face id.

    ``REGISTRY`` is the global one the module functions use; tests build their own."""

    def __init__(self):
        self._families: dict[str, Family] = {}
        self._model_types: dict[str, Family] = {}
        self._lookup: dict[str, tuple[Family, str]] = {}   # lowercased name or HF id -> preset
        self._configs: dict[str, Any] = {}                 # preset name -> config
        self.presets: Mapping[str, Any] = MappingProxyType(self._configs)

    # ----- registering ----------------------------------------------------------
    def register(self, fam: Family) -> Family:
        """Add ``fam``; refuses (``DuplicateName``) a name, model_type, preset name or
        Hugging Face id that is taken, before changing anything."""
        if not isinstance(fam, Family):
            raise ConfigError("family", type(fam).__name__, "a symmem.models.Family")
        if fam.name in self._families:
            raise DuplicateName("family name", fam.name, fam.name, fam.name)
        for mt in fam.model_types:
            if mt in self._model_types:
                raise DuplicateName("model_type", mt, self._model_types[mt].name, fam.name)
        keys = [("preset name", n) for n in fam.presets]
        keys += [("Hugging Face id", i) for i in fam.hf_ids.values()]
        seen: set[str] = set()
        for kind, key in keys:
            k = key.lower()
            if k in self._lookup:
                raise DuplicateName(kind, key, self._lookup[k][0].name, fam.name)
            if k in seen:
                raise DuplicateName(kind, key, fam.name, fam.name)
            seen.add(k)
        self._families[fam.name] = fam
        self._model_types.update({mt: fam for mt in fam.model_types})
        for n in fam.presets:
            self._lookup[n.lower()] = (fam, n)
            self._configs[n] = fam.presets[n]
        for n, repo in fam.hf_ids.items():
            self._lookup[repo.lower()] = (fam, n)
        return fam

    # ----- asking ---------------------------------------------------------------
    def __iter__(self) -> Iterator[Family]:
        return iter(self._families.values())

    def __len__(self) -> int:
        return len(self._families)

    def families(self) -> tuple[Family, ...]:
        return tuple(self._families.values())

    def family(self, name: str) -> Family:
        """A family by name."""
        if name not in self._families:
            raise UnknownName("model family", name, tuple(self._families))
        return self._families[name]

    def model_types(self) -> tuple[str, ...]:
        """Every model_type a family claims, in alphabetical order."""
        return tuple(sorted(self._model_types))

    def preset_config(self, name: str):
        """``(family, config)`` of a preset: by name or Hugging Face id, any case."""
        hit = self._lookup.get(str(name).lower())
        if hit is None:
            known = tuple(self._configs)
            if "/" in str(name):     # offer the ids too, for the "did you mean" hint
                known += tuple(i for f in self for i in f.hf_ids.values())
            raise UnknownName("model", name, known)
        fam, key = hit
        return fam, fam.presets[key]

    def preset(self, name: str) -> "Graph":
        """The graph of a published model, by preset name or Hugging Face id."""
        fam, cfg = self.preset_config(name)
        return fam.build(cfg)

    def hf_config(self, config, name: str | None = None):
        """``(family, config)`` from a Hugging Face config: a dict, or the path of a
        local ``config.json`` or of the folder holding it. Nothing is downloaded."""
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
                raise ConfigError("config", str(path),
                                  "a UTF-8 text file (as Hugging Face writes them)") from None
            except RecursionError:       # json's decoder recurses once per level of nesting
                raise ConfigError("config", str(path), "JSON nested at most a few hundred levels deep "
                                  "(a Hugging Face config.json is two or three)") from None
            name = name or path.parent.name or None
        if not isinstance(config, Mapping):
            raise ConfigError("config", type(config).__name__, "a dict or a path to config.json")
        model_type = config.get("model_type")
        if model_type is None:
            raise ConfigError("model_type", None, f"one of {', '.join(self.model_types())}",
                              "Add \"model_type\" to the config.")
        if not isinstance(model_type, str):
            raise ConfigError("model_type", model_type, f"a name: one of {', '.join(self.model_types())}")
        if model_type not in self._model_types:
            raise UnknownName("model_type", model_type, self.model_types())
        fam = self._model_types[model_type]
        return fam, fam.read(config, name)

    def from_hf_config(self, config, name: str | None = None) -> "Graph":
        """The graph of a Hugging Face config (see :meth:`hf_config`), built by the
        family its ``model_type`` names."""
        fam, cfg = self.hf_config(config, name)
        return fam.build(cfg)

    def summaries(self) -> tuple[PresetSummary, ...]:
        """Every preset, family by family, with its exact parameter count."""
        out = []
        for fam in self:
            for name, cfg in fam.presets.items():
                g = fam.build(cfg)
                bound = g.bindings

                def get(sym):
                    return int(bound[sym]) if sym in bound else None
                out.append(PresetSummary(fam.name, name, fam.hf_ids.get(name),
                                         int(g.param_count().xreplace(bound)),
                                         get(L), get(h), get(a), get(V), get(s_max)))
        return tuple(out)


#: The registry every family file registers into.
REGISTRY = Registry()
#: Every preset of every family, by name: a read-only, live view.
PRESETS: Mapping[str, Any] = REGISTRY.presets


def register(fam: Family) -> Family:
    """Register ``fam`` into the global registry (family files call this once)."""
    return REGISTRY.register(fam)


def families() -> tuple[Family, ...]:
    return REGISTRY.families()


def family(name: str) -> Family:
    return REGISTRY.family(name)


def model_types() -> tuple[str, ...]:
    return REGISTRY.model_types()


def preset(name: str) -> "Graph":
    """A published model by name or Hugging Face id (``symmem models`` lists them)."""
    return REGISTRY.preset(name)


def preset_config(name: str):
    """``(family, config)`` of a preset."""
    return REGISTRY.preset_config(name)


def hf_config(config, name: str | None = None):
    """``(family, config)`` of a Hugging Face config, without building the graph."""
    return REGISTRY.hf_config(config, name)


def from_hf_config(config, name: str | None = None) -> "Graph":
    """Build a model from a Hugging Face config: a dict, or the path of a local
    ``config.json`` (or of the folder holding it). Nothing is downloaded."""
    return REGISTRY.from_hf_config(config, name)


def summaries() -> tuple[PresetSummary, ...]:
    return REGISTRY.summaries()
