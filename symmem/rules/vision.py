"""Convolutional vision ops: conv2d, batch_norm, relu_ (in place), max_pool2d, mean_pool
(``adaptive_avg_pool2d`` to 1 x 1), flatten, and the two halves of ``F.cross_entropy`` that
differ from a causal LM's loss (ce_input, ce_log_softmax; the third half is
:func:`~symmem.rules.losses.nll_loss_rule`); and the vision transformer's patch tokens,
class-token concatenation, position-embedding add and class-token selection.

Shapes are NCHW, (b, C, H, W). A convolution or pooling window of size k, stride st and
padding p gives ``floor((x + 2p - k)/st) + 1`` outputs along a side of x; with the attribute
``exact=True`` the model promises that st divides x (ResNet requires H and W divisible by 32),
and the rule writes the same value without ``floor``: ``x/st + floor((2p - k)/st) + 1``
(``floor((x + c)/st) = x/st + floor(c/st)`` when x/st is an integer).

Autocast (see :mod:`symmem.rules.autocast`): ``conv2d`` is on the lower-precision list of
both devices; ``batch_norm``, ``max_pool2d``, ``mean`` and ``relu`` are on neither (they run in
their input's dtype; a half input with float32 batch-norm weights is allowed and gives a half
output); ``cross_entropy_loss`` is on CPU autocast's fp32 list only.

Every saved tensor below was read off ``derivatives.yaml`` and checked with saved-tensor hooks
on the CPU (``tests/test_vision_rules.py``).
"""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import F32, I64, Footprint, Saved, TensorInfo, _grads, _promote, _same, rule

__all__ = ["conv2d_rule", "batch_norm_rule", "relu_inplace_rule", "max_pool2d_rule", "mean_pool_rule",
           "flatten_rule", "ce_input_rule", "ce_log_softmax_rule", "patch_tokens_rule", "cls_concat_rule",
           "add_param_rule", "select_token_rule", "window_out"]


def window_out(x, k, stride, padding, exact: bool = False) -> sp.Expr:
    """Outputs along one side of length ``x`` of a window ``k`` wide, moved by ``stride``, over
    ``padding`` zeros each side (``torch.nn.Conv2d``'s and ``MaxPool2d``'s shape formula, dilation
    1): ``floor((x + 2p - k)/stride) + 1``; ``exact``: stride divides x, so it is
    ``x/stride + floor((2p - k)/stride) + 1``."""
    x = sp.sympify(x)
    if exact:
        return sp.expand(x / stride + sp.floor(sp.sympify(2 * padding - k) / stride) + 1)
    return sp.floor((x + 2 * padding - k) / sp.Integer(stride)) + 1


def _spatial(node, x: TensorInfo, k: int) -> tuple:
    stride, padding, exact = node.attr("stride", 1), node.attr("padding", 0), node.attr("exact", False)
    return tuple(window_out(d, k, stride, padding, exact) for d in x.shape[2:])


@rule("conv2d")
def conv2d_rule(node, ins, ctx):
    """``F.conv2d(x, weight, bias, stride, padding)`` with a (C_out, C_in, k, k) weight: the
    output is (b, C_out, H', W'). ConvolutionBackward0 saves the input and the weight (no new
    memory) and computes the input's, the weight's and the bias's gradients in its own kernel.

    Under autocast (``conv2d``: lower-precision list on CUDA and CPU) exactly as
    :func:`~symmem.rules.linalg.linear_rule`: a half copy of a float32 input is saved instead
    of it, the weight's half copy comes from the weight cache and is saved, the bias's is cached
    but not saved, and the gradients are made in the half dtype and cast back (the input's, the
    weight's, then the bias's: autocast casts ``conv2d(input, weight, bias)`` right to left).
    Where the input has a gradient already (a block's input also feeds the shortcut), the
    engine adds this one into it in place (``InputBuffer::accumulate``'s ``old_var.add_(var)``,
    torch/csrc/autograd/input_buffer.cpp), as in every rule: a plain run, measured with
    :func:`symmem.measure.plain_step`. (Under a dispatch mode, such as
    :func:`symmem.measure.training_step`'s tracker, the engine sums out of place instead.)
    The kernels' own workspaces (im2col columns, oneDNN or cuDNN scratch) are allocated inside
    the op and are not modelled (``symmem.measure`` cannot see them either)."""
    x = ins[0]
    w = node.params[0]
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ShapeError(node.name, x.shape, "a (batch, channels, height, width) input and a 4-D weight")
    if not _same(x.shape[1], w.shape[1]):
        raise ShapeError(node.name, x.shape, f"{w.shape[1]} input channels")
    cast = ctx.autocast_dtype("conv2d")
    shape = (x.shape[0], w.shape[0]) + _spatial(node, x, w.shape[2])
    out = TensorInfo(shape, x.dtype if cast is None else cast)
    trainable = tuple(i for i, p in enumerate(node.params) if p.trainable)
    saved, bwd_temp, late = [], sp.Integer(0), ()
    if cast is not None and not ctx.same(x.dtype, cast):
        saved.append(Saved("input (autocast copy)", "new", x.numel, cast))
        if x.requires_grad:
            late = (0,)
            bwd_temp += x.numel * cast.nbytes
    else:
        saved.append(Saved("input", "in0"))
    if cast is not None:
        saved.append(Saved("weight (autocast copy)", f"cast:{w.name}", w.numel, cast))
        bwd_temp += sum((node.params[i].numel for i in trainable), sp.Integer(0)) * cast.nbytes
    else:
        saved.append(Saved("weight", "param:0"))
    casts = tuple((p.name, p.numel, cast) for p in node.params if p.trainable) if cast is not None else ()
    back = ()
    if cast is not None:
        items = ([("in", 0, x.numel * cast.nbytes)] if late else []) + \
            [("param", i, node.params[i].numel * cast.nbytes) for i in trainable]
        rank = {("in", 0): 0, ("param", 0): 1, ("param", 1): 2}
        back = tuple(sorted(items, key=lambda it: rank[it[:2]]))
    return Footprint(out, saved=tuple(saved), grads=_grads(ins), bwd_temp=bwd_temp, casts=casts, cast_back=back)


@rule("batch_norm")
def batch_norm_rule(node, ins, ctx):
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training=True)`` over the
    channels of a (b, C, ...) input (``nn.BatchNorm2d`` in training). NativeBatchNormBackward0
    saves the input, the weight, the running statistics (buffers: no new memory) and the batch's
    mean and inverse standard deviation, C values each, made by the kernel (float32, except on
    the CPU where x and the weights share a half dtype, a bfloat16 model: then in it, measured,
    as layer norm's statistics; cuDNN keeps them in float32); the running
    statistics are updated in place. The output is new, in x's dtype (CPU and cuDNN accept a
    half input with float32 weights: autocast leaves batch_norm alone, so under autocast BN
    reads the convolution's half output and writes a half output). Backward makes the input's
    gradient and the weight's and bias's (C each) in one kernel.

    Source: ``torch/nn/functional.py`` ``batch_norm``; ``derivatives.yaml``
    ``native_batch_norm`` (input, weight, running_mean, running_var, result1, result2).
    On CUDA cuDNN may also keep a reserve space; it is not modelled (measured on the CPU)."""
    x = ins[0]
    if len(x.shape) < 2:
        raise ShapeError(node.name, x.shape, "a (batch, channels, ...) input")
    channels = x.shape[1]
    stats = F32 if ctx.device == "cuda" or not ctx.same(x.dtype, ctx.param_dtype) else x.dtype
    saved = (Saved("batch-norm input", "in0"), Saved("batch-norm weight", "param:0"),
             Saved("batch-norm mean", "new", channels, stats, after=True),
             Saved("batch-norm invstd", "new", channels, stats, after=True))
    return Footprint(TensorInfo(x.shape, x.dtype), saved=saved, grads=_grads(ins))


@rule("relu_")
def relu_inplace_rule(node, ins, ctx):
    """``F.relu(x, inplace=True)`` (torchvision's ``nn.ReLU(inplace=True)``): x is overwritten,
    the output is x's storage (nothing allocated), and ReluBackward0 saves the result, which is
    that storage. Backward makes a new gradient (``threshold_backward``). Safe after batch norm
    and after an add because neither saves its output."""
    x = ins[0]
    return Footprint(TensorInfo(x.shape, x.dtype, x.contiguous, x.requires_grad), alias=0,
                     saved=(Saved("relu output (in place)", "in0"),), grads=_grads(ins))


@rule("max_pool2d")
def max_pool2d_rule(node, ins, ctx):
    """``F.max_pool2d(x, k, stride, padding)``: ``max_pool2d_with_indices`` returns the output
    and the int64 index of each maximum (8 bytes per output element); MaxPool2DWithIndicesBackward0
    saves the input and the indices (``derivatives.yaml``: self, result1). Backward scatters into
    a new gradient of x's size. Neither autocast list holds max_pool2d."""
    x = ins[0]
    k = node.attr("kernel")
    out = TensorInfo(tuple(x.shape[:2]) + _spatial(node, x, k), x.dtype)
    saved = (Saved("max-pool input", "in0"), Saved("max-pool indices", "new", out.numel, I64, after=True))
    return Footprint(out, saved=saved, grads=_grads(ins))


@rule("mean_pool")
def mean_pool_rule(node, ins, ctx):
    """``nn.AdaptiveAvgPool2d((1, 1))``: ATen's ``adaptive_avg_pool2d`` with a 1 x 1 output on a
    contiguous input is ``x.mean((-1, -2), keepdim=True)`` (``AdaptiveAveragePooling.cpp``), and
    MeanBackward1 saves no tensor (only sizes). Output (b, C, 1, 1) in x's dtype; backward makes
    a new gradient of x's size (the output's gradient expanded and divided by H*W)."""
    x = ins[0]
    return Footprint(TensorInfo(tuple(x.shape[:2]) + (sp.Integer(1),) * (len(x.shape) - 2), x.dtype),
                     grads=_grads(ins))


@rule("flatten")
def flatten_rule(node, ins, ctx):
    """``torch.flatten(x, 1)`` of a contiguous (b, C, 1, 1) (or any) tensor: a view (b, C*...)."""
    x = ins[0]
    return Footprint(TensorInfo((x.shape[0], sp.Mul(*x.shape[1:])), x.dtype, x.contiguous, x.requires_grad),
                     alias=0, grads=_grads(ins, "pass"))


@rule("ce_input")
def ce_input_rule(node, ins, ctx):
    """The logits as ``F.cross_entropy`` runs on them: CPU autocast casts
    ``cross_entropy_loss``'s input to float32 (fp32 list: a copy of half logits, freed once
    log_softmax has run, since LogSoftmaxBackward saves its output only; backward casts the
    float32 gradient back, ToCopyBackward0). Elsewhere the logits themselves."""
    x = ins[0]
    dt = ctx.autocast_dtype("cross_entropy_loss")
    if dt is None or ctx.same(x.dtype, dt):
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    return Footprint(TensorInfo(x.shape, dt, x.contiguous, x.requires_grad), grads=_grads(ins))


@rule("ce_log_softmax")
def ce_log_softmax_rule(node, ins, ctx):
    """``log_softmax(x, 1, dtype=x.dtype)`` as ATen's ``cross_entropy_loss`` calls it: the dtype is
    given, so CUDA autocast's fp32_set_opt_dtype policy keeps it, and it runs in x's dtype. Saves
    its output (LogSoftmaxBackward0: result); backward makes a new gradient of x's size."""
    x = ins[0]
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad),
                     saved=(Saved("log-softmax output", "out"),), grads=_grads(ins))


# ----- the vision transformer's embeddings -------------------------------------------------


@rule("patch_tokens")
def patch_tokens_rule(node, ins, ctx):
    """``x.flatten(2).transpose(1, 2)`` (ViTPatchEmbeddings): the (b, h, H/P, W/P) patch
    projections as (b, HW/P^2, h) tokens, a non-contiguous view; backward hands the gradient on."""
    x = ins[0]
    if len(x.shape) != 4:
        raise ShapeError(node.name, x.shape, "a (batch, hidden, rows, columns) tensor")
    out = TensorInfo((x.shape[0], x.shape[2] * x.shape[3], x.shape[1]), x.dtype, False, x.requires_grad)
    return Footprint(out, alias=0, grads=_grads(ins, "pass"))


@rule("cls_concat")
def cls_concat_rule(node, ins, ctx):
    """``torch.cat((cls_token.expand(b, -1, -1), x), dim=1)`` (ViTEmbeddings): a new (b, 1 + n, h)
    tensor in the promoted dtype of the class token (a parameter) and x; CatBackward0 saves no
    tensor (sizes only) and hands each input a slice of the output's gradient. Where x has another
    dtype (a half projection under autocast beside the float32 token) CPU autocast's promote
    policy for ``cat`` casts x to float32 first (a copy, freed when cat returns) and backward casts
    its gradient back (a new half tensor); on CUDA the engine converts it (the same bytes). The
    class token's gradient is ExpandBackward0's sum over the batch; at b = 1 (``ctx.batch_one``)
    that sum returns the slice of the output's gradient, a view AccumulateGrad keeps, so the
    whole (1, 1 + n, h) gradient lives on as ``cls_token.grad`` (``grad_view_param``) through
    the optimizer step."""
    x = ins[0]
    (cls,) = node.params
    dt = _promote(ctx.param_dtype, x.dtype)
    same = ctx.same(dt, x.dtype)
    out = TensorInfo((x.shape[0], x.shape[1] + 1, x.shape[2]), dt)
    temp = 0 if same or ctx.autocast_dtype("cat", dt, x.dtype) is None else x.numel * dt.nbytes
    # at b = 1 ExpandBackward0's sum over the batch returns the slice of the output's gradient
    # itself, and AccumulateGrad keeps that view as cls_token.grad: the whole (1, 1 + n, h)
    # gradient lives on as the class token's (measured)
    view = 0 if ctx.batch_one else None
    return Footprint(out, fwd_temp=temp, grads=_grads(ins, "pass" if same else "new"), grad_view_param=view)


@rule("add_param")
def add_param_rule(node, ins, ctx):
    """``x + p`` of a tensor and a parameter broadcast over the batch (ViT's
    ``embeddings + position_embeddings``, p (1, n, h)): saves nothing; x's gradient is the
    output's (handed on, same shape and dtype), p's is it summed over the batch by the engine
    (``validate_outputs``) once the node has run."""
    x = ins[0]
    (p,) = node.params
    dt = _promote(ctx.param_dtype, x.dtype)
    if tuple(p.shape[1:]) != tuple(x.shape[1:]):
        raise ShapeError(node.name, x.shape, f"the parameter's trailing shape {p.shape[1:]}")
    grads = (None if not x.requires_grad else "pass" if ctx.same(dt, x.dtype) else "new",)
    return Footprint(TensorInfo(x.shape, dt), grads=grads, reduced_params=(0,))


@rule("select_token")
def select_token_rule(node, ins, ctx):
    """``x[:, 0]`` (or ``x[:, 0, :]``) of a (b, n, h) tensor: a (b, h) view, not contiguous.
    SelectBackward0 saves nothing and makes a new zero gradient of x's whole size."""
    x = ins[0]
    out = TensorInfo((x.shape[0],) + tuple(x.shape[2:]), x.dtype, False, x.requires_grad)
    return Footprint(out, alias=0, grads=_grads(ins))
