"""Memory rules: what each operator holds, with PyTorch eager semantics.

A rule is a small pure function registered with ``@rule("op")``. It receives the
node, its input tensors (:class:`TensorInfo`: symbolic shape, dtype, contiguity,
whether it requires grad) and a :class:`Ctx` (autocast on or off, CUDA or CPU),
and returns a :class:`Footprint`:

- ``out``: the output tensor; ``alias`` = i when the output is a view of input i
  (it shares that storage and allocates nothing);
- ``saved``: the tensors autograd saves for backward, each either a reference to
  an input's or the output's storage (``"in0"``, ``"out"``: no new memory) or a
  new storage (``"new"``), or an autocast copy of a parameter (``"cast:NAME"``,
  one per parameter however often it is used: autocast caches it);
- ``fwd_temp``: bytes that exist only while the op runs;
- ``grads``: per input, what backward allocates for its gradient: ``"new"`` (a
  tensor of the input's size and dtype), ``"pass"`` (the output's gradient is
  handed on, no allocation), ``"slice"`` (a share of one gradient of the whole
  input, allocated by the first slice to arrive) or ``None`` (no gradient);
- ``bwd_temp``: bytes that exist only while the op's backward runs (for example
  the half-precision gradient of an autocast copy before it is cast back).

Parameter gradients are added by the schedule: a parameter's gradient is
allocated the first time backward reaches a node that uses it.

The rules were read off PyTorch's autograd formulas (``derivatives.yaml``) and
checked against saved-tensor hooks on the CPU (``tests/test_rules.py``).
Where CPU and CUDA differ the rule says so in its docstring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy as sp

from .errors import ShapeError, UnknownName
from .graph import Node
from .symbols import B_a

__all__ = ["DType", "TensorInfo", "Saved", "Footprint", "Ctx", "rule", "get_rule", "RULES",
           "infer_shape", "F32", "F64", "I64", "BOOL"]


@dataclass(frozen=True)
class DType:
    """A dtype as the formulas see it: a name, bytes per element, a promotion rank."""
    name: str
    nbytes: sp.Expr
    rank: int  # type promotion: the higher rank wins (float64 > float32 > half > integers)


F64 = DType("float64", sp.Integer(8), 4)
F32 = DType("float32", sp.Integer(4), 3)
I64 = DType("int64", sp.Integer(8), 0)
BOOL = DType("bool", sp.Integer(1), 0)


@dataclass(frozen=True)
class Ctx:
    """What the rules need to know of the policy.

    ``act`` is the dtype activations are computed in (autocast's half dtype, or the
    model dtype without autocast), priced ``B_a``; ``act_name`` is the torch dtype it
    stands for, so that rules can tell a no-op cast from a copy.
    """
    autocast: bool = False
    device: str = "cuda"
    act: DType = DType("compute", B_a, 3)
    act_name: str = "float32"

    def same(self, x: DType, y: DType) -> bool:
        """Are x and y the same torch dtype? ``act`` is the dtype called ``act_name``."""
        def name(d):
            return self.act_name if d == self.act else d.name
        return name(x) == name(y)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple
    dtype: DType
    contiguous: bool = True
    requires_grad: bool = True

    @property
    def numel(self) -> sp.Expr:
        return sp.Mul(*self.shape) if self.shape else sp.Integer(1)

    @property
    def nbytes(self) -> sp.Expr:
        return self.numel * self.dtype.nbytes


@dataclass(frozen=True)
class Saved:
    """One tensor saved for backward: ``ref`` is "inI", "out", "new" or "cast:PARAM"."""
    label: str
    ref: str
    numel: sp.Expr = sp.Integer(0)
    dtype: DType = F32

    @property
    def nbytes(self) -> sp.Expr:
        return self.numel * self.dtype.nbytes


@dataclass(frozen=True)
class Footprint:
    out: TensorInfo
    alias: int | None = None
    saved: tuple[Saved, ...] = ()
    fwd_temp: sp.Expr = sp.Integer(0)
    grads: tuple = ()
    bwd_temp: sp.Expr = sp.Integer(0)
    # Gradients made by cast-back nodes (autocast's ToCopyBackward) after this node's saved
    # tensors and output gradient are released: these inputs' and (late_params) the
    # parameters'. The half-precision gradients they cast are in bwd_temp.
    late_inputs: tuple = ()
    late_params: bool = False


Rule = Callable[[Node, list, Ctx], Footprint]
RULES: dict[str, Rule] = {}


def rule(op: str):
    """Register ``fn`` as the rule of ``op``; an op has one rule (duplicates are refused)."""
    def deco(fn: Rule) -> Rule:
        if op in RULES:
            raise ValueError(f"a rule for {op!r} is already registered ({RULES[op].__name__})")
        RULES[op] = fn
        return fn
    return deco


def get_rule(op: str) -> Rule:
    try:
        return RULES[op]
    except KeyError:
        raise UnknownName("op", op, tuple(sorted(RULES))) from None


def infer_shape(node: Node, shapes: list) -> tuple:
    """The output shape of ``node`` given its input shapes (dtype-independent)."""
    ins = [TensorInfo(tuple(sh), F32) for sh in shapes]
    return get_rule(node.op)(node, ins, Ctx()).out.shape


def _grads(ins, mode="new"):
    return tuple(mode if x.requires_grad else None for x in ins)


def _promote(*dts: DType) -> DType:
    """Type promotion: the highest rank wins; of equal ranks, the first."""
    return max(dts, key=lambda d: d.rank)


def _needs_grad(ins, node: Node) -> bool:
    return any(x.requires_grad for x in ins) or bool(node.params)


# ----- inputs and views --------------------------------------------------------------
@rule("input")
def input_rule(node, ins, ctx):
    """A tensor handed to the model (token ids, labels; no gradient by default)."""
    from .dtypes import dtype_bytes
    name = node.attr("dtype", "int64")
    known = {"int64": I64, "float32": F32, "bool": BOOL, "float64": F64}
    dt = known.get(name) or DType(name, dtype_bytes(name), 2)
    return Footprint(TensorInfo(node.attr("shape"), dt, requires_grad=bool(node.attr("requires_grad"))))


@rule("carry")
def carry_rule(node, ins, ctx):
    """The value a repeated block receives: the same tensor, nothing allocated."""
    return Footprint(ins[0], alias=0, grads=("pass",))


@rule("split")
def split_rule(node, ins, ctx):
    """``x.split(size, dim=-1)[index]``: a view. Backward (SplitBackward) concatenates the
    pieces' gradients into one gradient of the whole input."""
    x = ins[0]
    parts = node.attr("parts")
    last = x.shape[-1]
    if sp.simplify(last % parts) != 0:
        raise ShapeError(node.name, x.shape, f"a last dimension divisible by {parts}")
    out = TensorInfo(x.shape[:-1] + (last / parts,), x.dtype, False, x.requires_grad)
    return Footprint(out, alias=0, grads=_grads(ins, "slice"))


@rule("heads")
def heads_rule(node, ins, ctx):
    """``x.view(b, s, a, d).transpose(1, 2)``: (b, s, h) -> (b, a, s, h/a), a view."""
    x = ins[0]
    a = sp.sympify(node.attr("heads"))
    if len(x.shape) != 3:
        raise ShapeError(node.name, x.shape, "a (batch, sequence, hidden) tensor")
    bb, ss, hh = x.shape
    out = TensorInfo((bb, a, ss, hh / a), x.dtype, False, x.requires_grad)
    return Footprint(out, alias=0, grads=_grads(ins, "pass"))


@rule("merge_heads")
def merge_heads_rule(node, ins, ctx):
    """``x.transpose(1, 2).reshape(b, s, h)``: the transpose is a view, the reshape of a
    non-contiguous tensor copies. Backward hands the gradient on as views."""
    x = ins[0]
    bb, aa, ss, dd = x.shape
    return Footprint(TensorInfo((bb, ss, aa * dd), x.dtype, True, x.requires_grad),
                     grads=_grads(ins, "pass"))


# ----- elementwise -------------------------------------------------------------------
def _broadcast(node, x: tuple, y: tuple) -> tuple:
    n = max(len(x), len(y))
    x = (1,) * (n - len(x)) + tuple(x)
    y = (1,) * (n - len(y)) + tuple(y)
    out = []
    for dx, dy in zip(x, y):
        if dx == 1:
            out.append(dy)
        elif dy == 1 or dx == dy:
            out.append(dx)
        else:
            raise ShapeError(node.name, (x, y), "shapes that broadcast")
    return tuple(sp.sympify(d) for d in out)


@rule("add")
def add_rule(node, ins, ctx):
    """``x + y`` saves nothing. Backward hands the gradient to both inputs; an input of
    another dtype or a broadcast shape gets its own converted/reduced gradient."""
    x, y = ins
    shape = _broadcast(node, x.shape, y.shape)
    dt = _promote(x.dtype, y.dtype)
    out = TensorInfo(shape, dt, True, x.requires_grad or y.requires_grad)
    grads = tuple(None if not t.requires_grad else
                  ("pass" if tuple(t.shape) == shape and t.dtype == dt else "new") for t in ins)
    return Footprint(out, grads=grads)


@rule("scale")
def scale_rule(node, ins, ctx):
    """``x * c`` for a Python number c: PyTorch wraps c in a 0-dim float64 tensor and
    MulBackward saves it: 8 bytes, in host memory (so 0 bytes on the GPU under CUDA)."""
    x = ins[0]
    saved = (Saved("scalar", "new", sp.Integer(1), F64),) if ctx.device == "cpu" else ()
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad), saved=saved, grads=_grads(ins))


@rule("dropout")
def dropout_rule(node, ins, ctx):
    """``F.dropout(x, p)`` in training. p = 0 returns x itself (nothing saved).
    CUDA (``native_dropout``) saves a bool mask: 1 byte per element.
    CPU (``x * noise``, noise = bernoulli(1-p)/(1-p)) saves the noise in x's dtype."""
    x = ins[0]
    if node.attr("p", 0.0) == 0:
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    if ctx.device == "cuda":
        saved = (Saved("dropout mask", "new", x.numel, BOOL),)
    else:
        saved = (Saved("dropout noise", "new", x.numel, x.dtype),)
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad), saved=saved, grads=_grads(ins))


@rule("gelu")
def gelu_rule(node, ins, ctx):
    """``F.gelu(x, approximate='none'|'tanh')`` saves its input (GeluBackward: self)."""
    x = ins[0]
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad),
                     saved=(Saved("gelu input", "in0"),), grads=_grads(ins))


@rule("gelu_new")
def gelu_new_rule(node, ins, ctx):
    """Hugging Face's ``NewGELUActivation`` (``gelu_new``), written in Python:
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))))``.
    Autograd saves x (pow), tanh's result, ``0.5*x`` and ``1 + tanh`` (the final mul),
    plus three 0-dim float64 scalars on the CPU (24 bytes).
    Under CUDA autocast ``pow`` runs in float32, so the tanh branch and the output are
    float32; on the CPU everything stays in x's dtype."""
    x = ins[0]
    t = F32 if (ctx.autocast and ctx.device == "cuda") else x.dtype
    saved = [Saved("gelu input", "in0"), Saved("tanh", "new", x.numel, t),
             Saved("0.5*x", "new", x.numel, x.dtype), Saved("1+tanh", "new", x.numel, t)]
    if ctx.device == "cpu":
        saved.append(Saved("scalars", "new", sp.Integer(3), F64))
    out = TensorInfo(x.shape, _promote(x.dtype, t), True, x.requires_grad)
    return Footprint(out, saved=tuple(saved), fwd_temp=2 * x.numel * t.nbytes,
                     grads=_grads(ins), bwd_temp=x.numel * t.nbytes)


@rule("relu")
def relu_rule(node, ins, ctx):
    """``F.relu(x)`` saves its output (ReluBackward: result)."""
    x = ins[0]
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad),
                     saved=(Saved("relu output", "out"),), grads=_grads(ins))


@rule("to_compute")
def to_compute_rule(node, ins, ctx):
    """``x.type(v.dtype)``: a copy into the compute dtype, or x itself when it has it."""
    x = ins[0]
    if ctx.same(x.dtype, ctx.act):
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    return Footprint(TensorInfo(x.shape, ctx.act, True, x.requires_grad), grads=_grads(ins))


@rule("to_float32")
def to_float32_rule(node, ins, ctx):
    """``x.float()``: a float32 copy, or x itself when it is float32 already."""
    x = ins[0]
    if ctx.same(x.dtype, F32):
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    return Footprint(TensorInfo(x.shape, F32, True, x.requires_grad), grads=_grads(ins))


# ----- normalisation and softmax -----------------------------------------------------
@rule("layer_norm")
def layer_norm_rule(node, ins, ctx):
    """``F.layer_norm(x, (h,), w, b)``: NativeLayerNormBackward saves the input, the
    weight and bias (parameters) and the per-row mean and rstd: numel/h each.

    CUDA autocast runs layer_norm in float32 (a float32 copy of a half input is what is
    saved; the output is float32), and CUDA keeps mean and rstd in float32 whatever x's
    dtype. CPU autocast leaves layer_norm alone: x itself is saved, the output has x's
    dtype, and the statistics are float32 when the weights are (autocast) and in x's
    dtype otherwise (2 bytes each for a bfloat16 model; measured)."""
    x = ins[0]
    rows = x.numel / x.shape[-1]
    saved = []
    if ctx.autocast and ctx.device == "cuda" and not ctx.same(x.dtype, F32):
        saved.append(Saved("layer-norm input (float32 copy)", "new", x.numel, F32))
        out_dt = F32
    else:
        saved.append(Saved("layer-norm input", "in0"))
        out_dt = F32 if (ctx.autocast and ctx.device == "cuda") else x.dtype
    stats = F32 if (ctx.device == "cuda" or ctx.autocast) else x.dtype
    saved += [Saved("layer-norm mean", "new", rows, stats), Saved("layer-norm rstd", "new", rows, stats)]
    return Footprint(TensorInfo(x.shape, out_dt), saved=tuple(saved), grads=_grads(ins))


@rule("softmax")
def softmax_rule(node, ins, ctx):
    """``F.softmax(x, -1)`` saves its output (SoftmaxBackward: result). CUDA autocast runs
    it in float32; CPU autocast leaves it in x's dtype."""
    x = ins[0]
    dt = F32 if (ctx.autocast and ctx.device == "cuda") else x.dtype
    return Footprint(TensorInfo(x.shape, dt, True, x.requires_grad),
                     saved=(Saved("softmax output", "out"),), grads=_grads(ins))


@rule("log_softmax")
def log_softmax_rule(node, ins, ctx):
    """``F.log_softmax(x, -1)`` saves its output. CUDA autocast runs it in float32; CPU
    autocast leaves it in x's dtype."""
    x = ins[0]
    dt = F32 if (ctx.autocast and ctx.device == "cuda") else x.dtype
    return Footprint(TensorInfo(x.shape, dt, True, x.requires_grad),
                     saved=(Saved("log-softmax output", "out"),), grads=_grads(ins))


@rule("nll_loss")
def nll_loss_rule(node, ins, ctx):
    """``F.nll_loss(logp.view(-1, V), labels)``, mean over tokens, with Hugging Face's
    label shift (``pad`` then ``[..., 1:]``: a new int64 copy of the labels, saved as the
    target). NllLossBackward saves logp, the target and a 0-dim float32 total weight.
    Backward allocates a zero gradient of logp's size and scatters into it.
    (With b = 1 the shifted slice is already contiguous, so the saved target is a view of
    the padded labels: s + 1 elements, 8 bytes more than counted here.)"""
    logp, labels = ins
    rows = labels.numel
    if ctx.autocast and not ctx.same(logp.dtype, F32):
        # nll_loss is on autocast's float32 list: a float32 copy of logp is what is saved
        first = Saved("log-probabilities (float32 copy)", "new", logp.numel, F32)
        bwd_temp = logp.numel * F32.nbytes     # its float32 gradient, then cast back
    else:
        first, bwd_temp = Saved("log-probabilities", "in0"), sp.Integer(0)
    saved = (first, Saved("shifted labels", "new", rows, I64),
             Saved("total weight", "new", sp.Integer(1), F32))
    padded = labels.numel / labels.shape[-1] * (labels.shape[-1] + 1) * I64.nbytes
    return Footprint(TensorInfo((), F32 if ctx.autocast else logp.dtype), saved=saved, fwd_temp=padded,
                     grads=_grads(ins), bwd_temp=bwd_temp, late_inputs=(0,) if bwd_temp != 0 else ())


# ----- parametrised ops --------------------------------------------------------------
@rule("embedding")
def embedding_rule(node, ins, ctx):
    """``F.embedding(ids, W)`` saves the indices (int64). Not autocast: the output has the
    weight's dtype. Backward builds a dense gradient of W's full size."""
    ids = ins[0]
    (w,) = node.params
    dt = F32 if ctx.autocast else ctx.act
    return Footprint(TensorInfo(tuple(ids.shape) + (w.shape[1],), dt),
                     saved=(Saved("indices", "in0"),), grads=(None,))


@rule("position_embedding")
def position_embedding_rule(node, ins, ctx):
    """GPT-2's learned positions: ``wpe(arange(s))``. The position ids (int64, s of them,
    created in forward) are saved by the embedding. Output (1, s, h), broadcast later."""
    ids = ins[0]
    (w,) = node.params
    ss = ids.shape[-1]
    dt = F32 if ctx.autocast else ctx.act
    return Footprint(TensorInfo((sp.Integer(1), ss, w.shape[1]), dt),
                     saved=(Saved("position ids", "new", ss, I64),), grads=(None,))


@rule("causal_mask")
def causal_mask_rule(node, ins, ctx):
    """Hugging Face's eager causal mask: a (b, 1, s, s) additive mask (0 or the dtype's
    minimum) in the model's dtype, built once per forward and read by every layer."""
    ids = ins[0]
    bb, ss = ids.shape
    dt = F32 if ctx.autocast else ctx.act
    return Footprint(TensorInfo((bb, sp.Integer(1), ss, ss), dt, requires_grad=False), grads=(None,))


@rule("linear")
def linear_rule(node, ins, ctx):
    """``y = x W^T (+ bias)`` (``nn.Linear``) or ``y = x W + bias`` (GPT-2's ``Conv1D``,
    attribute ``conv1d=True``): addmm / mm save the 2-D input (a view of x) and the weight.

    Under autocast the input is cast to the half dtype (that copy is what is saved) and
    so is the weight: the copy is cached for the forward pass, so a parameter used twice
    is cast once, and it is held until backward. Backward computes the input gradient
    and the weight gradient in the half dtype and casts them back to float32."""
    x = ins[0]
    w = node.params[0]
    out_features = w.shape[1] if node.attr("conv1d") else w.shape[0]
    in_features = w.shape[0] if node.attr("conv1d") else w.shape[1]
    if sp.simplify(x.shape[-1] - in_features) != 0:
        raise ShapeError(node.name, x.shape, f"a last dimension of {in_features}")
    out = TensorInfo(tuple(x.shape[:-1]) + (out_features,), ctx.act if ctx.autocast else x.dtype)
    saved, bwd_temp, late = [], sp.Integer(0), ()
    if ctx.autocast:
        if not ctx.same(x.dtype, ctx.act):
            late = (0,)
            saved.append(Saved("input (autocast copy)", "new", x.numel, ctx.act))
            bwd_temp += x.numel * ctx.act.nbytes if x.requires_grad else 0
        else:
            saved.append(Saved("input", "in0"))
        if x.requires_grad:   # addmm keeps the weight only to compute the input's gradient
            saved.append(Saved("weight (autocast copy)", f"cast:{w.name}", w.numel, ctx.act))
        bwd_temp += sum((p.numel for p in node.params), sp.Integer(0)) * ctx.act.nbytes
    else:
        saved.append(Saved("input", "in0"))
    return Footprint(out, saved=tuple(saved), grads=_grads(ins), bwd_temp=bwd_temp, late_inputs=late,
                     late_params=ctx.autocast)


@rule("matmul")
def matmul_rule(node, ins, ctx):
    """``torch.matmul(x, y)`` (or ``x @ y.transpose(-1, -2)`` with ``transpose_b=True``)
    on 4-D tensors: matmul reshapes each operand to 3-D for bmm; a non-contiguous operand
    (a head view (b, a, s, d) of a (b, s, 3h) tensor) is copied, and bmm saves both 3-D
    operands. Under autocast the operands are cast to the half dtype first (a copy when
    they are not). (At b = 1 or a = 1 a head view reshapes without a copy and the whole
    qkv storage is saved instead: the same bytes for q, k and v together, not counted so.)"""
    x, y = ins
    m, kx = x.shape[-2], x.shape[-1]
    ky, n = (y.shape[-1], y.shape[-2]) if node.attr("transpose_b") else (y.shape[-2], y.shape[-1])
    if sp.simplify(kx - ky) != 0:
        raise ShapeError(node.name, (x.shape, y.shape), "inner dimensions that agree")
    dt = ctx.act if ctx.autocast else _promote(x.dtype, y.dtype)
    saved = []
    for i, (t, label) in enumerate(((x, "left operand"), (y, "right operand"))):
        # a transposed contiguous operand reshapes to 3-D as a view: bmm saves that view
        if not ctx.same(t.dtype, dt) or not t.contiguous:
            saved.append(Saved(f"{label} (contiguous copy)", "new", t.numel, dt))
        else:
            saved.append(Saved(label, f"in{i}"))
    out = TensorInfo(tuple(x.shape[:-2]) + (m, n), dt)
    return Footprint(out, saved=tuple(saved), grads=_grads(ins))
