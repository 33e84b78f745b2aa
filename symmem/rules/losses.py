"""Losses: nll_loss (the second half of cross-entropy; the first, log_softmax, is in
:mod:`symmem.rules.normalization`). ``aten::nll_loss`` is on the fp32 list of both
devices (see :mod:`symmem.rules.autocast`)."""
from __future__ import annotations

import sympy as sp

from .core import F32, I64, Footprint, Saved, TensorInfo, _grads, rule

__all__ = ["nll_loss_rule"]


@rule("nll_loss")
def nll_loss_rule(node, ins, ctx):
    """``F.nll_loss(logp.view(-1, V), labels)``, mean over tokens, with Hugging Face's
    label shift (``pad`` then ``[..., 1:]``: a new int64 copy of the labels, saved as the
    target). NllLossBackward saves logp, the target and a 0-dim float32 total weight.
    Backward allocates a zero gradient of logp's size and scatters into it.
    Under autocast (CUDA and CPU: fp32 list) a float32 copy of half log-probabilities is
    what is saved, its float32 gradient is cast back after the op's backward, and the
    loss is float32.
    (With b = 1 the shifted slice is already contiguous, so the saved target is a view of
    the padded labels: s + 1 elements, 8 bytes more than counted here.)"""
    logp, labels = ins
    rows = labels.numel
    cast = ctx.autocast_dtype("nll_loss")
    if cast is not None and not ctx.same(logp.dtype, cast):
        first = Saved(f"log-probabilities ({cast.name} copy)", "new", logp.numel, cast)
        bwd_temp = logp.numel * cast.nbytes     # its float32 gradient, then cast back
    else:
        first, bwd_temp = Saved("log-probabilities", "in0"), sp.Integer(0)
    saved = (first, Saved("shifted labels", "new", rows, I64),
             Saved("total weight", "new", sp.Integer(1), F32))
    padded = labels.numel / labels.shape[-1] * (labels.shape[-1] + 1) * I64.nbytes
    out_dt = logp.dtype if cast is None else cast
    return Footprint(TensorInfo((), out_dt), saved=saved, fwd_temp=padded,
                     grads=_grads(ins), bwd_temp=bwd_temp, late_inputs=(0,) if bwd_temp != 0 else ())
