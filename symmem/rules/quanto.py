"""transformers' ``QuantizedCache(backend="quanto")``: ``QuantoQuantizedLayer`` (transformers
5.25 ``cache_utils.py``) quantizing keys and values with optimum-quanto 0.2.7's ``MaxOptimizer``
and ``quantize_weight`` along axis 0 (the layer's default ``axis_key = axis_value = 0``), in
groups of ``q_group_size`` (g) elements.

A (b, k, T, d) tensor of N elements is grouped as ``reshape(-1, g)`` (``tensor/grouped.py``: a
view), rows = N / g groups; the quantized tensor (a ``WeightQBitsTensor``; never its AWQ or
TinyGemm subclasses, which take 2-D weights only) holds:

- ``_scale`` and ``_shift``: (rows, 1) each in the states' dtype (B bytes): S = B·rows bytes;
- ``_data``: a ``PackedTensor`` of the (rows, g) uint8 codes, 8 / bits of them a byte along the
  rows (``tensor/packed.py`` ``pack_weights``): ceil(rows / (8 / bits)) · g bytes (P).

``quanto::quantize_affine`` and ``quanto::unpack`` are single operators (their scratch inside
them is not counted, as no operator's is); the CPU's ``unpack`` is the C++ extension's, CUDA's
its CUDA extension's, both returning the (8 / bits) · ceil(rows / (8 / bits)) rows unpacked.
"""
from __future__ import annotations

import sympy as sp

from .core import DType, Footprint, TensorInfo, rule

__all__ = ["U8", "quanto_rows", "quanto_packed", "quanto_bytes", "quanto_quantize_rule", "quanto_dequantize_rule",
           "quanto_cat_rule", "quanto_kept_rule"]

U8 = DType("uint8", sp.Integer(1), 0)


def quanto_rows(numel, group) -> sp.Expr:
    """The groups of a tensor of ``numel`` elements: ``group(base, axis=0, group_size)`` is
    ``base.reshape([-1, group_size])``."""
    return sp.sympify(numel) / group


def quanto_packed(numel, group, bits) -> sp.Expr:
    """Bytes of the packed codes: ``pack_weights`` makes ``torch.zeros((row_dim, g), uint8)``,
    row_dim = ceil(rows / (8 / bits)) (P)."""
    return sp.ceiling(quanto_rows(numel, group) * bits / 8) * group


def quanto_bytes(x: TensorInfo, group, bits) -> sp.Expr:
    """A quantized tensor's bytes for states ``x``: its packed codes (P) and its scale and
    shift (rows values each in x's dtype)."""
    return quanto_packed(x.numel, group, bits) + 2 * quanto_rows(x.numel, group) * x.dtype.nbytes


@rule("kv_quanto_quantize")
def quanto_quantize_rule(node, ins, ctx):
    """``QuantoQuantizedLayer._quantize(tensor.contiguous(), axis=0)`` of states x (N
    elements, B bytes each; attributes ``group`` g and ``bits``): the quantized tensor, as one
    uint8 tensor of its bytes (:func:`quanto_bytes`, 2S + P). Moments beyond the input
    (``.contiguous()`` copies a non-contiguous x: N·B more throughout):

    - ``MaxOptimizer``: ``rmin = amin``, ``rmax = amax`` (S each), ``rmax - rmin`` (S) and its
      quotient, the scale (S): 4S; then the shift ``-rmin`` once the difference is gone; rmin
      and rmax freed when it returns (2S);
    - ``quantize_affine``'s (rows, g) uint8 codes (N), ``pack_weights``' zeros (P) and
      ``unpacked[start:end] << bits·i`` (at most row_dim · g = P bytes, freed at each
      ``|=``): 2S + N + 2P; the codes freed when ``WeightsQBitsQuantizer.forward`` returns.

    Scratch beyond the output: max(2S - P, N + P) (+ N·B). Input: the states (b, k, T, d)."""
    (x,) = ins
    g, bits = node.attr("group"), node.attr("bits")
    n, rows = x.numel, quanto_rows(x.numel, g)
    p, s = quanto_packed(n, g, bits), rows * x.dtype.nbytes
    copy = 0 if x.contiguous else n * x.dtype.nbytes
    return Footprint(TensorInfo((quanto_bytes(x, g, bits),), U8, requires_grad=False), grads=(None,),
                     fwd_temp=sp.Max(2 * s - p, n + p) + copy)


@rule("kv_quanto_dequantize")
def quanto_dequantize_rule(node, ins, ctx):
    """``QBitsTensor.dequantize()`` (``QBitsDequantizer.forward``) of a cache's quantized
    tensor of the node's (b, k, T, d) positions: ``quanto::unpack`` makes (8 / bits) · row_dim
    rows of g uint8 codes (U bytes, its first rows the codes, a view), ``t._scale * data`` the
    (rows, g) result in the states' dtype, ``dqt -= shift`` in place, ``ungroup`` a view:
    (b, k, T, d) in B bytes an element, with U of scratch beside it (the codes die when
    forward returns). Attributes ``group``, ``bits``; input: the step's new states (b, k, 1,
    d) (their dtype; the quantized tensor was made before the step)."""
    (states,) = ins
    g, bits = node.attr("group"), node.attr("bits")
    shape = tuple(sp.sympify(d) for d in node.shape)
    n = sp.Mul(*shape)
    return Footprint(TensorInfo(shape, states.dtype, requires_grad=False), grads=(None,),
                     fwd_temp=quanto_packed(n, g, bits) * 8 / bits)


@rule("kv_quanto_cat")
def quanto_cat_rule(node, ins, ctx):
    """``torch.cat([dequant_keys, self.keys, key_states], dim=-2)`` (the same for the values):
    the (b, k, T, d) keys (values) ``update`` returns (the node's shape; T = s + n_g), in the
    new states' dtype. Inputs: the dequantized cache, the new states (b, k, 1, d). With
    attribute ``residual``: ``self.keys = torch.cat([self.keys, key_states], dim=-2)``, the
    residual of P + 1 positions (input: the new states; the previous residual is freed by the
    inference pass)."""
    states = ins[-1]
    return Footprint(TensorInfo(tuple(sp.sympify(d) for d in node.shape), states.dtype, requires_grad=False),
                     grads=(None,) * len(ins))


@rule("kv_quanto_kept")
def quanto_kept_rule(node, ins, ctx):
    """A decoding step that does not re-quantize keeps the cache's quantized tensor of the
    node's (b, k, T, d) positions as it was (:func:`quanto_bytes`; the inference pass frees
    the previous one just before, so nothing is allocated). Attributes ``group``, ``bits``;
    input: the step's new states (their dtype)."""
    (states,) = ins
    x = TensorInfo(tuple(sp.sympify(d) for d in node.shape), states.dtype)
    return Footprint(TensorInfo((quanto_bytes(x, node.attr("group"), node.attr("bits")),), U8,
                                requires_grad=False), grads=(None,))
