"""Bytes per element of each dtype: ``dtype_bytes("bf16") == 2``, ``int4`` is 1/2.

Exact: the byte counts are sympy integers and rationals. Byte units and their
formatting live in :mod:`symmem.units` (shown through :mod:`symmem.printing`).
"""
from __future__ import annotations

import sympy as sp

from .errors import UnknownName

__all__ = ["DTYPE_BYTES", "dtype_bytes"]

DTYPE_BYTES: dict[str, sp.Rational] = {
    "float64": sp.Integer(8), "float32": sp.Integer(4), "tf32": sp.Integer(4),
    "bfloat16": sp.Integer(2), "float16": sp.Integer(2),
    "float8": sp.Integer(1), "int64": sp.Integer(8), "int32": sp.Integer(4),
    "int8": sp.Integer(1), "bool": sp.Integer(1), "int4": sp.Rational(1, 2),
}
_ALIASES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16", "fp8": "float8", "long": "int64", "int": "int32"}


def dtype_bytes(name: str) -> sp.Rational:
    """Bytes per element of ``name`` (``"bf16"``, ``"float32"``, ``"int4"`` = 1/2, …)."""
    key = _ALIASES.get(name, name)
    if key not in DTYPE_BYTES:
        raise UnknownName("dtype", name, tuple(DTYPE_BYTES) + tuple(_ALIASES))
    return DTYPE_BYTES[key]
