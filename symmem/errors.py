"""Errors a user can meet. Each carries fields and says what was wrong, the value
given, what was expected and how to fix it, so no sympy or networkx traceback
ever reaches the user.

Every module raises these, so this one sits at the bottom of the import graph: it
imports only :mod:`symmem.units` (which imports nothing), for the sizes that
:class:`Infeasible` quotes.
"""
from __future__ import annotations

import difflib

from .units import format_bytes

__all__ = ["SymmemError", "ConfigError", "UnknownName", "ShapeError", "Infeasible", "SearchLimit"]


class SymmemError(Exception):
    """Base class of every error symmem raises on purpose."""


class ConfigError(SymmemError):
    """A configuration value is wrong: ``field`` had ``value``, ``expected`` says what fits."""

    def __init__(self, field: str, value, expected: str, fix: str | None = None):
        self.field, self.value, self.expected, self.fix = field, value, expected, fix
        msg = f"{field} = {value!r} is not valid: expected {expected}."
        if fix:
            msg += f" {fix}"
        super().__init__(msg)


class UnknownName(SymmemError):
    """A name (model, op, precision, optimizer, symbol, …) that symmem does not know."""

    def __init__(self, kind: str, name, known: tuple[str, ...]):
        self.kind, self.name, self.known = kind, name, tuple(known)
        close = _closest(str(name), self.known)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        super().__init__(f"unknown {kind} {name!r}.{hint} Known: {', '.join(self.known)}.")


def _closest(name: str, known: tuple[str, ...]) -> list[str]:
    """Known names that ``name`` starts, else the closest by difflib; case, spaces, ``-``
    and ``_`` ignored."""
    def key(text):
        return "".join(ch for ch in text.lower() if ch.isalnum())
    keys = {key(k): k for k in known}
    if not key(name):
        return []
    return [keys[k] for k in keys if k.startswith(key(name))] or \
        [keys[k] for k in difflib.get_close_matches(key(name), list(keys), n=1)]


class ShapeError(SymmemError):
    """Tensor shapes do not fit an operator: ``node`` got ``got`` where ``expected``."""

    def __init__(self, node: str, got, expected: str):
        self.node, self.got, self.expected = node, got, expected
        super().__init__(f"shape mismatch at node {node!r}: got {got}, expected {expected}.")


class Infeasible(SymmemError):
    """No value of ``symbol`` fits the budget. ``needed`` is the peak at the closest value
    tried (``value``), ``usable`` the budget after the reserve; ``breakdown`` is the table
    of what is live at that peak."""

    def __init__(self, symbol: str, value: int, needed: int, usable: int, where: str,
                 breakdown: str, hint: str):
        self.symbol, self.value, self.needed, self.usable = symbol, value, needed, usable
        self.where, self.breakdown, self.hint = where, breakdown, hint
        super().__init__(
            f"no value of {symbol} fits: at {symbol} = {value} the peak is {needed:,} bytes "
            f"({format_bytes(needed)}, during {where}) but the budget allows {usable:,} bytes "
            f"({format_bytes(usable)}). It needs {needed - usable:,} bytes "
            f"({format_bytes(needed - usable)}) more: {hint}\n{breakdown}")


class SearchLimit(SymmemError):
    """The search for the largest ``symbol`` stopped at ``value`` (2^40 or the nearest value
    the model allows), where the peak (``peak`` bytes) still fits ``usable``: the answer is
    larger than the search goes, not unbounded."""

    def __init__(self, symbol: str, value: int, peak: int, usable: int):
        self.symbol, self.value, self.peak, self.usable = symbol, value, peak, usable
        super().__init__(
            f"the largest {symbol} is beyond the search: at {symbol} = {value:,} the peak is {peak:,} "
            f"bytes ({format_bytes(peak)}), still within the {usable:,} usable bytes "
            f"({format_bytes(usable)}). The search stops at {symbol} = 2^40; a budget this large "
            f"is more than any {symbol} up to there needs.")
