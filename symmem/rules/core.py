"""The rules' vocabulary and registry: dtypes, tensors, what an op holds, the context.

Nothing here knows an op; the kind modules (``views``, ``elementwise``,
``normalization``, ``linalg``, ``embeddings``, ``losses``) register the rules.
This module does not import :mod:`symmem.graph`: a rule reads a node only through
:class:`NodeLike` (``name``, ``op``, ``params``, ``attr(key, default)``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol

import sympy as sp

from ..errors import ConfigError, UnknownName
from ..symbols import B_a, b as B
from .autocast import autocast_policy

__all__ = ["DType", "TensorInfo", "Saved", "Footprint", "Ctx", "NodeLike", "Rule", "rule",
           "get_rule", "RULES", "infer_shape", "maximum", "F32", "F64", "I64", "BOOL"]


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


class NodeLike(Protocol):
    """What a rule reads of a node (:class:`symmem.graph.Node` is one): its name (for
    errors), its op, its parameters (each with ``name``, ``shape``, ``numel`` and
    ``trainable``) and its attributes."""
    name: str
    op: str
    params: tuple

    def attr(self, key: str, default=None): ...


@dataclass(frozen=True)
class Ctx:
    """What the rules need to know of the policy.

    ``act`` is the dtype activations are computed in (autocast's half dtype, or the
    model dtype without autocast), priced ``B_a``; ``act_name`` is the torch dtype it
    stands for, so that rules can tell a no-op cast from a copy. ``batch_one``: the step is
    derived for b = 1, where a tensor whose leading dimension is the batch reshapes and slices
    as views that copy at b >= 2 (:attr:`symmem.engine.Estimate.at_one`).
    """
    autocast: bool = False
    device: str = "cuda"
    act: DType = DType("compute", B_a, 3)
    act_name: str = "float32"
    batch_one: bool = False
    #: under ``torch.no_grad`` (inference): autograd records nothing, though the weights still
    #: require grad (so autocast's cache keeps their half copies, as it does in training)
    no_grad: bool = False
    #: the fused attention kernels run as context parallelism's ring (:mod:`symmem.passes.context`)
    ring: bool = False

    def batch_view(self, t: "TensorInfo") -> bool:
        """Does ``t`` lead with the batch dimension, and is the step derived for b = 1? Then
        a reshape that merges that dimension, or a slice past it, is a view (a dimension of
        size 1 merges with any other) where at b >= 2 it copies."""
        return self.batch_one and bool(t.shape) and t.shape[0] == B

    def same(self, x: DType, y: DType) -> bool:
        """Are x and y the same torch dtype? ``act`` is the dtype called ``act_name``."""
        def name(d):
            return self.act_name if d == self.act else d.name
        return name(x) == name(y)

    def float32(self) -> "Ctx":
        """The context of a module run under ``torch.autocast(enabled=False)`` in a
        mixed-precision model: autocast off, computing in float32 (its weights' dtype)."""
        return replace(self, autocast=False, act=F32, act_name="float32")

    @property
    def param_dtype(self) -> DType:
        """The dtype the parameters are stored in: float32 under autocast (the weights
        are the master copy), the compute dtype otherwise. Ops that autocast leaves
        alone and that read a weight (embedding) produce this dtype."""
        return F32 if self.autocast else self.act

    def autocast_dtype(self, op: str, *inputs: DType) -> DType | None:
        """The dtype ``torch.autocast`` runs aten ``op`` in on this device, from the
        table in :mod:`symmem.rules.autocast`: ``act`` (lower_precision_fp), float32
        (fp32, fp32_set_opt_dtype, fp32_append_dtype), or for ``promote`` float32 if any
        of ``inputs`` is float32 and ``act`` otherwise. None when autocast is off or
        leaves the op alone (the op runs in its inputs' dtypes)."""
        if not self.autocast:
            return None
        policy = autocast_policy(self.device, op)
        if policy is None:
            return None
        if policy == "lower_precision_fp":
            return self.act
        if policy == "promote":
            return F32 if any(self.same(d, F32) for d in inputs) else self.act
        if policy == "banned":
            raise ConfigError(f"op under torch.autocast on {self.device}", op,
                              "an op that autocast allows", "Use the op's *_with_logits form.")
        return F32


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a rule sees it. ``seq_major``: a (b, a, s, d) tensor stored as
    (b, s, a, d), as the flash kernels write their output, so that merging its heads back
    is a view, not a copy."""
    shape: tuple
    dtype: DType
    contiguous: bool = True
    requires_grad: bool = True
    seq_major: bool = False

    @property
    def numel(self) -> sp.Expr:
        return sp.Mul(*self.shape) if self.shape else sp.Integer(1)

    @property
    def nbytes(self) -> sp.Expr:
        return self.numel * self.dtype.nbytes


@dataclass(frozen=True)
class Saved:
    """One tensor saved for backward: ``ref`` is "inI", "out", "new", "cast:PARAM" or
    "param:I" (the node's I-th parameter itself: no new memory, but a tensor the
    saved-tensor hooks see, so a checkpoint keeps its region's inputs for it).

    ``hooked`` False: a Python number autograd wraps in a 0-dim tensor and saves without
    the saved-tensor hooks (so a checkpoint keeps it, and a dispatch mode never sees it).
    ``after``: made by the op's own kernel (an output, such as layer norm's statistics),
    so it is saved after the kernel runs; the other saved tensors exist before it (inputs,
    casts, copies), which is where a non-reentrant checkpoint's recomputation stops.
    ``brief``: made and consumed inside a composite op (the tanh of ``gelu_new``): when
    nothing keeps it for backward it is freed before the op's largest moment.
    ``graph``: kept as an attribute of an ``autograd.Function``'s ``ctx`` (bitsandbytes'
    ``ctx.A``), not through ``save_for_backward``: backward does not release it; it lives
    as long as the autograd graph, which the training loop's loss keeps through the step."""
    label: str
    ref: str
    numel: sp.Expr = sp.Integer(0)
    dtype: DType = F32
    hooked: bool = True
    after: bool = False
    brief: bool = False
    graph: bool = False

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
    # Parameters (indices in node.params) whose gradient the engine sums to their shape once
    # the node's kernels have run (validate_outputs: a broadcast bias), before it releases
    # the node's saved tensors.
    reduced_params: tuple = ()
    # Autocast's weight cache: (parameter name, numel, dtype) of each half-precision copy of a
    # parameter this op makes (once per parameter in a forward pass; the cache holds it until
    # forward ends, autograd longer where a "cast:NAME" saved tensor refers to it).
    casts: tuple = ()
    # Gradients made after the node by autocast's cast-back nodes (ToCopyBackward), once its
    # saved tensors and output gradient are released, in the order those nodes run: (("in" |
    # "param", index, bytes of the half-precision gradient cast back), ...). Each is cast, then
    # its half copy freed, before the next; the half copies are in bwd_temp too (the node's
    # kernels make them).
    cast_back: tuple = ()
    # The index (in node.params) of a parameter whose gradient is the output's gradient itself:
    # a view AccumulateGrad keeps (ViT's class token at b = 1, where ExpandBackward0's sum over
    # a batch of one returns its input), so that storage lives on as the parameter's gradient.
    grad_view_param: int | None = None
    # A tensor made with requires_grad=True (no input or parameter gives it one): AccumulateGrad
    # makes the gradient that reaches it its ``.grad``, a storage kept like a parameter's.
    leaf: bool = False

    @property
    def late_inputs(self) -> tuple:
        """The inputs whose gradient a cast-back node makes after the node."""
        return tuple(i for kind, i, _ in self.cast_back if kind == "in")

    def late_param(self, i: int) -> bool:
        """Is the gradient of the node's ``i``-th parameter made after the node?"""
        return any(kind == "param" and j == i for kind, j, _ in self.cast_back)


Rule = Callable[[NodeLike, list, Ctx], Footprint]
RULES: dict[str, Rule] = {}


def rule(op: str):
    """Register ``fn`` as the rule of ``op``; an op has one rule (duplicates are refused:
    to try another rule for one call, pass it to :func:`get_rule` in ``overrides``)."""
    def deco(fn: Rule) -> Rule:
        if op in RULES:
            raise ValueError(f"a rule for {op!r} is already registered ({RULES[op].__name__})")
        RULES[op] = fn
        return fn
    return deco


def get_rule(op: str, overrides: Mapping[str, Rule] | None = None) -> Rule:
    """The rule of ``op``: ``overrides[op]`` if given there, else the registered one."""
    if overrides and op in overrides:
        return overrides[op]
    try:
        return RULES[op]
    except KeyError:
        raise UnknownName("op", op, tuple(sorted(RULES))) from None


def infer_shape(node: NodeLike, shapes: list) -> tuple:
    """The output shape of ``node`` given its input shapes (dtype-independent)."""
    ins = [TensorInfo(tuple(sh), F32) for sh in shapes]
    return get_rule(node.op)(node, ins, Ctx()).out.shape


# ----- helpers shared by the kind modules (not public) -------------------------------
def _grads(ins, mode="new"):
    """Per input, ``mode`` if it requires grad, else None (no gradient)."""
    return tuple(mode if x.requires_grad else None for x in ins)


def _same(x, y) -> bool:
    """Are the sizes ``x`` and ``y`` (products and ratios of symbols) equal? Their difference
    expanded is 0 (no ``simplify``: a shape check runs at every node of a derivation)."""
    return sp.expand(x - y) == 0


@functools.lru_cache(maxsize=1 << 12)
def maximum(*args) -> sp.Expr:
    """``sympy.Max(*args)``, kept per arguments: sympy decides which argument can be dropped
    by comparing them (``_find_localzeros``, a ``factor_terms`` per pair: 8 ms for T5's
    causal mask's ``Max(0, ...)``), the same each time a rule meets the same sizes (every
    layer's, every derivation's)."""
    return sp.Max(*args)


def _promote(*dts: DType) -> DType:
    """Type promotion: the highest rank wins; of equal ranks, the first."""
    return max(dts, key=lambda d: d.rank)
