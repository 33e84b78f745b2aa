"""Requirements: what must hold of the symbols' values for the formulas to hold.

A model records them when it is built (the sequence length cannot exceed the position
embedding's rows: ``s <= s_max``); lowering and the counter add theirs (a block whose first
iteration differs holds from two layers on; recomputing ``k`` layers at a time needs ``k``
to divide ``L``). :meth:`symmem.engine.Estimate.check` raises the error of the first one
that values break, with the numbers and the reason.
"""
from __future__ import annotations

from typing import NamedTuple

import sympy as sp

from .errors import ConfigError

__all__ = ["Requirement"]


class Requirement(NamedTuple):
    """What must hold where the formulas are evaluated: ``lhs <= rhs`` (``kind`` "at most")
    or ``lhs`` divides ``rhs`` (``kind`` "divides"), for ``reason``."""
    lhs: sp.Expr
    rhs: sp.Expr
    reason: str
    kind: str = "at most"

    def broken(self, subs: dict) -> ConfigError | None:
        """The error to raise when ``subs`` break the requirement (None when they do not, or
        when they leave a side unknown)."""
        lv, rv = (sp.sympify(sp.sympify(side).xreplace(subs)) for side in (self.lhs, self.rhs))
        if not (lv.is_number and rv.is_number):
            return None
        if self.kind == "divides":
            if rv % lv != 0:
                return ConfigError(str(self.rhs), int(rv), f"a multiple of {int(lv)}: {self.reason}")
            return None
        if lv <= rv:
            return None
        if self.lhs.is_number:
            return ConfigError(str(self.rhs), int(rv), f"at least {self.lhs}: {self.reason}")
        return ConfigError(str(self.lhs), int(lv), f"at most {self.rhs} = {rv}: {self.reason}")
