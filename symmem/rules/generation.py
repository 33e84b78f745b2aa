"""What ``generate`` changes in a causal LM's forward beside the KV cache
(:mod:`symmem.rules.cache`): the prefill's logits of the last position only."""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import Footprint, TensorInfo, _grads, rule

__all__ = ["last_position_rule"]


@rule("last_position")
def last_position_rule(node, ins, ctx):
    """``slice_logits_to_keep(hidden_states, 1)`` (transformers' ``modeling_utils.py``, which
    ``generate`` asks for with ``logits_to_keep=1``): ``hidden_states[:, -1:, :]`` of a
    (b, s, h) tensor, a (b, 1, h) view (not contiguous for b > 1; the output head's
    ``reshape`` to (b, h) is still a view). Nothing allocated."""
    x = ins[0]
    if len(x.shape) != 3:
        raise ShapeError(node.name, x.shape, "(batch, sequence, hidden) states")
    out = TensorInfo((x.shape[0], sp.Integer(1), x.shape[2]), x.dtype, False, x.requires_grad)
    return Footprint(out, alias=0, grads=_grads(ins))
