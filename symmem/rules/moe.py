"""Mixture-of-experts ops: the router's top-k and the renormalisation of its weights, the
integer bookkeeping of the dispatch, row gathers, grouped matrix products and the sum over
the K experts of a token, as transformers 5 runs them (``MixtralTopKRouter`` in
``models/mixtral/modeling_mixtral.py``, ``grouped_mm_experts_forward`` and
``batched_mm_experts_forward`` in ``integrations/moe.py``: the latter's repeated rows,
gathered expert weights and batched products), plus a reshape that is a view. Of the aten ops
here only ``bmm`` is on an autocast list of PyTorch 2.13 (``topk``, ``sort``, ``histc``,
``index``, ``repeat_interleave``, ``_grouped_mm`` are not: checked against
``torch._C._dispatch_get_registrations_for_dispatch_key``): the others run in their inputs'
dtypes.

Notation: N = b s tokens, S = N K (token, expert) pairs, E experts, h and f the hidden and
intermediate sizes. The saved tensors were read off ``derivatives.yaml`` and checked with
saved-tensor hooks on the CPU (``tests/test_mixtral_measured.py``)."""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import BOOL, F32, I64, DType, Footprint, Saved, TensorInfo, _grads, _promote, _same, rule

__all__ = ["reshape_rule", "topk_indices_rule", "topk_rule", "sum_last_rule", "div_inplace_rule",
           "index_tensor_rule", "gather_rows_rule", "grouped_mm_rule", "sum_topk_rule", "all_to_all_rule",
           "masked_fill_rule", "repeat_rows_rule", "gather_param_rule", "batched_linear_rule"]

_INT32 = DType("int32", sp.Integer(4), 0)
_DTYPES = {"int64": I64, "int32": _INT32, "float32": F32, "bool": BOOL}


def _numel(shape) -> sp.Expr:
    return sp.Mul(*shape) if shape else sp.Integer(1)


@rule("reshape")
def reshape_rule(node, ins, ctx):
    """``x.view(shape)`` / ``x.reshape(shape)`` / ``x.unsqueeze(-1)`` of a contiguous x: a
    view, nothing allocated or saved; backward reshapes the gradient (a view too)."""
    x = ins[0]
    shape = tuple(sp.sympify(d) for d in node.attr("shape"))
    if sp.expand(_numel(shape) - x.numel) != 0:
        raise ShapeError(node.name, x.shape, f"as many elements as {shape}")
    if not x.contiguous:
        raise ShapeError(node.name, x.shape, "a contiguous tensor (reshaping another copies it)")
    return Footprint(TensorInfo(shape, x.dtype, True, x.requires_grad), alias=0, grads=_grads(ins, "pass"))


@rule("topk_indices")
def topk_indices_rule(node, ins, ctx):
    """The indices ``torch.topk(p, K, dim=-1)`` returns: (rows, K) int64, no gradient. The
    values are the ``topk`` node that reads them (one kernel makes both)."""
    p = ins[0]
    k = sp.sympify(node.attr("k"))
    return Footprint(TensorInfo(tuple(p.shape[:-1]) + (k,), I64, True, False), grads=(None,))


@rule("topk")
def topk_rule(node, ins, ctx):
    """The values of ``torch.topk(p, K, dim=-1)`` (inputs: p and the ``topk_indices`` node):
    TopkBackward0 saves the indices (no new memory); backward scatters the gradient into a
    new zero tensor of p's shape. ``discarded=True``: values bound to ``_`` and never used
    (``_, selected_experts = torch.topk(...)`` in transformers' ``load_balancing_loss_func``):
    no gradient reaches them, and the TopkBackward0 node, referenced by them alone, goes with
    them, so nothing is held for backward (the indices live as long as their own name)."""
    p, idx = ins
    if node.attr("discarded"):
        return Footprint(TensorInfo(idx.shape, p.dtype, True, False), grads=(None, None))
    return Footprint(TensorInfo(idx.shape, p.dtype, True, p.requires_grad),
                     saved=(Saved("topk indices", "in1"),), grads=(_grads([p])[0], None))


@rule("sum_last")
def sum_last_rule(node, ins, ctx):
    """``x.sum(dim=-1, keepdim=True)``: saves nothing (SumBackward1 keeps sizes only); the
    input's gradient is the output's, expanded (a view)."""
    x = ins[0]
    return Footprint(TensorInfo(tuple(x.shape[:-1]) + (1,), x.dtype, True, x.requires_grad),
                     grads=_grads(ins, "pass"))


@rule("div_inplace")
def div_inplace_rule(node, ins, ctx):
    """``x /= y`` (the router's renormalisation ``router_top_value /= router_top_value.sum(-1,
    keepdim=True)``), in x's storage. DivBackward0 needs x as it was and y for y's gradient:
    autograd saves y (no new memory) and a copy of x made before the kernel overwrites it
    (``original_self`` in the generated in-place code)."""
    x, y = ins
    saved = (Saved("divisor", "in1"),)
    if y.requires_grad:
        saved += (Saved("dividend (copy before the in-place division)", "new", x.numel, x.dtype),)
    return Footprint(TensorInfo(x.shape, x.dtype, x.contiguous, x.requires_grad or y.requires_grad),
                     alias=0, saved=saved, grads=_grads(ins))


@rule("index_tensor")
def index_tensor_rule(node, ins, ctx):
    """A tensor of the dispatch's bookkeeping, without gradient: ``torch.sort``'s values or
    permutation, ``perm // K``, ``histc``'s input and counts, ``cumsum``'s offsets, the inverse
    permutation, an expert-parallel sentinel mask; the load-balancing loss's ``torch.zeros``
    (no input), counts and their fraction ``tokens_per_expert_sum / total_rows`` (a Python
    number, wrapped in a 0-dim tensor that no dispatcher sees and nothing keeps). Attributes ``shape`` and ``dtype`` (int64,
    int32, float32, bool, or ``like``: the first input's); ``temp``: bytes the op holds while it
    runs (the ``torch.arange`` written into the inverse permutation)."""
    shape = tuple(sp.sympify(d) for d in node.attr("shape"))
    name = node.attr("dtype", "int64")
    dtype = ins[0].dtype if name == "like" else _DTYPES[name]
    return Footprint(TensorInfo(shape, dtype, True, False),
                     fwd_temp=sp.sympify(node.attr("temp", 0)), grads=tuple(None for _ in ins))


@rule("gather_rows")
def gather_rows_rule(node, ins, ctx):
    """``x[idx]`` for a 1-D int64 idx of length S: a new (S, ...) tensor in x's dtype.
    IndexBackward0 saves the indices (no new memory); backward makes x's gradient from a new
    zero tensor of x's shape, out of place (``zeros.index_put(indices, grad, accumulate=True)``):
    the zeros beside it while it runs (measured)."""
    x, idx = ins
    if len(idx.shape) != 1:
        raise ShapeError(node.name, idx.shape, "a 1-D index")
    out = TensorInfo(tuple(idx.shape) + tuple(x.shape[1:]), x.dtype, True, x.requires_grad)
    saved = (Saved("index", "in1"),) if x.requires_grad else ()
    return Footprint(out, saved=saved, grads=(_grads([x])[0], None), bwd_temp=x.nbytes if x.requires_grad else 0)


@rule("grouped_mm")
def grouped_mm_rule(node, ins, ctx):
    """transformers' ``_grouped_linear(x, W, offs)``: ``F.grouped_mm(x.to(W.dtype),
    W.transpose(-2, -1), offs=offs)`` for x (S, in) sorted by expert, W (E, out, in) and the
    cumulative counts offs (E,) int32: each expert's rows times its own matrix, (S, out).
    GroupedMmBackward0 saves x, the weight (a view of the parameter) and offs: no new memory,
    whatever the tokens per expert. Backward makes x's gradient (S, in) and the weight's (E,
    in, out), the gradient of the transposed view, which AccumulateGrad keeps as the
    parameter's gradient: dense, so no copy into the parameter's layout (measured)."""
    x, offs = ins
    w = node.params[0]
    if sp.expand(x.shape[-1] - w.shape[2]) != 0:
        raise ShapeError(node.name, x.shape, f"a last dimension of {w.shape[2]}")
    dt = ctx.param_dtype
    saved = (Saved("input", "in0") if ctx.same(x.dtype, dt) else Saved("input (copy)", "new", x.numel, dt),
             Saved("weight", "param:0"), Saved("offsets", "in1"))
    return Footprint(TensorInfo((x.shape[0], w.shape[1]), dt, True, True), saved=saved,
                     grads=(_grads([x])[0], None))


@rule("sum_topk")
def sum_topk_rule(node, ins, ctx):
    """``y.view(N, K, h).sum(dim=1)`` for y (S, h) with S = N K: a new (N, h) tensor; saves
    nothing. Backward expands the gradient (a view) and ViewBackward0 reshapes it to (S, h):
    the expanded tensor is not contiguous, so that is a copy, y's gradient."""
    y = ins[0]
    k = sp.sympify(node.attr("k"))
    return Footprint(TensorInfo((y.shape[0] / k,) + tuple(y.shape[1:]), y.dtype, True, y.requires_grad),
                     grads=_grads(ins))


@rule("all_to_all")
def all_to_all_rule(node, ins, ctx):
    """``all_to_all_single_autograd(x, output_split_sizes, input_split_sizes)`` of the rows of
    x (S, ...): a new (``rows``, ...) tensor of the rows the other ranks send (transformers'
    expert-parallel dispatch and combine). Saves nothing; backward sends the gradient's rows
    back, x's gradient a new (S, ...) tensor."""
    x = ins[0]
    rows = sp.sympify(node.attr("rows"))
    return Footprint(TensorInfo((rows,) + tuple(x.shape[1:]), x.dtype, True, x.requires_grad), grads=_grads(ins))


@rule("masked_fill")
def masked_fill_rule(node, ins, ctx):
    """``x.masked_fill(mask, 0)`` (a new tensor) or, with ``inplace``, ``x.masked_fill_(mask,
    0)`` in x's storage: MaskedFillBackward0 saves the mask (no new memory); x's gradient is
    the output's with the masked rows zeroed, a new tensor."""
    x, mask = ins
    saved = (Saved("mask", "in1"),) if x.requires_grad else ()
    out = TensorInfo(x.shape, x.dtype, x.contiguous if node.attr("inplace") else True, x.requires_grad)
    return Footprint(out, alias=0 if node.attr("inplace") else None, saved=saved, grads=(_grads([x])[0], None))


@rule("repeat_rows")
def repeat_rows_rule(node, ins, ctx):
    """``x.repeat_interleave(K, dim=0)`` of x (N, h): a new (N K, h) tensor, each row K times
    in a row (transformers' ``batched_mm_experts_forward``). Saves nothing; backward sums
    each row's K copies, x's gradient a new (N, h) tensor."""
    x = ins[0]
    k = sp.sympify(node.attr("k"))
    return Footprint(TensorInfo((x.shape[0] * k,) + tuple(x.shape[1:]), x.dtype, True, x.requires_grad),
                     grads=_grads(ins))


@rule("gather_param")
def gather_param_rule(node, ins, ctx):
    """``W[idx]`` for the parameter W (E, ...) and a 1-D int64 idx of length S: a new (S, ...)
    copy of the rows in W's dtype (``self.gate_up_proj[expert_ids]`` in transformers'
    ``batched_mm_experts_forward``). IndexBackward0 saves the indices (no new memory);
    backward makes a zero tensor of W's shape and W's gradient from it, out of place
    (``zeros.index_put(indices, grad, accumulate=True)``): two tensors of W's size while it
    runs, the zeros freed after it (measured)."""
    idx = ins[0]
    (w,) = node.params
    if len(idx.shape) != 1:
        raise ShapeError(node.name, idx.shape, "a 1-D index")
    return Footprint(TensorInfo(tuple(idx.shape) + tuple(w.shape[1:]), ctx.param_dtype),
                     saved=(Saved("index", "in0"),), grads=(None,), bwd_temp=w.numel * ctx.param_dtype.nbytes)


@rule("batched_linear")
def batched_linear_rule(node, ins, ctx):
    """transformers' ``_batched_linear(x, W)``: ``torch.bmm(W, x.unsqueeze(-1)).squeeze(-1)``
    for x (S, in) and W (S, out, in), one matrix a row (``integrations/moe.py``): a new (S,
    out) tensor. BmmBackward0 saves both operands: no new memory, or under autocast (``bmm``
    is on the lower-precision lists) their half copies, made for the kernel. Backward makes
    both gradients, new; under autocast in the half dtype, then each cast back to its
    operand's dtype, the weight's first (autocast cast the input first)."""
    x, w = ins
    if len(w.shape) != 3 or not _same(x.shape[-1], w.shape[2]):
        raise ShapeError(node.name, (x.shape, w.shape), "x (S, in) and W (S, out, in)")
    cast = ctx.autocast_dtype("bmm")
    dt = _promote(x.dtype, w.dtype) if cast is None else cast
    saved, back = [], []
    for i, (t, label) in reversed(list(enumerate(((x, "input"), (w, "weights"))))):
        if ctx.same(t.dtype, dt):
            saved.append(Saved(label, f"in{i}"))
        else:
            saved.append(Saved(f"{label} (autocast copy)", "new", t.numel, dt))
            back.append(("in", i, t.numel * dt.nbytes))
    return Footprint(TensorInfo((x.shape[0], w.shape[1]), dt), saved=tuple(saved), grads=_grads(ins),
                     bwd_temp=sum((nbytes for _, _, nbytes in back), sp.Integer(0)), cast_back=tuple(back))
