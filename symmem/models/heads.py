"""The causal-LM loss as transformers' ``ForCausalLMLoss`` computes it, shared by the families.

``logits.float()``, the labels padded with -100 and shifted by one, ``log_softmax`` and
``nll_loss`` (cross-entropy); the float logits and the padded labels are its locals, alive
until it returns.
"""
from __future__ import annotations

__all__ = ["causal_lm_loss"]


def causal_lm_loss(g, logits: str, ids: str) -> str:
    """Add the loss of ``logits`` against the labels ``ids`` (``labels=input_ids``) to ``g``;
    returns the loss's value."""
    logits = g.add("to_float32", logits, name="logits_float")
    padded = g.add("pad_labels", ids, name="labels_padded")
    labels = g.add("shift_labels", padded, name="labels_shifted")
    logp = g.add("log_softmax", logits, name="log_softmax")
    loss = g.add("nll_loss", logp, labels, shifted=True, name="loss")
    for value in (logits, padded):
        g.hold(value, until=loss)
    return loss
