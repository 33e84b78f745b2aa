"""Training policies: how a step is run, assembled from named parts.

A :class:`Policy` is frozen and built from names, so it can come from a command line.
Each part is chosen from a registry (:mod:`symmem.policy.registry`), one module per part:

- ``precision`` (:mod:`~symmem.policy.precision`): bytes per element of each role, and
  whether autocast runs forward;
- ``optimizer`` and its ``implementation`` (:mod:`~symmem.policy.optimizer`): states per
  parameter tensor and the step's temporaries;
- ``device``: ``cuda`` (the default: what users train on) or ``cpu`` (what the tests
  measure): dropout, wrapped scalars and the default implementation differ;
- ``recompute`` (:mod:`~symmem.policy.recompute`): activation recomputation;
- ``accumulate``: micro-batches per optimizer step (gradient accumulation);
- ``attention`` (:mod:`~symmem.policy.attention`): the attention kernel (eager, SDPA and
  its backends); ``auto`` resolves to the model's own or ``sdpa``;
- ``lora`` and ``lora_targets`` (:mod:`~symmem.policy.adapters`): LoRA adapters of rank
  R (or the symbol ``r``) on the named projections, the base model frozen;
- ``quantize`` (:mod:`~symmem.policy.quantize`): the frozen linear weights stored in int8
  or 4-bit NF4 (bitsandbytes), under LoRA adapters (QLoRA), but those ``quantize_skip`` names;
- ``keep_fp32``: modules and layer ranges a mixed-precision run keeps out of autocast, in
  float32 (:mod:`symmem.passes.keep_fp32`); both name regions as :mod:`~symmem.policy.regions`
  says;
- ``parallel`` (:mod:`~symmem.policy.parallel`): the parallel layout, a
  :class:`~symmem.policy.parallel.Parallel` (data parallelism, ZeRO, FSDP, offload) or its
  spec (``"dp=8,zero=3"``; ``"none"``: one device), derived per rank by :mod:`symmem.passes.shard`;
- ``mode`` and ``cache`` (:mod:`~symmem.policy.inference`): ``"inference"`` derives the
  prefill and one decoding step of generation with a KV cache instead of a training step
  (:mod:`symmem.passes.inference`).

:data:`PARTS` describes every part for the command line, which generates its options,
their ``--help`` and ``symmem policies`` from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..rules import Ctx
from .adapters import LORA_DTYPES, LoRA
from .attention import ATTENTION
from .inference import CACHES, LOGITS, MODES, QUANTO_BITS
from .optimizer import IMPLEMENTATIONS, OPTIMIZERS, Implementation, Optimizer
from .precision import PRECISIONS, Precision
from .quantize import QUANTIZE, Quantization
from .recompute import RECOMPUTE, Recompute
from .regions import parse_regions
from .registry import Registry
from .parallel import Parallel
from .slots import DEVICES

__all__ = ["Policy", "Part", "PARTS", "Precision", "Optimizer", "Implementation", "Recompute", "LoRA", "Registry",
           "Quantization", "PRECISIONS", "OPTIMIZERS", "IMPLEMENTATIONS", "RECOMPUTE", "DEVICES", "ATTENTION",
           "QUANTIZE", "LORA_DTYPES", "MODES", "CACHES", "LOGITS",
           "Parallel"]


@dataclass(frozen=True)
class Policy:
    """How a training step is run. ``implementation="auto"`` is PyTorch's default: foreach
    on CUDA, the for-loop on the CPU. ``recompute`` is a spec (``"full"``, ``"every:2"``,
    ...) or a :class:`Recompute`; ``accumulate`` is the number of micro-batches of size
    ``b`` whose gradients are summed before each optimizer step. ``attention="auto"`` is the
    model's own kernel, else ``sdpa``. ``lora`` is a rank (or ``"r"``, or a :class:`LoRA`)
    for adapters on ``lora_targets`` (comma-separated module names; None: peft's default),
    every other weight frozen, in float32 on a half-precision model (``lora_dtype="model"``: in
    its dtype); ``"none"`` for none. ``quantize``: ``"int4"`` (QLoRA's NF4) or
    ``"int8"`` stores the frozen linear weights so (with ``lora``, in a pure precision) but
    those ``quantize_skip`` names (modules, ``first:N``, ``last:N``). ``keep_fp32`` names
    modules and layer ranges run with autocast off, in float32 (with ``bf16-mixed`` or
    ``fp16-mixed``). ``parallel`` is a :class:`Parallel` or its spec (``"dp=8,zero=3"``):
    the step is then one data-parallel rank's (:mod:`symmem.passes.shard`)."""
    precision: str = "fp32"
    optimizer: str = "adamw"
    device: str = "cuda"
    implementation: str = "auto"
    recompute: Recompute | str = "none"
    accumulate: int = 1
    attention: str = "auto"
    lora: LoRA | int | str | None = "none"
    lora_targets: tuple | str | None = None
    lora_dtype: str = "float32"
    quantize: str = "none"
    quantize_skip: tuple | str | None = None
    keep_fp32: tuple | str | None = None
    parallel: Parallel | str = "none"
    mode: str = "training"
    cache: str = "dynamic"
    #: a StaticCache's positions (None: s + n_g, as generate sets it)
    max_cache_len: int | None = None
    #: a quanto cache's residual_length, q_group_size (transformers' defaults) and the positions
    #: its residual holds before the decoding step modelled (None: residual_length - 1, the flush)
    residual_length: int = 128
    q_group_size: int = 64
    residual_position: int | None = None
    #: the prefill's logits: the last position's (generate's logits_to_keep=1) or all
    logits: str = "last"
    #: the inference step a plan is lowered for (set by the engine, not a choice)
    step: str = field(default="prefill", repr=False)
    #: derive the step at b = 1 (set by :attr:`symmem.engine.Estimate.at_one`, not a choice)
    batch_one: bool = field(default=False, repr=False)
    #: the pipeline stage a plan is derived for (set by the engine, not a choice)
    stage: int = field(default=0, repr=False)

    def __post_init__(self):
        if str(self.cache).lower() in ("quantized", "quanto", "hqq"):     # names users reach for: refused
            raise ConfigError("cache", self.cache, "dynamic, static, fp8, quanto-int4 or quanto-int2",
                              "transformers' QuantizedCache is modelled with the fp8 backend (--cache fp8) and the "
                              "quanto backend at 4 or 2 bits (--cache quanto-int4, --cache quanto-int2); its HQQ "
                              "backend (hqq's own quantizer and layout, moved and cast after quantizing) is not. "
                              "Otherwise use --cache dynamic or --cache static.")
        for part in PARTS:
            if part.registry is not None:     # canonical names: "AdamW" is "adamw"
                object.__setattr__(self, part.field, part.registry.lookup(getattr(self, part.field)).name)
        self._check_quanto()
        object.__setattr__(self, "recompute", Recompute.parse(self.recompute))
        object.__setattr__(self, "parallel", Parallel.parse(self.parallel))
        lora = LoRA.parse(self.lora, self.lora_targets)
        object.__setattr__(self, "lora", lora)
        object.__setattr__(self, "lora_targets", lora.targets if lora else None)
        if lora is None and self.lora_dtype != "float32":
            raise ConfigError("lora_dtype", self.lora_dtype, "adapters to place (--lora R)",
                              "Give --lora too, or leave --lora-dtype out.")
        k = self.accumulate
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError("accumulate", k, "a whole number of micro-batches >= 1",
                              "1 means no gradient accumulation.")
        for f in ("quantize_skip", "keep_fp32"):
            object.__setattr__(self, f, parse_regions(getattr(self, f), f) or None)
        if self.keep_fp32 and not self.prec.autocast:
            raise ConfigError("precision with --keep-fp32", self.precision, "bf16-mixed or fp16-mixed",
                              "Modules are kept in float32 by leaving them out of torch.autocast; a model "
                              "cast whole to one dtype has no float32 weights to run them in.")
        if self.mode == "inference":
            self._check_inference()
        elif self.logits != "last":
            raise ConfigError("logits", self.logits, "the prefill's logits to size (--mode inference)",
                              "Give --mode inference too, or leave --logits out: a training step's logits "
                              "cover every position.")
        elif self.cache != "dynamic" or self.max_cache_len is not None:
            raise ConfigError("cache", self.cache, "a KV cache to size (--mode inference)",
                              "Give --mode inference too, or leave --cache out.")
        if self.prec.fp8:
            self._check_fp8()
        if not self.parallel.is_single:
            self._check_parallel()
        if self.quantize != "none":
            self._check_quantize()
        elif self.quantize_skip:
            raise ConfigError("quantize_skip", ",".join(self.quantize_skip), "layers to keep out of --quantize",
                              "Give --quantize int4 (or int8) too, or leave --quantize-skip out.")

    def _check_inference(self):
        """Inference is modelled for a whole model in one precision (fp32, bf16, fp16) or
        under autocast, with nothing of training's: no recomputation, micro-batches,
        adapters, quantization, float32 regions or FP8."""
        if self.step not in ("prefill", "decode"):
            raise ConfigError("step", self.step, "prefill or decode")
        n = self.max_cache_len
        if n is not None:
            if self.cache != "static":
                raise ConfigError("max_cache_len", n, "a static cache to size (--cache static)",
                                  "Give --cache static too, or leave --max-cache-len out.")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError("max_cache_len", n, "a whole number of positions >= 1",
                                  "Leave it out for s + n_g, the length generate preallocates.")
        if self.prec.fp8:
            raise ConfigError("precision with --mode inference", self.precision,
                              "fp32, bf16, fp16, bf16-mixed or fp16-mixed",
                              "FP8 inference (Transformer Engine) is not modelled.")
        for name, value, default in (("recompute", self.recompute.mode, "none"), ("accumulate", self.accumulate, 1),
                                     ("lora", self.lora, None), ("quantize", self.quantize, "none"),
                                     ("keep_fp32", self.keep_fp32, None)):
            if value != default:
                raise ConfigError(f"{name} with --mode inference", value if name != "lora" else str(value),
                                  f"{default} (inference has no backward to recompute for, no optimizer step, "
                                  "and quantized or adapted inference is not modelled)",
                                  f"Leave --{name.replace('_', '-')} out with --mode inference.")

    @property
    def fsdp_mixed(self) -> bool:
        """Under FSDP, is the precision FSDP2's MixedPrecisionPolicy (a half-precision model with
        a float32 master copy: bf16-master, fp16-master)? (:mod:`symmem.passes.shard`)"""
        return bool(self.prec.master) and not self.prec.fp8

    @property
    def quanto_flush(self) -> bool:
        """Whether a quanto cache's decoding step re-quantizes the whole cache."""
        return self.residual_position == self.residual_length - 1

    def _check_quanto(self):
        """A quanto cache's residual_length >= 1, q_group_size >= 1 and residual_position in
        [0, residual_length - 1] (None: the flush step, residual_length - 1); only with one."""
        fields = {"residual_length": 128, "q_group_size": 64, "residual_position": None}
        if self.cache not in QUANTO_BITS:
            for name, default in fields.items():
                if getattr(self, name) != default:
                    raise ConfigError(name, getattr(self, name), "a quanto cache (--cache quanto-int4 or quanto-int2)",
                                      f"Give --cache quanto-int4 too, or leave --{name.replace('_', '-')} out.")
            return
        for name in ("residual_length", "q_group_size"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(name, n, "a whole number >= 1", f"Leave --{name.replace('_', '-')} out for "
                                                                  f"transformers' default, {fields[name]}.")
        p, r = self.residual_position, self.residual_length
        if p is None:
            object.__setattr__(self, "residual_position", r - 1)
        elif isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < r:
            raise ConfigError("residual_position", p, f"a whole number of positions from 0 to residual_length - 1 "
                                                      f"= {r - 1}",
                              "The residual holds (n_g - 1) mod residual_length positions before decoding step "
                              "n_g; leave --residual-position out for the flush step (residual_length - 1).")

    def _check_parallel(self):
        """Sharding is modelled for a training step of one micro-batch per optimizer step from
        ZeRO-2 on (gradient accumulation into sharded gradients is not modelled yet)."""
        par = self.parallel
        if self.mode == "inference":
            raise ConfigError("parallel with --mode inference", str(par), "none",
                              "Data-parallel inference is one model per device: derive one device.")
        half = {"bfloat16": "bf16", "float16": "fp16"}.get(self.prec.compute)
        if par.reduce_dtype != "fp32" and not (self.fsdp_mixed and par.reduce_dtype == half):
            raise ConfigError("reduce_dtype", par.reduce_dtype, "fp32, or the parameters' half dtype under FSDP's "
                              "mixed precision (bf16 with --precision bf16-master, fp16 with fp16-master)",
                              f"With --precision {self.precision} FSDP reduces in the gradients' own dtype: leave "
                              "--reduce-dtype out.")
        if par.stage >= 2 and self.accumulate > 1:
            raise ConfigError("accumulate with sharded gradients", self.accumulate,
                              "1 (accumulation into sharded gradients, ZeRO-2/3 and FSDP, is not modelled yet)",
                              "Use --zero 1 or DDP with --accumulate, or leave --accumulate out.")
        if par.pp > 1:
            self._check_pipeline()

    def _check_pipeline(self):
        """A pipeline's micro-batches are its own (``--microbatches``); its stages are cut from
        one block of alike layers, with sharding at most ZeRO-1 beside them (as Megatron and
        DeepSpeed's pipeline engine allow)."""
        par = self.parallel
        if self.accumulate > 1:
            raise ConfigError("accumulate with --pp", self.accumulate,
                              "1: a pipeline accumulates over its own micro-batches",
                              f"Give --microbatches {self.accumulate * par.microbatches} instead of --accumulate.")
        if par.stage >= 2:
            raise ConfigError("pp with sharded gradients", f"pp={par.pp}, zero stage {par.stage}",
                              "ZeRO-1 (--zero 1: Megatron's distributed optimizer) or none beside a pipeline",
                              "Megatron and DeepSpeed's pipeline engine shard the optimizer states only; "
                              "use --zero 1 or leave --pp out.")
        for name, value in (("keep_fp32", self.keep_fp32), ("quantize_skip", self.quantize_skip)):
            if value:
                raise ConfigError(f"{name} with --pp", ",".join(value), "none (layer ranges across pipeline "
                                  "stages are not modelled yet)", f"Leave --{name.replace('_', '-')} out.")
        if self.recompute.mode not in ("none", "full", "selective", "every", "nth"):
            raise ConfigError("recompute with --pp", str(self.recompute), "none, full, selective, every:K or nth:K "
                              "(layer ranges across pipeline stages are not modelled yet)",
                              "Use --recompute full or every:K.")
        if not 0 <= self.stage < par.pp:
            raise ConfigError("stage", self.stage, f"a pipeline rank from 0 to {par.pp - 1}")

    def _check_fp8(self):
        """Transformer Engine's FP8 GEMMs run on CUDA (compute capability 8.9 and later), and
        its layers are not modelled under adapters or quantization."""
        if self.device != "cuda":
            raise ConfigError("device with --precision fp8", self.device, "cuda",
                              "Transformer Engine's FP8 kernels run on NVIDIA GPUs of compute capability "
                              "8.9 and later (Ada, Hopper, Blackwell).")
        if self.lora is not None or self.quantize != "none":
            raise ConfigError("precision", self.precision, "a precision without --lora or --quantize",
                              "FP8 training is modelled for full training of Transformer Engine's layers; "
                              "adapters over them are not modelled yet.")

    def _check_quantize(self):
        """What bitsandbytes' layers are modelled with: LoRA adapters on a model loaded in one
        dtype (the layers compute in it)."""
        q = self.quantize
        if self.lora is None:
            raise ConfigError("quantize", q, "a quantized model with LoRA adapters (--lora R)",
                              "A quantized model trains adapters only (transformers' Trainer refuses "
                              "a purely quantized one): add --lora 16 for QLoRA.")
        if self.prec.autocast or self.prec.master:
            raise ConfigError("precision with --quantize", self.precision, "fp32, bf16 or fp16",
                              "Load the model in one dtype and compute the quantized layers in it, as "
                              "QLoRA does (torch_dtype and bnb_4bit_compute_dtype bfloat16): --precision "
                              "bf16. Autocast over quantized layers is not modelled.")

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step: the pipeline's (``parallel.microbatches``) or the
        accumulated ones (``accumulate``)."""
        return self.parallel.microbatches if self.parallel.pp > 1 else self.accumulate

    @property
    def prec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def quant(self) -> Quantization:
        return QUANTIZE[self.quantize]

    @property
    def opt(self) -> Optimizer:
        return OPTIMIZERS[self.optimizer]

    @property
    def impl(self) -> str:
        """The implementation the step runs: PyTorch's default for ``auto`` (foreach on CUDA
        where the optimizer has one, else its for-loop)."""
        if self.implementation != "auto":
            return self.implementation
        return "foreach" if self.device == "cuda" and self.opt.has("foreach") else "for-loop"

    @property
    def step_on_device(self) -> bool:
        """Are the optimizer's step counters device memory?"""
        return self.opt.counters_on_device(self.device, self.impl)

    def ctx(self) -> Ctx:
        cp = self.parallel.cp
        return replace(self.prec.ctx(self.device), batch_one=self.batch_one, no_grad=self.mode == "inference",
                       ring=not (isinstance(cp, int) and cp == 1))

    def _inference_precision(self) -> str:
        """The precision in words for inference: no gradient, optimizer state or scaler."""
        p = self.prec
        if p.autocast:
            return (f"torch.autocast(dtype=torch.{p.compute}): float32 weights; {p.compute} activations where "
                    f"autocast casts, and cached {p.compute} copies of the weights during forward")
        return (f"model.to(torch.{p.compute}): " if p.compute != "float32" else "") + \
            f"weights and activations in {p.compute}"

    def bindings(self) -> dict:
        """Numbers for the byte symbols (optimizer states in the dtype of what they step), and
        the LoRA rank ``r`` where it is a number."""
        return {**self.prec.bindings(), **(self.lora.symbol_value if self.lora else {}),
                **self.parallel.bindings()}

    def describe(self, kernels: tuple = ()) -> str:
        """The policy in words; ``kernels``: the attention kernels ``sdpa`` picked, named
        beside it (``attention sdpa (flash)``)."""
        att = self.attention + (f" ({', '.join(kernels)})" if self.attention == "sdpa" and kernels else "")
        if self.mode == "inference":
            cache = self.cache + (f", max_cache_len {self.max_cache_len}" if self.max_cache_len is not None else "")
            kv, step = f"{'an' if cache == 'fp8' else 'a'} {cache} KV cache", "one decoding step"
            if self.cache in QUANTO_BITS:
                kv += f" of residual_length {self.residual_length} and q_group_size {self.q_group_size}"
                step += (f" with {self.residual_position} position{'' if self.residual_position == 1 else 's'} in "
                         f"the residual before it, as decoding step "
                         f"n_g has when n_g - 1 = {self.residual_position} mod {self.residual_length}"
                         f"{': the flush, re-quantizing the whole cache' if self.quanto_flush else ''}")
            return (f"inference with {kv} (prefill and {step}; torch.no_grad; the "
                    f"prefill's logits: {'last position' if self.logits == 'last' else 'every position'}); "
                    f"{self.precision} ({self._inference_precision()}); device {self.device}; attention {att}")
        out = (f"{self.precision} ({self.prec.description}); {self.optimizer} "
               f"[{self.impl}] ({self.opt.description}); device {self.device}; attention {att}")
        if self.recompute.mode != "none":
            out += f"; recompute {self.recompute}"
        if self.accumulate > 1:
            out += f"; {self.accumulate} micro-batches of b per optimizer step (batch b*{self.accumulate})"
        if self.lora:
            out += f"; {self.lora}, the rest frozen"
        if self.quantize != "none":
            out += f"; {self.quantize} ({self.quant.description})"
            if self.quantize_skip:
                out += f", except {', '.join(self.quantize_skip)}"
        if self.keep_fp32:
            out += f"; {', '.join(self.keep_fp32)} kept in float32 (autocast off)"
        if not self.parallel.is_single:
            out += f"; {self.parallel.describe()}"
        return out


@dataclass(frozen=True)
class Part:
    """One part of a policy as the command line offers it: the Policy field, its option,
    the registry its names come from (None for a number or a spec), its default."""
    field: str
    option: str
    registry: Registry | None
    metavar: str
    help: str

    @property
    def default(self):
        return Policy.__dataclass_fields__[self.field].default


PARTS = (
    Part("precision", "--precision", PRECISIONS, "NAME", "bytes per element of each role"),
    Part("optimizer", "--optimizer", OPTIMIZERS, "NAME", "the optimizer's states and step"),
    Part("implementation", "--implementation", IMPLEMENTATIONS, "NAME", "the optimizer's implementation"),
    Part("device", "--device", DEVICES, "NAME", "where the step runs"),
    Part("recompute", "--recompute", None, "SPEC",
         "activation recomputation: none, full, every:K, selective, last:N (add ,reentrant for "
         "use_reentrant=True)"),
    Part("accumulate", "--accumulate", None, "K", "micro-batches of size b per optimizer step"),
    Part("attention", "--attention", ATTENTION, "NAME", "the attention kernel"),
    Part("lora", "--lora", None, "R",
         "LoRA adapters of rank R (r: the rank as a symbol) on --lora-targets, every other weight frozen"),
    Part("lora_targets", "--lora-targets", None, "NAMES",
         "the projections LoRA adapts, comma-separated (None: peft's default for the model: c_attn for "
         "GPT-2, q_proj,v_proj for Llama)"),
    Part("lora_dtype", "--lora-dtype", LORA_DTYPES, "NAME",
         "the adapters' dtype on a bf16/fp16 model: float32 (peft's default) or the model's"),
    Part("quantize", "--quantize", QUANTIZE, "NAME",
         "frozen linear weights stored quantized by bitsandbytes (with --lora: QLoRA is int4)"),
    Part("quantize_skip", "--quantize-skip", None, "NAMES",
         "layers --quantize keeps in the model's dtype: module names (c_proj) and first:N, last:N"),
    Part("keep_fp32", "--keep-fp32", None, "NAMES",
         "modules run in float32 with autocast off (bf16-mixed, fp16-mixed): module names (lm_head, attn) "
         "and first:N, last:N"),
    Part("parallel", "--parallel", None, "SPEC",
         "the parallel layout: none, or KEY=VALUE pairs (dp=8,zero=3); --dp, --zero, --fsdp, --offload, ... "
         "set the same"),
    Part("mode", "--mode", MODES, "NAME", "a training step, or inference (generation with a KV cache)"),
    Part("cache", "--cache", CACHES, "NAME", "the KV cache's kind (--mode inference)"),
    Part("logits", "--logits", LOGITS, "NAME",
         "the prefill's logits (--mode inference): last (generate's logits_to_keep=1) or all positions"),
    Part("max_cache_len", "--max-cache-len", None, "N",
         "the positions a static cache preallocates (--cache static; default s + n_g, as generate sets it)"),
    Part("residual_length", "--residual-length", None, "N",
         "a quanto cache's residual_length: positions kept unquantized before it re-quantizes everything"),
    Part("q_group_size", "--q-group-size", None, "G", "a quanto cache's q_group_size: elements per scale and shift"),
    Part("residual_position", "--residual-position", None, "P",
         "a quanto cache's positions in the residual before the decoding step modelled, (n_g - 1) mod "
         "residual_length (default residual_length - 1: the flush step, which re-quantizes)"),
)
