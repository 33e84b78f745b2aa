"""Bytes per element of each dtype, and formatting of byte counts.

Exact until the edge: byte counts stay integers or rationals; floats and GiB
appear only in :func:`format_bytes`.
"""
from __future__ import annotations

import sympy as sp

from .errors import UnknownName

__all__ = ["DTYPE_BYTES", "dtype_bytes", "format_bytes", "GiB", "MiB"]

DTYPE_BYTES: dict[str, sp.Rational] = {
    "float64": sp.Integer(8), "float32": sp.Integer(4), "tf32": sp.Integer(4),
    "bfloat16": sp.Integer(2), "float16": sp.Integer(2),
    "float8": sp.Integer(1), "int64": sp.Integer(8), "int32": sp.Integer(4),
    "int8": sp.Integer(1), "bool": sp.Integer(1), "int4": sp.Rational(1, 2),
}
_ALIASES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16", "fp8": "float8", "long": "int64", "int": "int32"}

KiB, MiB, GiB = 2**10, 2**20, 2**30


def dtype_bytes(name: str) -> sp.Rational:
    """Bytes per element of ``name`` (``"bf16"``, ``"float32"``, ``"int4"`` = 1/2, …)."""
    key = _ALIASES.get(name, name)
    if key not in DTYPE_BYTES:
        raise UnknownName("dtype", name, tuple(DTYPE_BYTES) + tuple(_ALIASES))
    return DTYPE_BYTES[key]


def format_bytes(n) -> str:
    """``1234567890`` -> ``'1.15 GiB'`` (binary units; exact integers below 1 KiB)."""
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
