"""Attention kernels: how the core of attention, ``softmax(q k^T * scale + mask) v`` with
dropout on the probabilities, is computed, and so what it keeps for backward.

A model marks its attention core with one ``attention`` node (inputs q, k, v and the
model's mask; attributes ``dropout`` and ``causal``); the attention pass
(:mod:`symmem.passes.attention`) replaces it with the kernel's operators. The kernels:

- ``eager``: Hugging Face's ``eager_attention_forward``, written in Python: the
  ``b*a*s^2`` scores, probabilities and dropout mask are tensors autograd keeps;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, which picks one of the
  kernels below per device and input (:func:`sdpa_backend`); Hugging Face's default;
- ``flash``: FlashAttention (SDPA's flash backend on CUDA, the ``flash_attn`` package of
  Hugging Face's ``flash_attention_2``; on the CPU SDPA's own flash kernel): keeps q, k,
  v, the output and a float32 log-sum-exp per row, no ``s^2`` tensor;
- ``mem-efficient``: SDPA's memory-efficient (CUTLASS) kernel, CUDA only: as flash, its
  log-sum-exp padded to a multiple of 32 rows;
- ``cudnn``: SDPA's cuDNN kernel, CUDA only: as flash (its softmax statistics);
- ``math``: SDPA's fallback in ATen operators: the scores and probabilities materialised
  as in eager, in float32 for half inputs.

``auto`` (the default) is the model's own choice where its config names one
(``attn_implementation``), else ``sdpa``, as transformers defaults to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..errors import ConfigError
from .registry import Registry

__all__ = ["Kernel", "ATTENTION", "HF_NAMES", "HeadDim", "resolve", "head_dims", "sdpa_backend", "check_kernel"]


@dataclass(frozen=True)
class Kernel:
    """An attention kernel: its name, the devices it runs on, one line on what it keeps."""
    name: str
    devices: tuple
    description: str


ATTENTION = Registry("attention kernel")
for _k in (
    Kernel("auto", ("cuda", "cpu"), "the model's attn_implementation when its config names one, else sdpa "
                                    "(transformers' default)"),
    Kernel("eager", ("cuda", "cpu"), "Hugging Face's eager attention: the b*a*s^2 scores, probabilities "
                                     "and dropout mask are materialised and kept"),
    Kernel("sdpa", ("cuda", "cpu"), "torch's scaled_dot_product_attention, as it picks its kernel: on CUDA "
                                    "flash (half precision), else mem-efficient; on the CPU flash "
                                    "without dropout, the math fallback with it"),
    Kernel("flash", ("cuda", "cpu"), "FlashAttention (flash_attention_2; SDPA's flash kernel): q, k, v, "
                                     "the output and a float32 log-sum-exp per row; no s^2 tensor"),
    Kernel("mem-efficient", ("cuda",), "SDPA's memory-efficient kernel (CUDA): as flash, the log-sum-exp "
                                       "padded to 32 rows"),
    Kernel("cudnn", ("cuda",), "SDPA's cuDNN kernel (CUDA): as flash, with its softmax statistics"),
    Kernel("math", ("cuda", "cpu"), "SDPA's math fallback: scores and probabilities materialised, in "
                                    "float32 for half inputs"),
):
    ATTENTION.register(_k)

#: Hugging Face's ``attn_implementation`` names -> symmem's kernels.
HF_NAMES = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash"}

_HALF = ("bfloat16", "float16")


@dataclass(frozen=True)
class HeadDim:
    """What a kernel needs of the head dimension d: ``kind`` "at most" (d <= n) or
    "divides" (n divides d), and why (PyTorch 2.13's ``sdp_utils.cpp`` checks)."""
    kind: str
    n: int
    reason: str

    def holds(self, d) -> bool | None:
        """Does d satisfy it? None while d is a symbol (then it becomes a requirement)."""
        d = sp.sympify(d)
        if not d.is_number:
            return None
        return bool(d <= self.n) if self.kind == "at most" else (d.is_integer and int(d) % self.n == 0)

    def requirement(self, d) -> tuple:
        """(lhs, rhs, reason, kind) for :meth:`symmem.graph.Graph.require`."""
        return (d, self.n, self.reason, "at most") if self.kind == "at most" else (self.n, d, self.reason, "divides")


def head_dims(kernel: str, device: str, dtype: str) -> tuple[HeadDim, ...]:
    """What ``kernel`` needs of the head dimension on ``device`` for ``dtype`` inputs."""
    if device != "cuda":
        return ()
    if kernel == "flash":
        return (HeadDim("at most", 256, "FlashAttention takes head dimensions up to 256"),
                HeadDim("divides", 8, "FlashAttention pads other head dimensions to a multiple of 8, in "
                                      "copies of q, k and v that the formulas do not count"))
    if kernel == "cudnn":
        return (HeadDim("at most", 128, "cuDNN attention takes head dimensions up to 128 (256 on Hopper "
                                        "with cuDNN 9.10 or later)"),
                HeadDim("divides", 8, "cuDNN attention takes head dimensions that are multiples of 8"))
    if kernel == "mem-efficient":
        n = 8 if dtype in _HALF else 4
        return (HeadDim("divides", n, f"the mem-efficient kernel takes {dtype} head dimensions that are "
                                      f"multiples of {n}"),)
    return ()


def check_kernel(kernel: str, device: str, dtype: str, head_dim=None) -> tuple[HeadDim, ...]:
    """Refuse a kernel the device lacks, a dtype it does not take or a head dimension it
    cannot run, naming each; return what it needs of a symbolic head dimension."""
    k = ATTENTION[kernel]
    if device not in k.devices:
        raise ConfigError("attention", kernel, f"a kernel that runs on {device} "
                          f"({', '.join(n for n in ATTENTION.names() if n != 'auto' and device in ATTENTION[n].devices)})",
                          f"{kernel} runs on {', '.join(k.devices)} only; use --attention sdpa to let "
                          "PyTorch pick.")
    if kernel in ("flash", "cudnn") and device == "cuda" and dtype not in _HALF:
        raise ConfigError("attention", kernel, f"a kernel that takes {dtype} inputs on CUDA",
                          f"{kernel} runs in bfloat16 or float16 only: train with --precision "
                          "bf16-mixed (or fp16-mixed), or use --attention sdpa (mem-efficient in float32).")
    needs = head_dims(kernel, device, dtype)
    for need in needs:
        if need.holds(head_dim) is False:
            raise ConfigError("attention", kernel, f"a kernel that runs head dimension {head_dim}",
                              f"{need.reason}; use --attention sdpa to let PyTorch pick.")
    return tuple(n for n in needs if n.holds(head_dim) is None)


def sdpa_backend(device: str, dtype: str, dropout, head_dim) -> tuple[str, tuple[HeadDim, ...]]:
    """The kernel ``scaled_dot_product_attention`` runs for a training step, and what it
    assumes of a symbolic head dimension.

    CUDA (``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``;
    the order flash, mem-efficient, math of ``Context.h``): flash for bfloat16 and float16
    with d <= 256 and 8 | d, else mem-efficient (any float dtype; 8 | d for half, 4 | d for
    float32), else math. On H100/H200 with cuDNN 9.15 or later PyTorch 2.13 tries cuDNN
    first: what it saves differs from flash by its 16-byte RNG state (pass ``cudnn``).
    CPU (``select_sdp_backend_cpp`` in ``sdp_utils_cpp.cpp``: flash, then math): flash
    unless dropout is on, which the CPU flash kernel does not take."""
    if device == "cpu":
        return ("math" if dropout else "flash"), ()
    for kernel in (("flash",) if dtype in _HALF else ()) + ("mem-efficient",):
        needs = head_dims(kernel, device, dtype)
        if all(n.holds(head_dim) is not False for n in needs):
            return kernel, tuple(n for n in needs if n.holds(head_dim) is None)
    return "math", ()


def resolve(kernel: str, model_choice: str | None) -> str:
    """``auto`` is the model's own kernel (its config's ``attn_implementation``), else
    ``sdpa``; any other name is itself."""
    return (model_choice or "sdpa") if kernel == "auto" else kernel
