"""Linear algebra: linear (``nn.Linear``, GPT-2's ``Conv1D``) and matmul. Autocast
casts all of them to its half dtype on CUDA and on the CPU (``linear``, ``addmm``,
``matmul``: lower_precision_fp lists; see :mod:`symmem.rules.autocast`)."""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import Footprint, Saved, TensorInfo, _grads, _promote, _same, rule

__all__ = ["linear_rule", "matmul_rule"]


@rule("linear")
def linear_rule(node, ins, ctx):
    """``y = x W^T (+ bias)`` (``nn.Linear``) or ``y = x W + bias`` (GPT-2's ``Conv1D``,
    attribute ``conv1d=True``): addmm / mm save the 2-D input (a view of x) and the weight.

    Under autocast (``aten::linear`` and ``aten::addmm`` are on the lower-precision
    list of both devices) the input is cast to the half dtype (that copy is what is
    saved) and so is the weight: the copy is cached for the forward pass, so a parameter
    used twice is cast once, and it is held until backward. The bias is cast too, into
    the same cache, but not saved: its copy lives until forward ends. Backward computes the input
    gradient and the weight gradient in the half dtype and casts them back to float32.

    The bias's gradient is the output's gradient summed over the rows, which the autograd
    engine does when the node's kernels have run (``validate_outputs``), before it releases
    what the node saved (``reduced_params``); under autocast every parameter's gradient
    comes after the node, cast back (``cast_back``), the bias's half-precision one summed
    after the kernels as well (a checkpoint's recomputed input and weight copies are freed
    by then: ``tests/test_vit_measured.py``).

    A frozen weight (``Param.trainable`` False, as LoRA's base layers): autograd saves only
    what the other gradients need (the input only for the weight's gradient, the weight only
    for the input's), so the input is not kept; under autocast its half copy is made for the
    kernel and freed after it. Autocast caches only weights that require grad
    (``cached_cast`` in ``autocast_mode.cpp``): a frozen weight's half copy is made at each
    use, saved where the input's gradient needs it and otherwise freed after the kernel
    (measured: ``tests/test_adapters_measured.py``).
    The gradients are cast back one at a time, each half copy freed before the next cast, in
    reverse order of the casts autocast made: its wrapper casts its arguments right to left, so
    ``addmm(bias, x, weight)`` (``conv1d``) casts back the bias's, the input's, then the weight's
    gradient, ``linear(x, weight, bias)`` the input's, the weight's, then the bias's (measured:
    ``tests/test_gpt2_measured.py``, ``tests/test_random_graphs_measured.py``)."""
    x = ins[0]
    w = node.params[0]
    out_features = w.shape[1] if node.attr("conv1d") else w.shape[0]
    in_features = w.shape[0] if node.attr("conv1d") else w.shape[1]
    if not _same(x.shape[-1], in_features):
        raise ShapeError(node.name, x.shape, f"a last dimension of {in_features}")
    cast = ctx.autocast_dtype("addmm" if node.attr("conv1d") else "linear")
    out = TensorInfo(tuple(x.shape[:-1]) + (out_features,), x.dtype if cast is None else cast)
    trainable = tuple(i for i, p in enumerate(node.params) if p.trainable)
    keep_input = w.trainable              # only the weight's gradient reads the input
    saved, bwd_temp, late, fwd_temp = [], sp.Integer(0), (), sp.Integer(0)
    if cast is not None:
        if not ctx.same(x.dtype, cast):
            if keep_input:
                saved.append(Saved("input (autocast copy)", "new", x.numel, cast))
            else:                         # made for the kernel, freed after it
                fwd_temp = x.numel * cast.nbytes
            if x.requires_grad:
                late = (0,)
                bwd_temp += x.numel * cast.nbytes
        elif keep_input:
            saved.append(Saved("input", "in0"))
        if x.requires_grad:   # addmm keeps the weight only to compute the input's gradient
            saved.append(Saved("weight (autocast copy)", f"cast:{w.name}", w.numel, cast) if w.trainable
                         else Saved("weight (autocast copy)", "new", w.numel, cast))
        # autocast caches the copies of weights that require grad; a frozen one is cast anew
        # each time and freed after the kernel unless saved
        fwd_temp += sum((p.numel for p in node.params if not p.trainable and (p is not w or not x.requires_grad)),
                        sp.Integer(0)) * cast.nbytes
        bwd_temp += sum((node.params[i].numel for i in trainable), sp.Integer(0)) * cast.nbytes
    elif keep_input:
        saved.append(Saved("input", "in0"))
    elif x.requires_grad:                 # a frozen weight, kept for the input's gradient
        saved.append(Saved("weight", "param:0"))
    casts = tuple((p.name, p.numel, cast) for p in node.params if p.trainable) if cast is not None else ()
    back = ()
    if cast is not None:      # the cast-back nodes run in reverse order of the casts' creation
        items = ([("in", 0, x.numel * cast.nbytes)] if late else []) + \
            [("param", i, node.params[i].numel * cast.nbytes) for i in trainable]
        rank = {("param", 1): 0, ("in", 0): 1, ("param", 0): 2} if node.attr("conv1d") else \
            {("in", 0): 0, ("param", 0): 1, ("param", 1): 2}
        back = tuple(sorted(items, key=lambda it: rank[it[:2]]))
    return Footprint(out, saved=tuple(saved), fwd_temp=fwd_temp, grads=_grads(ins), bwd_temp=bwd_temp,
                     casts=casts, cast_back=back,
                     reduced_params=tuple(i for i in trainable if i > 0))


@rule("matmul")
def matmul_rule(node, ins, ctx):
    """``torch.matmul(x, y)`` (or ``x @ y.transpose(-1, -2)`` with ``transpose_b=True``)
    on 4-D tensors: matmul reshapes each operand to 3-D for bmm; a non-contiguous operand
    (a head view (b, a, s, d) of a (b, s, 3h) tensor) is copied, and bmm saves both 3-D
    operands. Under autocast (``aten::matmul``: lower-precision list on both devices) the
    operands are cast to the half dtype first (a copy when they are not). An operand is saved
    only where the other needs a gradient (a frozen key under adapters on the query only).
    At b = 1
    (``ctx.batch_one``) a head view (1, a, s, d) reshapes to (a, s, d) without a copy, and bmm
    saves that view: the storage it views (all of qkv) is kept instead of a copy."""
    x, y = ins
    m, kx = x.shape[-2], x.shape[-1]
    ky, n = (y.shape[-1], y.shape[-2]) if node.attr("transpose_b") else (y.shape[-2], y.shape[-1])
    if not _same(kx, ky):
        raise ShapeError(node.name, (x.shape, y.shape), "inner dimensions that agree")
    dt = ctx.autocast_dtype("matmul")
    if dt is None:
        dt = _promote(x.dtype, y.dtype)
    saved, temp = [], sp.Integer(0)
    for i, (t, label) in enumerate(((x, "left operand"), (y, "right operand"))):
        # a transposed contiguous operand reshapes to 3-D as a view: bmm saves that view;
        # an operand is saved for the other's gradient only (a copy nobody saves is scratch)
        copy = not ctx.same(t.dtype, dt) or not (t.contiguous or ctx.batch_view(t))
        if not ins[1 - i].requires_grad:
            temp += t.numel * dt.nbytes if copy else 0
        elif copy:
            saved.append(Saved(f"{label} (contiguous copy)", "new", t.numel, dt))
        else:
            saved.append(Saved(label, f"in{i}"))
    out = TensorInfo(tuple(x.shape[:-2]) + (m, n), dt)
    return Footprint(out, saved=tuple(saved), fwd_temp=temp, grads=_grads(ins))
