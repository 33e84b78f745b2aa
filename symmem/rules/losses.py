"""Losses: nll_loss (the second half of cross-entropy; the first, log_softmax, is in
:mod:`symmem.rules.normalization`). ``aten::nll_loss`` is on the fp32 list of both
devices (see :mod:`symmem.rules.autocast`). The reductions of the load-balancing loss
(transformers' ``load_balancing_loss_func``, ``models/mixtral/modeling_mixtral.py``):
``sum.dim_IntList`` and ``sum`` are on CUDA autocast's fp32_set_opt_dtype list and on none of
the CPU's."""
from __future__ import annotations

import sympy as sp

from .core import I64, Footprint, Saved, TensorInfo, _grads, rule

__all__ = ["nll_loss_rule", "pad_labels_rule", "shift_labels_rule", "sum_rows_rule", "sum_all_rule"]


@rule("pad_labels")
def pad_labels_rule(node, ins, ctx):
    """``F.pad(labels, (0, 1), value=-100)``, the first half of Hugging Face's label shift
    (``ForCausalLMLoss``): a new int64 tensor one column wider, (..., s + 1)."""
    x = ins[0]
    return Footprint(TensorInfo(tuple(x.shape[:-1]) + (x.shape[-1] + 1,), x.dtype, requires_grad=False),
                     grads=(None,))


@rule("shift_labels")
def shift_labels_rule(node, ins, ctx):
    """``padded[..., 1:].contiguous()``: the labels of the next tokens, a new int64 tensor
    (..., s). At b = 1 (``ctx.batch_one``) the slice of the (1, s + 1) labels is contiguous
    already, so ``.contiguous()`` returns it: a view of the padded labels."""
    x = ins[0]
    out = TensorInfo(tuple(x.shape[:-1]) + (x.shape[-1] - 1,), x.dtype, requires_grad=False)
    return Footprint(out, alias=0 if ctx.batch_view(x) else None, grads=(None,))


@rule("nll_loss")
def nll_loss_rule(node, ins, ctx):
    """``F.nll_loss(logp.view(-1, V), labels)``, mean over tokens, with Hugging Face's
    label shift (``pad`` then ``[..., 1:]``: a new int64 copy of the labels, saved as the
    target; with ``shifted=True`` the labels input is already that copy). NllLossBackward saves logp, the target and a 0-dim total weight (in the loss's dtype).
    Backward allocates a zero gradient of logp's size and scatters into it.
    Under autocast (CUDA and CPU: fp32 list) a float32 copy of half log-probabilities is
    what is saved, its float32 gradient is cast back after the op's backward, and the
    loss is float32.
    At b = 1 (``ctx.batch_one``) the shifted slice is already contiguous, so the saved target
    is a view of the padded labels: the b(s + 1) padded elements are kept, no copy is made."""
    logp, labels = ins
    rows = labels.numel
    cast = ctx.autocast_dtype("nll_loss")
    if cast is not None and not ctx.same(logp.dtype, cast):
        first = Saved(f"log-probabilities ({cast.name} copy)", "new", logp.numel, cast)
        bwd_temp = logp.numel * cast.nbytes     # its float32 gradient, then cast back
    else:
        first, bwd_temp = Saved("log-probabilities", "in0"), sp.Integer(0)
    if node.attr("shifted"):     # the labels come shifted (pad_labels, shift_labels nodes)
        target, padded = Saved("labels", "in1"), sp.Integer(0)
    elif ctx.batch_view(labels):          # the padded labels, viewed
        padded = labels.numel / labels.shape[-1] * (labels.shape[-1] + 1)
        target, padded = Saved("padded labels (viewed)", "new", padded, I64), sp.Integer(0)
    else:
        target = Saved("shifted labels", "new", rows, I64)
        padded = labels.numel / labels.shape[-1] * (labels.shape[-1] + 1) * I64.nbytes
    out_dt = logp.dtype if cast is None else cast
    # the total weight has the dtype the loss is computed in (bfloat16 for a bfloat16 model's
    # F.cross_entropy; float32 after Hugging Face's logits.float())
    saved = (first, target, Saved("total weight", "new", sp.Integer(1), out_dt, after=True))
    return Footprint(TensorInfo((), out_dt), saved=saved, fwd_temp=padded,
                     grads=_grads(ins), bwd_temp=bwd_temp, cast_back=(("in", 0, bwd_temp),) if bwd_temp != 0 else ())


@rule("sum_rows")
def sum_rows_rule(node, ins, ctx):
    """``x.sum(dim=0)`` of x (N, E) (``routing_weights.float().sum(dim=0)``, the router's
    probabilities summed over the tokens, ``modeling_mixtral.py`` line 530): a new (E,) tensor,
    in float32 under CUDA autocast, else in x's dtype. SumBackward1 keeps sizes only; x's
    gradient is the output's expanded (a view)."""
    x = ins[0]
    dt = ctx.autocast_dtype("sum.dim_IntList") or x.dtype
    return Footprint(TensorInfo(tuple(x.shape[1:]), dt, True, x.requires_grad), grads=_grads(ins, "pass"))


@rule("sum_all")
def sum_all_rule(node, ins, ctx):
    """``torch.sum(x)`` (the load-balancing loss's ``torch.sum(tokens_per_expert *
    router_prob_per_expert.unsqueeze(0))``, line 543): a new 0-dim tensor, in float32 under
    CUDA autocast, else in x's dtype. SumBackward0 keeps sizes only; x's gradient is the
    output's expanded (a view)."""
    x = ins[0]
    dt = ctx.autocast_dtype("sum") or x.dtype
    return Footprint(TensorInfo((), dt, True, x.requires_grad), grads=_grads(ins, "pass"))
