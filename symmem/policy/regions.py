"""Regions of a model that a policy part names: modules and layer ranges.

Two parts of a policy pick where they apply: ``quantize_skip`` (the layers ``--quantize``
keeps in the model's dtype) and ``keep_fp32`` (the modules autocast leaves in float32).
Both take the same comma-separated list:

- a module name, ``c_proj`` or ``attn.c_proj`` or ``attn``: every node of a module whose
  dotted path holds those names in a row (``attn`` is every layer's attention,
  ``attn.c_proj`` its output projection), as transformers matches
  ``llm_int8_skip_modules`` against module paths;
- ``first:N`` or ``last:N``: the first or last N layers of the model's repeated block
  (:mod:`symmem.passes.regions` splits the block there).

:func:`parse_regions` checks the syntax; the model's names are checked when a graph is at
hand (:mod:`symmem.passes.regions`).
"""
from __future__ import annotations

from ..errors import ConfigError

__all__ = ["parse_regions", "ACCEPTED"]

ACCEPTED = "module names (c_proj, attn.c_attn, attn) and first:N or last:N, comma-separated"


def parse_regions(value, field: str) -> tuple:
    """``"c_proj,last:2"`` (or a tuple of such entries) -> ``("c_proj", "last:2")``, checked:
    a layer range takes a whole number of layers >= 1. ``field``: the policy field, named in
    errors."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in (str(i).strip() for i in items):
        if not item or " " in item:
            raise ConfigError(field, value, ACCEPTED)
        if ":" in item:
            kind, _, n = item.partition(":")
            if kind not in ("first", "last") or not n.isdigit() or int(n) < 1:
                raise ConfigError(field, item, "first:N or last:N with N >= 1 layers", f"Accepted: {ACCEPTED}.")
        out.append(item)
    return tuple(dict.fromkeys(out))
