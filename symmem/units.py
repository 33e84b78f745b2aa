"""Byte units (KiB, MiB, GiB: powers of 2) and byte counts in words.

Exact until the edge: byte counts stay integers or rationals everywhere in symmem;
floats and GiB appear only in :func:`format_bytes`, when a count is shown to a person.

This module imports nothing from symmem, so every module can use it: the errors
(:class:`~symmem.errors.Infeasible` quotes sizes in its message) as well as the
displays, which take :func:`format_bytes` from :mod:`symmem.printing`.
"""
from __future__ import annotations

__all__ = ["KiB", "MiB", "GiB", "TiB", "PiB", "format_bytes"]

KiB, MiB, GiB, TiB, PiB = 2**10, 2**20, 2**30, 2**40, 2**50


def format_bytes(n) -> str:
    """``1234567890`` -> ``'1.15 GiB'`` (binary units up to PiB; exact integers below 1 KiB).

    >>> format_bytes(1234567890), format_bytes(1000), format_bytes(3 * 2**40)
    ('1.15 GiB', '1,000 B', '3.00 TiB')
    """
    n = float(n)
    for unit, size in (("PiB", PiB), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
