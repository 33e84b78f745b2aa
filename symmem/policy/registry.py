"""A registry of named policy parts: a precision, an optimizer, an attention kernel, ...

Each part of a :class:`~symmem.policy.Policy` is chosen by name from one registry; an
entry is any object with a ``name`` and a one-line ``description``. Names are looked up
ignoring case (``AdamW`` is ``adamw``); an unknown name raises
:class:`~symmem.errors.UnknownName` with the known ones and a "did you mean". Adding an
entry is one ``register`` call in its part's module: the command line's options, their
``--help`` and ``symmem policies`` list it from there.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import ConfigError, UnknownName

__all__ = ["Registry"]


class Registry(Mapping):
    """Entries of one policy part by name, in the order they were registered."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict = {}

    def register(self, entry):
        """Add ``entry`` (refused when its name, in any case, is taken); returns it."""
        key = entry.name.lower()
        if key in self._entries:
            raise ConfigError(f"{self.kind} name", entry.name, "a name not registered yet",
                              f"{self._entries[key].name!r} is already a {self.kind}.")
        self._entries[key] = entry
        return entry

    def get(self, name, default=None):
        return self._entries.get(str(name).lower(), default)

    def lookup(self, name):
        """The entry called ``name`` (any case), or UnknownName."""
        entry = self.get(name)
        if entry is None:
            raise UnknownName(self.kind, name, tuple(self.names()))
        return entry

    def names(self) -> list[str]:
        return [e.name for e in self._entries.values()]

    def __getitem__(self, name):
        entry = self.get(name)
        if entry is None:
            raise KeyError(name)
        return entry

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
