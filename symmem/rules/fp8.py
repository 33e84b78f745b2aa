"""Transformer Engine's FP8 linear layer (``te.Linear`` under ``te.autocast`` with the
``DelayedScaling`` recipe, per-tensor scales), read from NVIDIA/TransformerEngine's
``transformer_engine/pytorch/module/linear.py`` (``_linear_forward_impl``, ``Linear.forward``)
and ``module/base.py`` (``quantize_weight``). CUDA only: no test here can run it; the layout
is pinned with its arithmetic in ``tests/test_fp8.py``.

An FP8 tensor needed both row-wise and column-wise is two buffers (data and transpose, one
byte per element each) on Hopper and Ada (sm89, sm90, sm120) and one on Blackwell (sm100):
the node's ``copies`` (2 or 1; ``is_non_tn_fp8_gemm_supported`` in ``pytorch/utils.py``).
Every FP8 tensor carries a float32 ``_scale_inv`` (4 bytes).
"""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import F32, DType, Footprint, Saved, TensorInfo, _grads, _same, rule

__all__ = ["linear_fp8_rule", "FP8"]

FP8 = DType("float8", sp.Integer(1), 1)


@rule("linear_fp8")
def linear_fp8_rule(node, ins, ctx):
    """``te.Linear`` in FP8 (``is_first_microbatch`` None, TE's default: the weight quantized
    afresh at each forward). Forward: the weight in FP8, row-wise, plus column-wise (its
    transpose) where the input's gradient needs it, saved for backward (``wt_save``); the input
    in FP8, row-wise and, where the weight's gradient needs it, column-wise; after the GEMM the
    row-wise data goes (``update_usage(rowwise_usage=False)``) and the column-wise copy is
    saved: N*in bytes, not the input in bfloat16. Backward: the output's gradient in FP8 for
    the input's gradient (row-wise) and the weight's (column-wise); both gradients in the
    parameters' dtype. (A weight of shape (out, in); GPT-2's Conv1D (in, out) with ``conv1d``.)"""
    x = ins[0]
    w = node.params[0]
    out_f, in_f = (w.shape[1], w.shape[0]) if node.attr("conv1d") else w.shape
    if not _same(x.shape[-1], in_f):
        raise ShapeError(node.name, x.shape, f"a last dimension of {in_f}")
    copies = node.attr("copies", 2)
    dgrad, wgrad = x.requires_grad, w.trainable
    out = TensorInfo(tuple(x.shape[:-1]) + (out_f,), x.dtype, True, dgrad or wgrad)
    tokens = x.numel / in_f
    saved, fwd_temp, bwd_temp = [], x.numel * FP8.nbytes + 4, sp.Integer(0)
    if dgrad or wgrad:
        weight = w.numel * (copies if dgrad else 1)
        saved.append(Saved("weight in FP8 (data, transpose where dgrad needs it)", "new", weight, FP8))
        saved.append(Saved("weight scale_inv", "new", sp.Integer(1), F32))
        if wgrad:           # the input's column-wise copy is kept; its row-wise data goes
            saved.append(Saved("input in FP8 (column-wise)", "new", x.numel, FP8))
            saved.append(Saved("input scale_inv", "new", sp.Integer(1), F32))
            fwd_temp = x.numel * FP8.nbytes if copies == 2 else sp.Integer(0)
        usages = (1 if dgrad else 0) + (1 if wgrad else 0)
        bwd_temp = tokens * out_f * FP8.nbytes * min(usages, copies) + 4
    return Footprint(out, saved=tuple(saved), fwd_temp=fwd_temp, grads=_grads(ins), bwd_temp=bwd_temp,
                     reduced_params=tuple(i for i, p in enumerate(node.params) if p.trainable and i > 0))
