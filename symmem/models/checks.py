"""Checks a family's config runs in ``__post_init__``, by the config.json key names: each
raises a :class:`~symmem.errors.ConfigError` (or :class:`~symmem.errors.UnknownName`) naming
the key, its value and what is accepted."""
from __future__ import annotations

from ..errors import ConfigError, UnknownName
from ..policy.attention import HF_NAMES

__all__ = ["positive_ints", "probabilities", "booleans", "heads_divide", "known", "attn_implementation"]


def positive_ints(cfg, *keys, optional=()) -> None:
    """``keys`` are positive integers; ``optional`` ones too, or None (absent)."""
    for key in keys + tuple(optional):
        value = getattr(cfg, key, None)
        if key in optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(key, value, "a positive integer")


def probabilities(cfg, *keys) -> None:
    """``keys`` are dropout probabilities in [0, 1)."""
    for key in keys:
        p = getattr(cfg, key)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ConfigError(key, p, "a dropout probability in [0, 1)")


def booleans(cfg, *keys) -> None:
    for key in keys:
        if not isinstance(getattr(cfg, key), bool):
            raise ConfigError(key, getattr(cfg, key), "true or false")


def heads_divide(hidden_key: str, hidden: int, heads: int, fix: str, heads_key: str = "") -> None:
    """The hidden size is a multiple of the number of attention heads (``heads_key`` named in
    the message where the family's key name is not the generic one)."""
    if hidden % heads:
        named = f" {heads_key}" if heads_key else ""
        raise ConfigError(hidden_key, hidden, f"a multiple of the number of attention heads{named} ({heads})", fix)


def known(key: str, value, names) -> None:
    """``value`` is one of ``names`` (an activation the family models)."""
    if value not in names:
        raise UnknownName(key, value, tuple(names))


def attn_implementation(cfg) -> None:
    """Hugging Face's ``attn_implementation``, if set, is one symmem maps onto a kernel."""
    if cfg.attn_implementation is not None:
        known("attn_implementation", cfg.attn_implementation, HF_NAMES)
