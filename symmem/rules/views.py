"""Inputs and views: graph inputs, the repeated block's carried value, and the
reshapes of attention (split, heads, merge_heads). Views allocate nothing and save
nothing; ``merge_heads`` copies (the reshape of a non-contiguous tensor)."""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import BOOL, F32, F64, I64, DType, Footprint, TensorInfo, _grads, rule

__all__ = ["input_rule", "carry_rule", "recorded_rule", "unbound_rule", "split_rule", "heads_rule", "repeat_kv_rule", "merge_heads_rule"]


@rule("input")
def input_rule(node, ins, ctx):
    """A tensor handed to the model (token ids, labels; no gradient by default), or a buffer of
    the model: ``dtype="param"`` is the parameters' dtype (a floating buffer that
    ``model.to(dtype)`` casts with the weights, and autocast leaves in float32);
    ``dtype="shape"``: sizes only, no tensor (a pipeline stage that receives no batch reads
    them from the tensor it receives)."""
    from ..dtypes import dtype_bytes
    name = node.attr("dtype", "int64")
    known = {"int64": I64, "float32": F32, "bool": BOOL, "float64": F64, "param": ctx.param_dtype,
             "shape": DType("shape", sp.Integer(0), 2)}
    dt = known.get(name) or DType(name, dtype_bytes(name), 2)
    return Footprint(TensorInfo(node.attr("shape"), dt, requires_grad=bool(node.attr("requires_grad"))))


@rule("carry")
def carry_rule(node, ins, ctx):
    """The value a repeated block receives: the same tensor, nothing allocated."""
    return Footprint(ins[0], alias=0, grads=("pass",))


@rule("recorded")
def recorded_rule(node, ins, ctx):
    """A layer's value read again after the layers ran (:meth:`symmem.graph.Graph.recorded`):
    the same tensor, nothing allocated; its gradient is handed to the layer's value. (At build
    time, before the trace hands it the tensor, only its shape is known.)"""
    if not ins:
        return Footprint(TensorInfo(tuple(node.attr("shape")), F32))
    return Footprint(ins[0], alias=0, grads=("pass",))


@rule("unbound")
def unbound_rule(node, ins, ctx):
    """A Python name a loop binds in its first iteration and rebinds in each next one (the
    load-balancing loss's ``_, selected_experts``), as the loop's carried value before it: no
    tensor yet, 0 bytes, of ``shape``."""
    return Footprint(TensorInfo(tuple(node.attr("shape")), DType("unbound", sp.Integer(0), 0), requires_grad=False))


@rule("split")
def split_rule(node, ins, ctx):
    """``x.split(size, dim=-1)[index]``: a view. Backward (SplitBackward) concatenates the
    pieces' gradients into one gradient of the whole input."""
    x = ins[0]
    parts = node.attr("parts")
    last = x.shape[-1]
    rest = last % parts           # symbolic (3h/a % 3): left to the model's requirements
    if rest.is_number and rest != 0:
        raise ShapeError(node.name, x.shape, f"a last dimension divisible by {parts}")
    out = TensorInfo(x.shape[:-1] + (last / parts,), x.dtype, False, x.requires_grad)
    return Footprint(out, alias=0, grads=_grads(ins, "slice"))


@rule("heads")
def heads_rule(node, ins, ctx):
    """``x.view(b, s, a, d).transpose(1, 2)``: (b, s, h) -> (b, a, s, h/a), a view; contiguous
    for one token (s = 1, a decoding step), where the transpose moves a dimension of size 1."""
    x = ins[0]
    a = sp.sympify(node.attr("heads"))
    if len(x.shape) != 3:
        raise ShapeError(node.name, x.shape, "a (batch, sequence, hidden) tensor")
    bb, ss, hh = x.shape
    out = TensorInfo((bb, a, ss, hh / a), x.dtype, sp.sympify(ss) == 1, x.requires_grad)
    return Footprint(out, alias=0, grads=_grads(ins, "pass"))


@rule("repeat_kv")
def repeat_kv_rule(node, ins, ctx):
    """transformers' ``repeat_kv(x, n_rep)`` for grouped-query attention: (b, k, s, d) ->
    (b, k*n_rep, s, d) by ``x[:, :, None].expand(...).reshape(...)``, a contiguous copy (x
    itself when n_rep is 1). Saves nothing; backward sums the n_rep copies' gradients into a
    new gradient of x's size (ExpandBackward). A contiguous x of one head (multi-query
    attention, where a model binds k = 1: the KV cache's tensors) repeats as a view."""
    x = ins[0]
    n = sp.sympify(node.attr("groups"))
    if n == 1:
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    bb, kk, ss, dd = x.shape
    if sp.sympify(kk) == 1 and x.contiguous:     # one kv head: the reshape merges a dimension of size 1,
        # a view with stride 0 over the heads, which matmul's bmm reads without copying (measured)
        return Footprint(TensorInfo((bb, n, ss, dd), x.dtype, True, x.requires_grad), alias=0,
                         grads=_grads(ins, "pass"))
    return Footprint(TensorInfo((bb, kk * n, ss, dd), x.dtype, True, x.requires_grad), grads=_grads(ins))


@rule("merge_heads")
def merge_heads_rule(node, ins, ctx):
    """``x.transpose(1, 2).reshape(b, s, h)``: the transpose is a view, the reshape of a
    non-contiguous tensor copies; a tensor stored sequence-major (a flash kernel's output)
    is contiguous once transposed, so it is a view, as is one token's (s = 1, a decoding step).
    Backward hands the gradient on as views."""
    x = ins[0]
    bb, aa, ss, dd = x.shape
    out = TensorInfo((bb, ss, aa * dd), x.dtype, True, x.requires_grad)
    if x.seq_major or sp.sympify(ss) == 1:
        return Footprint(out, alias=0, grads=_grads(ins, "pass"))
    return Footprint(out, grads=_grads(ins, "pass"))
