"""Attention: the ``attention`` node a model writes, and the fused SDPA kernels it becomes.

``attention`` is replaced before lowering by the attention pass
(:mod:`symmem.passes.attention`), which reads the policy's kernel; its rule here only
gives the output's shape. What each kernel keeps, from PyTorch 2.13's autograd formulas
(``tools/autograd/derivatives.yaml``) and kernels (``aten/src/ATen/native/transformers``),
measured on the CPU (``tests/test_attention_measured.py``):

- CPU flash (``_scaled_dot_product_flash_attention_for_cpu``): q, k, v, the output and a
  float32 log-sum-exp of (b, a, s); the output is stored as (b, s, a, d);
- CUDA flash (``_scaled_dot_product_flash_attention``): the same, plus its RNG state
  (24 bytes on the GPU);
- CUDA mem-efficient (``_scaled_dot_product_efficient_attention``): the log-sum-exp has
  ``32*ceiling(s/32)`` rows; its seed and offset are host tensors;
- CUDA cuDNN (``_scaled_dot_product_cudnn_attention``): a float32 softmax statistic of
  (b, a, s) and a 16-byte seed and offset.

The CUDA kernels cannot run on the test machine: ``tests/test_attention_measured.py``
states their layouts with the arithmetic, and ``benchmarks/cuda_check.py`` measures them
where a GPU is at hand.
"""
from __future__ import annotations

import sympy as sp

from ..errors import ConfigError, ShapeError
from .core import F32, DType, Footprint, Saved, TensorInfo, _grads, _promote, _same, rule

BYTE = DType("uint8", sp.Integer(1), 0)

__all__ = ["attention_rule", "sdpa_kernel_rule", "sdpa_causal_mask_rule", "RNG_BYTES", "backward_scratch"]


def _qkv(node, ins):
    q, k, v = ins[:3]
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise ShapeError(node.name, (q.shape, k.shape, v.shape), "(batch, heads, sequence, head_dim) q, k and v")
    if not _same(q.shape[-1], k.shape[-1]):
        raise ShapeError(node.name, (q.shape, k.shape), "q and k with the same head dimension")
    return q, k, v


@rule("attention")
def attention_rule(node, ins, ctx):
    """``softmax(q k^T * scale + mask) v`` with dropout: the (b, a, s, d) context. A
    placeholder for the kernel the attention pass puts in its place; it saves nothing
    itself and never reaches the counter."""
    q, k, v = _qkv(node, ins)
    return Footprint(TensorInfo(tuple(q.shape[:-1]) + (v.shape[-1],), _promote(q.dtype, v.dtype), True,
                                q.requires_grad or k.requires_grad or v.requires_grad),
                     grads=_grads(ins))


def _round(x, m):
    """``x`` rounded up to a multiple of ``m``."""
    return m * sp.ceiling(sp.sympify(x) / m)


#: Device bytes of the RNG state each CUDA kernel saves (flash: ``rng_state`` (2,) and
#: ``unused`` () uint64 on the GPU, allocated with or without dropout; cuDNN: seed and
#: offset, 0-dim int64 on the GPU; mem-efficient: seed and offset on the host).
RNG_BYTES = {"flash": 24, "cudnn": 16, "mem-efficient": 0}


@rule("sdpa_kernel")
def sdpa_kernel_rule(node, ins, ctx):
    """A fused SDPA kernel (attribute ``kernel``: flash, mem-efficient or cudnn) on q, k,
    v of shape (b, a, s, d): saves q, k, v and its output (no new memory) and its float32
    softmax statistic, made by the kernel: (b, a, s) for flash and cuDNN,
    (b, a, 32*ceiling(s/32)) for mem-efficient; on CUDA also its RNG state
    (:data:`RNG_BYTES`). The output is written as (b, s, a, d) (flash: q's layout, which
    Hugging Face's head views give; a contiguous q gives a contiguous output), so merging the
    heads back is a view. Under autocast
    (``scaled_dot_product_attention`` is on the lower-precision list of both devices) the
    inputs arrive in the half dtype from the projections; an input in another dtype is
    copied (the copy is kept, its gradient cast back after the kernel).

    Backward, besides the gradients of q, k and v (``derivatives.yaml``; the kernels'
    sources in ``aten/src/ATen/native/transformers/cuda``):

    - CUDA flash (``mha_bwd``): ``dq_accum`` (b, 128*ceiling(s/128), a, d_r) and
      ``softmax_d`` (b, a, 128*ceiling(s/128)), float32, with d_r the head dimension
      rounded up to 32 (64 above 128);
    - CUDA mem-efficient: ``delta`` (b, a, s) and a float32 dQ accumulator of
      (b, a, s, d) in its workspace (the workspace's own rounding to its blocks is not
      counted; for float32 inputs the grad_out*out product that makes delta has the
      accumulator's size and is freed before it);
    - CUDA cuDNN: its workspace, whose size cuDNN decides at run time: not counted;
    - CPU flash: per-thread blocks, not counted (a few hundred KiB whatever the sizes).

    Not counted either: FlashAttention's split-KV scratch in forward, used only without
    dropout when b*a*ceiling(s/64) is below 1.6 times the GPU's multiprocessors (small
    batches), and the padded copies of q, k and v it makes when d is not a multiple of
    8 (the attention pass requires 8 | d instead).

    A fourth input is a float ``attn_mask`` (a sliding window's, converted by SDPA:
    :mod:`symmem.rules.masks`): CPU flash saves it; CUDA's mem-efficient kernel saves it as
    ``attn_bias``, its last dimension padded to a multiple of 16 (``preprocess_mask`` in
    ``attention.cpp``; derived, not measured), unless attribute ``aligned`` says the pass
    requires 16 | s_k. A mask that requires grad (T5's position bias) gets a gradient of its
    (b, a, s_q, s_k) shape from the kernel (``_efficient_attention_backward``'s ``grad_bias``)."""
    q, k, v = _qkv(node, ins)
    kernel = node.attr("kernel")
    bb, aa, ss, dd = q.shape
    rows = ss if kernel != "mem-efficient" else _round(ss, 32)
    cast = ctx.autocast_dtype("scaled_dot_product_attention")
    dt = cast or q.dtype
    saved, late, bwd_temp = [], [], sp.Integer(0)      # late: the cast-back of q, k, v's gradients
    for i, (t, label) in enumerate(zip((q, k, v), ("query", "key", "value"))):
        if ctx.same(t.dtype, dt):
            saved.append(Saved(label, f"in{i}"))
        elif cast is not None:            # autocast's copy is what the kernel gets and keeps
            saved.append(Saved(f"{label} (autocast copy)", "new", t.numel, dt))
            if t.requires_grad:
                late.append(("in", i, t.numel * dt.nbytes))
                bwd_temp += t.numel * dt.nbytes
        else:
            raise ConfigError(f"input of {node.name!r}", t.dtype.name, f"q, k and v in one dtype ({dt.name})")
    saved += [Saved("output", "out"), Saved("log-sum-exp", "new", bb * aa * rows, F32, after=True)]
    fwd_temp = sp.Integer(0)
    if len(ins) > 3:                      # a float attn_mask (b, 1, s, s_k): kept for backward
        m = ins[3]
        if kernel != "mem-efficient" or node.attr("aligned"):   # aligned: 16 | s_k, required
            saved.append(Saved("attention mask", "in3"))
        else:
            # preprocess_mask: a last dimension not a multiple of 16 is padded (pad_bias: a new
            # tensor, the unpadded mask freed when SDPA returns); the padded one is kept. As
            # bytes: the mask kept, the padding's columns new, and during the kernel the
            # unpadded mask beside the padded one when 16 does not divide s_k (ceiling - floor).
            cols = m.shape[-1]
            saved += [Saved("attention mask", "in3"),
                      Saved("attention mask padding", "new", m.numel / cols * (_round(cols, 16) - cols), m.dtype)]
            fwd_temp = m.numel * m.dtype.nbytes * (sp.ceiling(cols / 16) - sp.floor(cols / 16))
    if ctx.device == "cuda" and RNG_BYTES[kernel]:
        saved.append(Saved("RNG state", "new", sp.Integer(RNG_BYTES[kernel]), BYTE, after=True))
    bwd_temp += backward_scratch(kernel, ctx.device, q.shape)
    # flash writes its output in q's layout: sequence-major for a head view, (b, a, s, d) for a
    # contiguous q (GPT-NeoX's partially rotated one), which merging the heads then copies; so
    # does context parallelism's ring on every rank but the last, whose merged output is a
    # concatenation of its two half-chunks (symmem.passes.context)
    seq_major = (kernel != "flash" or not q.contiguous) and not ctx.ring
    out = TensorInfo(tuple(q.shape[:-1]) + (v.shape[-1],), dt, not seq_major, True, seq_major=seq_major)
    # autocast casts q, k, v right to left, so their cast-backs run q, k, v (as linear's do)
    return Footprint(out, saved=tuple(saved), grads=_grads(ins), fwd_temp=fwd_temp, bwd_temp=bwd_temp,
                     cast_back=tuple(late))


def backward_scratch(kernel: str, device: str, shape) -> sp.Expr:
    """The float32 scratch of a fused kernel's backward on q of ``shape`` (b, a, s, d)
    (:func:`sdpa_kernel_rule`): CUDA flash's ``dq_accum`` and ``softmax_d``, CUDA
    mem-efficient's ``delta`` and dQ accumulator; none counted for cuDNN and the CPU."""
    bb, aa, ss, dd = shape
    if device != "cuda":
        return sp.Integer(0)
    if kernel == "flash":
        d_r = _round(dd, 32) if not (sp.sympify(dd).is_number and dd > 128) else _round(dd, 64)
        return 4 * bb * _round(ss, 128) * aa * (d_r + 1)
    if kernel == "mem-efficient":
        return 4 * bb * aa * ss * (dd + 1)
    return sp.Integer(0)


@rule("sdpa_causal_mask")
def sdpa_causal_mask_rule(node, ins, ctx):
    """The math kernel's causal mask for ``is_causal=True``: ``ones(s, s, bool).tril()``
    turned into an additive (s, s) mask in q's dtype (0 or -inf); the boolean triangle
    (s^2 bytes) exists while it is made."""
    q = ins[0]
    ss = q.shape[-2]
    return Footprint(TensorInfo((ss, ss), q.dtype, True, False), fwd_temp=ss * ss, grads=(None,))
