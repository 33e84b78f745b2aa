"""Optimizers: the state each keeps per parameter tensor and what its step allocates.

An optimizer is its behaviour, not a row of numbers: its state per parameter tensor (``states``
tensors of the parameter's size, or a function of its shape where the state is factored),
priced ``B_o``, a step counter per parameter tensor where PyTorch keeps one, and, per
implementation, the temporaries its step allocates, as a function of the parameters in the
order the step meets them. PyTorch has up to three implementations (torch/optim/adam.py,
sgd.py, adagrad.py, rmsprop.py, _adafactor.py):

- ``for-loop`` (``foreach=False``, ``_single_tensor_adam``): one parameter at a time;
- ``foreach`` (``_multi_tensor_adam``): ``torch._foreach_*`` over all parameters at once;
- ``fused`` (``_fused_adam``): one kernel, in place (SGD, Adam, AdamW and Adagrad only).

``auto`` is PyTorch's default: foreach when every parameter is on CUDA, the for-loop on
the CPU. Every optimizer is modelled with PyTorch's default hyper-parameters (weight_decay=0,
maximize=False, and those its description names); a non-zero weight decay makes Adagrad and
RMSprop add the parameter into a copy of the gradients (``grad.add(param)``, foreach
``torch._foreach_add``), which is not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy as sp

from ..errors import ConfigError
from ..symbols import B_o, B_w
from .registry import Registry

__all__ = ["Optimizer", "Implementation", "OPTIMIZERS", "IMPLEMENTATIONS"]

ZERO = sp.Integer(0)


def _numel(shape) -> sp.Expr:
    return sp.Mul(*shape) if shape else sp.Integer(1)


@dataclass(frozen=True)
class Implementation:
    name: str
    description: str


IMPLEMENTATIONS = Registry("optimizer implementation")
for _i in (Implementation("auto", "PyTorch's default: foreach on cuda, for-loop on cpu"),
           Implementation("for-loop", "foreach=False: one parameter tensor at a time"),
           Implementation("foreach", "torch._foreach_* over every parameter tensor at once"),
           Implementation("fused", "fused=True: one kernel updates every tensor in place")):
    IMPLEMENTATIONS.register(_i)

#: The step's marks: ``fn(order, params)`` -> [(where, transient bytes), ...], with ``order``
#: the parameter tensors (:class:`~symmem.graph.Param`) in the order the step meets them (a
#: repeated block's twice, so that its last parameter precedes its first) and ``params``
#: every distinct one with its multiplicity, ``[(Param, m), ...]``.
StepTemps = Callable[[list, list], list]


def _total(params) -> sp.Expr:
    """N: the parameter elements, each tensor ``m`` times (one ``Add`` of the terms: a running
    sum is flattened again at each parameter)."""
    return sp.expand(sp.Add(*(p.numel * m for p, m in params)))


def _per_parameter(order, size) -> list:
    """One mark per distinct ``size(prev, cur)`` (elements, priced ``B_o``): ``cur`` the numel
    of the parameter being updated, ``prev`` the previous one's (0 for the first)."""
    marks = {}
    for prev, p in zip([None] + order[:-1], order):
        marks.setdefault(sp.expand(size(ZERO if prev is None else prev.numel, p.numel) * B_o), p.name)
    return [(name, temp) for temp, name in marks.items()]


def _none(order, params) -> list:
    return [("all parameters", ZERO)]


def _adam_for_loop(order, params) -> list:
    """``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` holds two
    temporaries of this parameter's size at once, while the previous parameter's ``denom``
    is still referenced: 2 x this tensor + 1 x the previous one. A repeated block's order
    repeats, so its last parameter precedes its first. One mark per distinct size."""
    return _per_parameter(order, lambda prev, cur: 2 * cur + prev)


def _nesterov_for_loop(order, params) -> list:
    """``grad = grad.add(buf, alpha=momentum)`` makes one temporary of this parameter's
    size; the previous parameter's is freed when the loop rebinds ``grad`` first
    (torch/optim/sgd.py, ``_single_tensor_sgd``). One mark per distinct size."""
    return _per_parameter(order, lambda prev, cur: cur)


def _adam_foreach(order, params) -> list:
    """``torch._foreach_sqrt(exp_avg_sqs)`` allocates one temporary for every parameter."""
    return [("all parameters", sp.expand(_total(params) * B_o))]


def _sqrt_for_loop(order, params) -> list:
    """cur + prev: ``std = state_sum.sqrt().add_(eps)`` (torch/optim/adagrad.py,
    ``_single_tensor_adagrad``) and ``avg = square_avg.sqrt()`` then ``avg.add_(eps)``
    (torch/optim/rmsprop.py, ``_single_tensor_rmsprop``, centered=False; with momentum its
    buffer is updated in place) make one temporary of this parameter's size while the
    previous parameter's is still bound to the loop's local. weight_decay=0: else
    ``grad = grad.add(param, alpha=weight_decay)`` adds a copy."""
    return _per_parameter(order, lambda prev, cur: cur + prev)


def _adagrad_foreach(order, params) -> list:
    """2N: ``std = torch._foreach_sqrt(state_sums)`` and ``numerator =
    torch._foreach_mul(grads, minus_clr)`` for every parameter at once (torch/optim/adagrad.py,
    ``_multi_tensor_adagrad``; weight_decay=0, maximize=False: else the gradients' copy is
    reused as the numerator)."""
    return [("all parameters", sp.expand(2 * _total(params) * B_o))]


def _rmsprop_foreach(order, params) -> list:
    """N: ``avg = torch._foreach_sqrt(square_avgs)`` for every parameter at once
    (torch/optim/rmsprop.py, ``_multi_tensor_rmsprop``, centered=False; ``torch._foreach_add_``
    of eps and the momentum buffers' update are in place)."""
    return [("all parameters", sp.expand(_total(params) * B_o))]


def _lion_for_loop(order, params) -> list:
    """2 x cur: ``update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()``
    holds the clone and the sum at once; ``update`` is a local of ``update_fn``, freed when it
    returns (lucidrains/lion-pytorch, lion_pytorch/lion_pytorch.py, ``update_fn``)."""
    return _per_parameter(order, lambda prev, cur: 2 * cur)


def _lion_foreach(order, params) -> list:
    """N: ``updates = [t.clone() for t in exp_avgs]``, then ``torch._foreach_lerp_`` and
    ``torch._foreach_sign_`` in place (lucidrains/lion-pytorch, lion_pytorch/foreach.py,
    ``Lion.step``)."""
    return [("all parameters", sp.expand(_total(params) * B_o))]


def _factored(shape) -> bool:
    return len(shape) >= 2


def _adafactor_state(shape) -> sp.Expr:
    """A (..., R, C) parameter keeps ``row_var`` (..., R, 1) and ``col_var`` (..., 1, C):
    numel/C + numel/R elements; a vector (or a 0-dim tensor) keeps ``variance``, its own size
    (torch/optim/_adafactor.py, ``Adafactor._init_group``)."""
    n = _numel(shape)
    return sp.expand(n / shape[-1] + n / shape[-2]) if _factored(shape) else n


def _adafactor_for_loop(order, params) -> list:
    """torch/optim/_adafactor.py, ``_single_tensor_adafactor``. The loop's locals outlive their
    parameter: ``row_mean`` and ``col_mean`` (numel/C and numel/R elements of a (..., R, C)
    matrix) until the next matrix, ``grad_squared`` (a vector's numel) until the next vector,
    and the previous parameter's ``var_estimate`` (numel), also bound to ``update``, until
    ``update`` is rebound. With those of earlier parameters (row, col, sq, prev), a matrix's
    moments are ``torch.norm(grad, dim=-1)`` (r + row + col + sq + prev), ``dim=-2`` (r + c +
    col + sq + prev) and ``row_var.mean(dim=-2)`` beside ``row_var @ col_var`` (r + c + sq +
    prev + n + n/(R*C)); a vector's are ``grad * grad`` (row + col + sq + prev + n),
    ``variance.clone()`` (row + col + 2n + prev) and ``update.norm(2)`` once ``update`` is
    rebound (row + col + 2n + 1). The 0-dim norms of the other moments never exceed these.
    weight_decay=0 (it would scale the parameter in place), maximize=False. One mark per
    distinct total."""
    row = col = sq = prev = ZERO
    marks = {}
    for p in order:
        n = p.numel
        if _factored(p.shape):
            r, c = n / p.shape[-1], n / p.shape[-2]
            moments = (r + row + col + sq + prev, r + c + col + sq + prev,
                       r + c + sq + prev + n + n / (p.shape[-1] * p.shape[-2]))
            row, col = r, c
        else:
            moments = (row + col + sq + prev + n, row + col + 2 * n + prev, row + col + 2 * n + 1)
            sq = n
        prev = n
        for m in moments:
            marks.setdefault(sp.expand(m * B_o), p.name)
    return [(name, temp) for temp, name in marks.items()]


def _adafactor_foreach(order, params) -> list:
    """torch/optim/_adafactor.py, ``_multi_tensor_adafactor``: two groups, the matrices and the
    vectors, in the order of their first parameter. Matrices: ``var_estimates = [row_var @
    col_var ...]`` (N_M) beside ``row_var.mean(dim=-2)`` of each (T_M = sum of numel/(R*C));
    vectors: ``grads_squared``, deleted, then ``var_estimates = [v.clone() ...]`` (N_V), and
    an ``update.norm(2)`` (1 element). The first group's ``updates`` stay referenced until the
    second group rebinds the name: N_M + N_V after the vectors' clones, N_V + N_M + T_M at the
    matrices' means."""
    mats = [(p, m) for p, m in params if _factored(p.shape)]
    vecs = [(p, m) for p, m in params if not _factored(p.shape)]
    if not order:
        return _none(order, params)
    NM, NV = _total(mats), _total(vecs)
    TM = sp.expand(sp.Add(*(p.numel / (p.shape[-1] * p.shape[-2]) * m for p, m in mats)))
    matrices_first = _factored(order[0].shape)
    marks = []
    if mats:
        marks.append(("matrices", sp.expand((NM + TM + (NV if vecs and not matrices_first else 0)) * B_o)))
    if vecs:
        marks.append(("vectors", sp.expand((NV + (NM if mats and matrices_first else 1)) * B_o)))
    return marks


def _adafactor_hf_state(shape) -> sp.Expr:
    """``exp_avg_sq_row`` (shape[:-1]) and ``exp_avg_sq_col`` (shape[:-2] + shape[-1:]) of a
    matrix, ``exp_avg_sq`` of a vector, as torch's, and ``state["RMS"]``, a 0-dim float32 tensor
    on the parameter's device: one element more (transformers/optimization.py,
    ``Adafactor.step``; beta1=None: no ``exp_avg``; ``state["step"]`` is a Python int)."""
    return _adafactor_state(shape) + 1


def _adafactor_hf_for_loop(order, params, first_moment: bool = False) -> list:
    """transformers/optimization.py, ``Adafactor.step`` (weight_decay=0, float32 parameters: no
    float32 copies of a half parameter or gradient; the Trainer's scale_parameter=False,
    relative_step=False, so ``lr`` is a float). ``update = (grad**2) + eps[0]``: the square and
    the sum (2n) beside the previous parameter's ``update`` (prev), which the loop's local keeps
    until this rebinding. A matrix's ``torch.mul(r_factor, c_factor)`` beside that sum and both
    factors (2n + r + c, r = numel/C, c = numel/R); a vector's ``exp_avg_sq.rsqrt()`` and
    ``p.add_(-update)`` (2n); ``self._rms(update) / clip_threshold``, two 0-dim tensors beside
    it (n + 2). With a first moment (``beta1`` set), ``update = exp_avg`` drops the computed
    update once it is added into the state, so ``-update`` is n beside nothing and the local
    the next parameter meets is a state (prev = 0). One mark per distinct total."""
    prev = ZERO
    marks = {}
    for p in order:
        n = p.numel
        moments = [prev + 2 * n, n + 2]
        if _factored(p.shape):
            moments.append(2 * n + n / p.shape[-1] + n / p.shape[-2])
        prev = ZERO if first_moment else n
        for m in moments:
            marks.setdefault(sp.expand(m * B_o), p.name)
    return [(name, temp) for temp, name in marks.items()]


def _adafactor_hf_momentum_for_loop(order, params) -> list:
    return _adafactor_hf_for_loop(order, params, first_moment=True)


def _adafactor_hf_momentum_state(shape) -> sp.Expr:
    """As transformers' Adafactor without a first moment, plus ``exp_avg``: the parameter's
    size (``torch.zeros_like(grad)``)."""
    return _adafactor_hf_state(shape) + _numel(shape)


#: bitsandbytes' 8-bit optimizers: a parameter of fewer elements keeps 32-bit states
#: (``min_8bit_size``), a larger one one byte per state element and a float32 scale per block
#: (bitsandbytes/optim/optimizer.py, ``Optimizer2State.init_state``).
MIN_8BIT_SIZE, BLOCK_8BIT = 4096, 256
#: the signed and unsigned dynamic quantization maps (``qmap1``, ``qmap2``): 256 float32 each,
#: made once per optimizer (``Optimizer8bit.fill_qmap``) and shared by every parameter's state
QMAPS_8BIT = sp.Integer(2 * 256 * 4)


def _adam8bit_state(shape) -> sp.Expr:
    """``state1`` (exp_avg) and ``state2`` (exp_avg_sq): n uint8 each and ``absmax1``,
    ``absmax2``: ceil(n/256) float32 each, for n >= 4096 elements: 2n + 8 ceil(n/256) bytes;
    a smaller parameter's are float32 whatever its dtype: 8n (bitsandbytes/optim/optimizer.py,
    ``Optimizer2State.init_state``; ``state["step"]`` is a Python int, ``unorm_vec`` only with
    ``max_unorm > 0``)."""
    n = _numel(shape)
    return sp.Piecewise((8 * n, n < MIN_8BIT_SIZE), (2 * n + 8 * sp.ceiling(n / BLOCK_8BIT), True))


def _adam8bit_cpu(order, params) -> list:
    """bitsandbytes' CPU fallback (bitsandbytes/backends/cpu/ops.py), one parameter at a time,
    its locals freed when the op returns. An 8-bit state (n >= 4096):
    ``_optimizer_update_8bit_blockwise_cpu`` dequantizes ``state1`` and ``state2`` to float32
    (8n), makes ``grad = g.float() * gnorm_scale`` (4n, with an 8- and a 4-byte scalar) and
    ``denom = (state2_fp32.sqrt() / correction2)`` (the root and the quotient, 8n): 20n + 12.
    A 32-bit state (``_optimizer_update_32bit_cpu``): the gradient's copy, ``state2.sqrt()``
    and ``+ eps * correction2`` (12n + 12). A parameter that is not float32 adds its float32
    copy ``p.data.float()`` (4n, written back at the end): 2 (4 - B_w) n, exact for B_w 4 and 2.
    Measured with torch.profiler (every allocation inside the op), tests/test_optimizers_measured.py."""
    marks = {}
    for p in order:
        n = p.numel
        temp = sp.Piecewise((12 * n, n < MIN_8BIT_SIZE), (20 * n, True)) + 2 * (4 - B_w) * n + 12
        marks.setdefault(sp.expand(temp), p.name)
    return [(name, temp) for temp, name in marks.items()]


@dataclass(frozen=True)
class Optimizer:
    """``states`` tensors of each parameter's size (in ``B_o``), or ``state_numel(shape)``
    elements where the state is not a whole number of such tensors; ``step_counter``: a 0-dim
    float32 ``state['step']`` per parameter tensor; ``temps``: implementation -> the step's
    temporaries (for-loop, foreach, fused: those PyTorch has)."""
    name: str
    states: int
    step_counter: bool
    temps: tuple            # ((implementation, StepTemps), ...)
    description: str
    state_numel: Callable | None = None     # shape -> state elements, else states x numel
    state_nbytes: Callable | None = None    # shape -> state bytes, where not priced B_o per element
    shared: sp.Expr = ZERO                  # bytes the optimizer keeps once, for all parameters
    cpu_temps: StepTemps | None = None      # the step's temporaries on the CPU, where they differ

    def state_elements(self, param) -> sp.Expr:
        """The state this optimizer keeps for ``param``, in elements (priced ``B_o``)."""
        return self.state_numel(param.shape) if self.state_numel else self.states * param.numel

    def state_bytes(self, param) -> sp.Expr:
        """The state this optimizer keeps for ``param``, in bytes: its elements priced
        ``B_o``, or its own layout (8-bit states with their block scales)."""
        if self.state_nbytes:
            return self.state_nbytes(param.shape)
        return self.state_elements(param) * B_o

    def has(self, implementation: str) -> bool:
        """Does PyTorch (or the reference) implement this optimizer so?"""
        return implementation in dict(self.temps)

    def step_temps(self, implementation: str, order, params, device: str = "cuda") -> list:
        temps = dict(self.temps)
        if implementation not in temps:
            raise ConfigError("implementation", implementation, f"one of {', '.join(temps)} for {self.name}",
                              f"{self.name} has no {implementation} implementation.")
        if device == "cpu" and self.cpu_temps is not None:
            return self.cpu_temps(order, params)
        return temps[implementation](order, params)

    def counters_on_device(self, device: str, implementation: str) -> bool:
        """Adam keeps ``state['step']`` on the host (a CPU tensor) unless it is fused or
        everything is on the CPU (``capturable=False``, torch/optim/adam.py); so do Adagrad
        (adagrad.py), RMSprop and Adafactor (rmsprop.py, _adafactor.py: never fused)."""
        return self.step_counter and (device == "cpu" or implementation == "fused")


_SGD = (("for-loop", _none), ("foreach", _none), ("fused", _none))
# foreach adds the buffers into the gradients in place (torch._foreach_add_), fused in its kernel
_NESTEROV = (("for-loop", _nesterov_for_loop), ("foreach", _none), ("fused", _none))
_ADAM = (("for-loop", _adam_for_loop), ("foreach", _adam_foreach), ("fused", _none))
_ADAGRAD = (("for-loop", _sqrt_for_loop), ("foreach", _adagrad_foreach), ("fused", _none))
_RMSPROP = (("for-loop", _sqrt_for_loop), ("foreach", _rmsprop_foreach))
_ADAFACTOR = (("for-loop", _adafactor_for_loop), ("foreach", _adafactor_foreach))
_LION = (("for-loop", _lion_for_loop), ("foreach", _lion_foreach))
OPTIMIZERS = Registry("optimizer")
for _o in (Optimizer("sgd", 0, False, _SGD, "SGD without momentum: p -= lr * g, in place"),
           Optimizer("sgd-momentum", 1, False, _SGD, "SGD with momentum: one buffer per parameter"),
           Optimizer("sgd-nesterov", 1, False, _NESTEROV, "SGD with Nesterov momentum: one buffer per "
                     "parameter; the for-loop adds it into a copy of each gradient"),
           Optimizer("adam", 2, True, _ADAM, "Adam (weight_decay=0): exp_avg and exp_avg_sq"),
           Optimizer("adamw", 2, True, _ADAM, "AdamW: exp_avg and exp_avg_sq; decay in place"),
           Optimizer("adagrad", 1, True, _ADAGRAD, "Adagrad (PyTorch's defaults: "
                     "initial_accumulator_value=0, weight_decay=0): state_sum"),
           Optimizer("rmsprop", 1, True, _RMSPROP, "RMSprop (momentum=0, centered=False, "
                     "weight_decay=0): square_avg"),
           Optimizer("rmsprop-momentum", 2, True, _RMSPROP, "RMSprop with momentum (centered=False, "
                     "weight_decay=0): square_avg and momentum_buffer"),
           Optimizer("adafactor", 0, True, _ADAFACTOR, "torch.optim.Adafactor (its defaults, no first "
                     "moment): row and column variances of a matrix, a vector's own", _adafactor_state),
           Optimizer("adafactor-hf", 0, False, (("for-loop", _adafactor_hf_for_loop),),
                     "transformers' Adafactor as the Trainer runs it (scale_parameter=False, "
                     "relative_step=False, beta1=None; float32 parameters): factored exp_avg_sq "
                     "and a 0-dim RMS",
                     _adafactor_hf_state),
           Optimizer("adafactor-hf-momentum", 0, False, (("for-loop", _adafactor_hf_momentum_for_loop),),
                     "transformers' Adafactor with a first moment (beta1=0.9; scale_parameter=False, "
                     "relative_step=False; float32 parameters): exp_avg, the factored exp_avg_sq and "
                     "a 0-dim RMS",
                     _adafactor_hf_momentum_state),
           Optimizer("adam8bit", 2, False, (("for-loop", _none),),
                     "bitsandbytes' Adam8bit/AdamW8bit (block-wise, min_8bit_size=4096): exp_avg and "
                     "exp_avg_sq in one byte per element with a float32 scale per 256, a smaller tensor's "
                     "in float32; one fused kernel per parameter, in place on CUDA (the CPU fallback "
                     "dequantizes to float32)",
                     state_nbytes=_adam8bit_state, shared=QMAPS_8BIT, cpu_temps=_adam8bit_cpu),
           Optimizer("lion", 1, False, _LION, "Lion (lucidrains/lion-pytorch, weight_decay=0): exp_avg; "
                     "no step counter")):
    OPTIMIZERS.register(_o)
