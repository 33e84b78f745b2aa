"""The parallel layout: how many ranks share a training step, and how they split its memory.

A :class:`Parallel` names the degrees of each form of parallelism (data ``dp``, tensor
``tp``, pipeline ``pp``, context ``cp``, expert ``ep``), the pipeline's schedule, and how
data-parallel ranks shard the model states (ZeRO stage, or FSDP's strategy) and what they
offload to the host. A degree is an integer or the symbol of :mod:`symmem.symbols` (``"d"``
for data parallelism): the formulas stay in ``d`` and a number is bound like a config value.

What is modelled today: data parallelism (PyTorch DDP's gradient buckets), ZeRO stages 1-3
(DeepSpeed), FSDP's full, grad-op and hybrid sharding, and offload of the optimizer states and
of the parameters (:mod:`symmem.passes.shard`); Megatron's tensor and sequence parallelism
(:mod:`symmem.passes.tensor`); pipeline parallelism with the GPipe, 1F1B and interleaved
schedules (:mod:`symmem.passes.pipeline`), each stage a rank of its own; context parallelism as
torch's load-balanced ring attention (:mod:`symmem.passes.context`); expert parallelism as
transformers' ``AllToAllEP`` (:mod:`symmem.passes.expert`).

A spec string names the same thing on a command line: ``"dp=8,zero=3,offload=optimizer"``
(``"none"``: one device).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import sympy

from ..errors import ConfigError
from ..symbols import c as _c, d as _d, e as _e, t as _t

__all__ = ["Parallel", "FSDP", "OFFLOAD", "SCHEDULES", "DEGREES", "EP_LOADS"]

#: FSDP's sharding strategies (torch.distributed.fsdp.ShardingStrategy; FSDP2's
#: ``fully_shard(reshard_after_forward=...)`` and a 2-D mesh for hybrid).
FSDP = {"full": "FULL_SHARD: parameters, gradients and optimizer states sharded; each unit's "
                "parameters gathered for its forward and again for its backward (ZeRO-3)",
        "grad-op": "SHARD_GRAD_OP: gradients and optimizer states sharded; a unit's parameters gathered "
                   "in forward stay whole until its backward (reshard_after_forward=False: ZeRO-2's peak)",
        "hybrid": "HYBRID_SHARD: FULL_SHARD within groups of shard_size ranks (a node), replicated across "
                  "them"}
#: What FSDP's mixed precision reduce-scatters gradients in (MixedPrecisionPolicy.reduce_dtype).
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
#: What leaves the device: the optimizer states (and master weights, the step on the host),
#: the parameters (and their gradients), or both.
OFFLOAD = {"none": "everything on the device",
           "optimizer": "master weights, optimizer states and the step on the host (DeepSpeed's "
                        "offload_optimizer: cpu, ZeRO-Offload)",
           "params": "the sharded parameters on the host, gathered to the device per unit (DeepSpeed's "
                     "offload_param: cpu with ZeRO-3; FSDP's CPUOffload(offload_params=True), which "
                     "moves the gradients and the step to the host too)",
           "both": "optimizer and params"}
#: Pipeline schedules (:mod:`symmem.passes.pipeline`).
SCHEDULES = {"gpipe": "every micro-batch's forward, then every backward (GPipe; torch's ScheduleGPipe)",
             "1f1b": "one forward, one backward in turn after p - r - 1 warm-up forwards (PipeDream-Flush; "
                     "Megatron's default, torch's Schedule1F1B)",
             "interleaved": "1F1B over v chunks of layers per rank (Megatron's virtual pipeline stages; "
                            "torch's ScheduleInterleaved1F1B)"}
#: How a mixture of experts' router spreads the (token, expert) pairs over the expert-parallel
#: ranks (:mod:`symmem.passes.expert`): the rows the most loaded rank's experts receive.
EP_LOADS = {"balanced": "every expert gets b s K / E pairs from each rank: a rank receives b s K rows",
            "worst": "every pair of every rank goes to one rank's experts: it receives e b s K rows"}
#: The degree fields, their symbol where symmem has one, and the option that sets them.
DEGREES = {"dp": _d, "tp": _t, "pp": None, "cp": _c, "ep": _e}


def _degree(name: str, value):
    """An integer >= 1, or the degree's symbol (given as itself or as its name)."""
    sym = DEGREES[name]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, str) and sym is not None and value.strip() == sym.name:
        return sym
    if isinstance(value, sympy.Symbol) and value == sym:
        return value
    if isinstance(value, sympy.Integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = f"a whole number >= 1 or the symbol {sym.name}" if sym is not None else "a whole number >= 1"
        raise ConfigError(name, value, allowed, f"--{name} 8 runs 8 ranks; 1 is none.")
    return value


def _is_one(x) -> bool:
    return isinstance(x, int) and x == 1


@dataclass(frozen=True)
class Parallel:
    """Degrees of parallelism and how data-parallel ranks shard and offload.

    ``dp``: data-parallel ranks (an integer or the symbol ``d``); ``zero``: DeepSpeed's ZeRO
    stage 0-3; ``fsdp``: None, ``"full"``, ``"grad-op"`` or ``"hybrid"`` (not with ``zero``);
    ``shard_size``: the ranks a hybrid shard spans (8: one node of eight GPUs, an assumption
    to state); ``offload``: ``"none"``, ``"optimizer"``, ``"params"`` or ``"both"``. ``tp``,
    ``sp``: Megatron's tensor-parallel degree (an integer or the symbol ``t``) and sequence
    parallelism beside it. ``pp``: pipeline stages (an integer); ``schedule``: ``"gpipe"``,
    ``"1f1b"`` or ``"interleaved"``; ``virtual_stages``: chunks of layers per rank (interleaved
    only); ``microbatches``: micro-batches per optimizer step, each of ``b``. ``cp``: ranks each
    sequence is split over (an integer or the symbol ``c``: torch's ring attention); ``ep``:
    ranks a mixture of experts' experts are split over (an integer or the symbol ``e``);
    ``ep_load``: ``"balanced"`` or ``"worst"`` routing over them (:data:`EP_LOADS`). ``reduce_bucket``:
    DeepSpeed's ``reduce_bucket_size`` (elements of its gradient bucket, 5e8 by default; FSDP
    has none); ``prefetch``: units gathered ahead of the one computed (ZeRO-3, FSDP; 1);
    ``reduce_dtype``: what FSDP's mixed precision (a ``*-master`` precision under ``fsdp``)
    reduce-scatters the gradients in, ``"fp32"`` (``MixedPrecisionPolicy(reduce_dtype=
    torch.float32)``, the default) or the parameters' half dtype (``"bf16"``, ``"fp16"``)."""
    dp: object = 1
    zero: int = 0
    fsdp: str | None = None
    shard_size: int = 8
    tp: object = 1
    sp: bool = False
    pp: object = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    cp: object = 1
    ep: object = 1
    ep_load: str = "balanced"
    offload: str = "none"
    reduce_bucket: int = 500_000_000
    prefetch: int = 1
    reduce_dtype: str = "fp32"

    def __post_init__(self):
        for name in DEGREES:
            object.__setattr__(self, name, _degree(name, getattr(self, name)))
        z = self.zero
        if isinstance(z, str) and z.strip().isdigit():
            z = int(z)
        if isinstance(z, bool) or not isinstance(z, int) or not 0 <= z <= 3:
            raise ConfigError("zero", self.zero, "a ZeRO stage 0, 1, 2 or 3",
                              "1 shards the optimizer states, 2 also the gradients, 3 also the parameters.")
        object.__setattr__(self, "zero", z)
        fsdp = None if self.fsdp in (None, "none", "") else str(self.fsdp).lower().replace("_", "-")
        if fsdp is not None and fsdp not in FSDP:
            raise ConfigError("fsdp", self.fsdp, f"one of {', '.join(FSDP)}",
                              "full is FULL_SHARD (ZeRO-3), grad-op SHARD_GRAD_OP (ZeRO-2), hybrid HYBRID_SHARD.")
        object.__setattr__(self, "fsdp", fsdp)
        if fsdp is not None and z:
            raise ConfigError("zero with fsdp", f"zero={z}, fsdp={fsdp}", "either a ZeRO stage or an FSDP strategy",
                              "FSDP is PyTorch's ZeRO: --fsdp full is stage 3, --fsdp grad-op stage 2; give one.")
        load = str(self.ep_load).lower()
        if load not in EP_LOADS:
            raise ConfigError("ep_load", self.ep_load, f"one of {', '.join(EP_LOADS)}",
                              "balanced: each rank's experts receive b s K rows; worst: one rank's receive all e b s K.")
        object.__setattr__(self, "ep_load", load)
        off = str(self.offload).lower()
        if off not in OFFLOAD:
            raise ConfigError("offload", self.offload, f"one of {', '.join(OFFLOAD)}")
        object.__setattr__(self, "offload", off)
        if off != "none" and not (z >= 1 or fsdp):
            raise ConfigError("offload", off, "a sharded run (--zero 1, 2 or 3, or --fsdp)",
                              "DeepSpeed offloads through its ZeRO optimizer and PyTorch through FSDP's CPUOffload; "
                              "add --zero 2 (optimizer) or --zero 3 (params).")
        if off in ("params", "both") and not (z == 3 or fsdp in ("full", "hybrid")):
            raise ConfigError("offload", off, "parameters sharded: --zero 3 or --fsdp full|hybrid",
                              f"DeepSpeed offloads parameters with ZeRO-3 only (zero={z}, fsdp={fsdp}); "
                              "--offload optimizer works from stage 1.")
        rd = str(self.reduce_dtype).lower()
        if rd not in REDUCE_DTYPES:
            raise ConfigError("reduce_dtype", self.reduce_dtype, f"one of {', '.join(REDUCE_DTYPES)}",
                              "FSDP's MixedPrecisionPolicy reduces in float32 (fp32) or in the parameters' dtype.")
        if rd != "fp32" and fsdp is None:
            raise ConfigError("reduce_dtype", rd, "fp32 without --fsdp (it is FSDP's MixedPrecisionPolicy's)",
                              "Add --fsdp full, or leave --reduce-dtype out.")
        object.__setattr__(self, "reduce_dtype", rd)
        for name, low in (("reduce_bucket", 0), ("prefetch", 0), ("virtual_stages", 1), ("microbatches", 1)):
            v = getattr(self, name)
            if isinstance(v, str) and v.strip().isdigit():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(name, v, f"a whole number >= {low}")
            object.__setattr__(self, name, v)
        ss = self.shard_size
        if isinstance(ss, bool) or not isinstance(ss, int) or ss < 1:
            raise ConfigError("shard_size", ss, "a whole number >= 1 (the ranks of one hybrid shard group)")
        if fsdp == "hybrid" and isinstance(self.dp, int) and self.dp % ss:
            raise ConfigError("dp with fsdp hybrid", self.dp, f"a multiple of the shard group's {ss} ranks",
                              f"HYBRID_SHARD shards within groups of shard_size = {ss} ranks and replicates "
                              f"across them; use --dp {ss * max(1, self.dp // ss)} or --shard-size.")
        self._check_layout()

    def _check_layout(self):
        """Sequence parallelism needs tensor parallelism; the pipeline's schedule checked."""
        if self.sp and _is_one(self.tp):
            raise ConfigError("sp", True, "tensor parallelism beside it (tp > 1): sequence parallelism splits "
                              "the layers' norms and dropouts over the tensor-parallel ranks", "Add --tp 2 (or more).")
        self._check_schedule()

    def _check_schedule(self):
        schedule = str(self.schedule).lower().replace("-", "")
        if schedule not in SCHEDULES:
            raise ConfigError("schedule", self.schedule, f"one of {', '.join(SCHEDULES)}",
                              "1f1b is Megatron's default; interleaved needs --virtual-stages 2 or more.")
        object.__setattr__(self, "schedule", schedule)
        p, v, m = self.pp, self.virtual_stages, self.microbatches
        if p == 1 and (schedule != "1f1b" or v != 1 or m != 1):
            raise ConfigError("pp", p, "2 or more pipeline stages for a schedule, virtual stages or micro-batches",
                              "Add --pp 2 (or more); without a pipeline, micro-batches are --accumulate.")
        if schedule == "interleaved":
            if v < 2:
                raise ConfigError("virtual_stages", v, "2 or more chunks per rank for the interleaved schedule",
                                  "Give --virtual-stages 2, or --schedule 1f1b.")
            if m % p:
                raise ConfigError("microbatches", m, f"a multiple of the {p} pipeline stages (the interleaved "
                                  "schedule runs micro-batches in groups of p)",
                                  f"Take --microbatches {p * max(1, round(m / p))}.")
        elif v != 1:
            raise ConfigError("virtual_stages", v, f"1 with the {schedule} schedule (chunks per rank are the "
                              "interleaved schedule's)", "Give --schedule interleaved, or leave --virtual-stages out.")

    # ----- what the layout means ------------------------------------------------------------
    @property
    def stage(self) -> int:
        """The ZeRO stage whose states the layout shards: FSDP full and hybrid are 3, grad-op 2."""
        return {"full": 3, "hybrid": 3, "grad-op": 2}.get(self.fsdp, self.zero)

    def splits(self, degree: str) -> bool:
        """Does the degree ``degree`` ("tp", "cp", "ep", ...) split the step: a number above 1
        or a symbol?"""
        return not _is_one(getattr(self, degree))

    @property
    def sharded(self) -> bool:
        return self.stage >= 1

    @property
    def shard_degree(self):
        """The ranks the states are sharded over: ``d`` (the symbol, bound to ``dp`` where it
        is a number), or a hybrid group's ``shard_size``."""
        return sympy.Integer(self.shard_size) if self.fsdp == "hybrid" else _d

    @property
    def ddp(self) -> bool:
        """Plain data parallelism (PyTorch DDP's gradient buckets): dp > 1, nothing sharded."""
        return not self.sharded and not _is_one(self.dp)

    @property
    def offload_optimizer(self) -> bool:
        return self.offload in ("optimizer", "both") or (self.fsdp is not None and self.offload == "params")

    @property
    def offload_params(self) -> bool:
        return self.offload in ("params", "both")

    @property
    def data_single(self) -> bool:
        """One data-parallel rank, nothing sharded or offloaded (the buckets' and prefetch's
        sizes then change nothing)."""
        return _is_one(self.dp) and not self.zero and self.fsdp is None and self.offload == "none"

    @property
    def is_single(self) -> bool:
        """One device: one data-parallel rank (:attr:`data_single`), no tensor, pipeline, context
        or expert parallelism."""
        return self.data_single and _is_one(self.tp) and self.pp == 1 and _is_one(self.cp) and _is_one(self.ep)

    def micro_batch(self, global_batch: int, accumulate: int = 1):
        """The micro-batch ``b`` of each rank for a global batch: ``global_batch / (dp *
        accumulate)`` (``accumulate``: the pipeline's micro-batches under ``pp``), which must be
        whole (a ConfigError naming the three otherwise)."""
        if self.pp > 1:
            accumulate = self.microbatches
        ranks = self.dp * accumulate
        if isinstance(ranks, int):
            if global_batch % ranks:
                raise ConfigError("global batch", global_batch,
                                  f"a multiple of dp * accumulate = {self.dp} * {accumulate} = {ranks}",
                                  f"Each of the {self.dp} ranks runs {accumulate} micro-batches of equal size: "
                                  f"take a global batch of {ranks * max(1, round(global_batch / ranks))}.")
            return global_batch // ranks
        return sympy.Integer(global_batch) / ranks

    def bindings(self) -> dict:
        """``{d: dp, t: tp, c: cp, e: ep}`` where they are numbers (the formulas stay in the
        symbols given)."""
        return {sym: sympy.Integer(v) for sym, v in ((_d, self.dp), (_t, self.tp), (_c, self.cp), (_e, self.ep))
                if isinstance(v, int)}

    # ----- names ----------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec) -> "Parallel":
        """A Parallel, ``"none"`` (one device) or a spec ``"dp=8,zero=3,offload=optimizer"``."""
        if isinstance(spec, Parallel):
            return spec
        if spec is None or str(spec).strip().lower() in ("", "none"):
            return cls()
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for item in str(spec).split(","):
            key, sep, value = item.strip().partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in known:
                raise ConfigError("parallel", spec, "none, or KEY=VALUE pairs, comma-separated, KEY one of "
                                  + ", ".join(sorted(known)), "E.g. dp=8,zero=3 or dp=d,fsdp=full.")
            value = value.strip()
            if key == "sp":
                value = value.lower() in ("1", "true", "yes")
            elif key in ("zero", "shard_size", "virtual_stages", "microbatches", "reduce_bucket",
                         "prefetch") and value.isdigit():
                value = int(value)
            kwargs[key] = value
        return cls(**kwargs)

    def __str__(self) -> str:
        """The spec :meth:`parse` reads back: the fields that differ from one device."""
        if self == Parallel():
            return "none"
        default = Parallel()
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if getattr(self, f.name) != getattr(default, f.name))

    def describe(self) -> str:
        """The layout in words."""
        if self.is_single:
            return "one device"
        tensor = (f"tensor parallel over tp = {self.tp}" + (" with sequence parallelism" if self.sp else "")
                  if not _is_one(self.tp) else "")
        if not _is_one(self.cp):
            ring = f"context parallel over cp = {self.cp} (ring attention)"
            tensor = f"{tensor}, {ring}" if tensor else ring
        if not _is_one(self.ep):
            experts = (f"expert parallel over ep = {self.ep} (E / ep experts a rank, all-to-all dispatch, "
                       f"{self.ep_load} routing)")
            tensor = f"{tensor}, {experts}" if tensor else experts
        if self.pp > 1:
            chunks = f", {self.virtual_stages} chunks per rank" if self.virtual_stages > 1 else ""
            pipe = (f"pipeline over pp = {self.pp} stages ({self.schedule}{chunks}, {self.microbatches} "
                    f"micro-batch{'es' * (self.microbatches != 1)} per step)")
            tensor = f"{tensor}, {pipe}" if tensor else pipe
        if self.data_single:
            return tensor
        out = self._describe_data()
        return f"{tensor}, {out}" if tensor else out

    def _describe_data(self) -> str:
        if self.fsdp:
            out = f"FSDP {self.fsdp} over dp = {self.dp}"
            if self.fsdp == "hybrid":
                out += f" (sharded within groups of {self.shard_size} ranks)"
            if not _is_one(self.ep):
                out += " (each layer's experts a unit, over the dp / ep ranks holding them)"
            if self.reduce_dtype != "fp32":
                out += f", gradients reduced in {self.reduce_dtype}"
        elif self.zero:
            out = f"ZeRO-{self.zero} over dp = {self.dp}"
        else:
            out = f"DDP over dp = {self.dp} (gradient buckets beside the gradients)"
        if self.offload != "none":
            out += f", offload {self.offload} to the host"
        return out
