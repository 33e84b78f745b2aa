"""The smallest cluster that fits: the layouts that train a model on a GPU, fewest GPUs first.

:func:`fit` takes a model, a budget (a GPU of the catalog, or bytes), a sequence length and a
global batch, and tries every layout symmem models: GPU counts 1, 2, 4, ... up to
``max_gpus``; Megatron's tensor parallelism with sequence parallelism over ``tp`` = 1, 2, 4, 8
(within a node of eight); pipeline stages ``pp`` = 1, 2, 4, ... up to ``max_pp`` that divide
the layers, 1F1B (Megatron's default schedule) and, with ``max_v`` > 1, Megatron's interleaved
1F1B over ``v`` = 2, 4, ... ``max_v`` chunks a rank (``pp * v`` dividing the layers, the
micro-batches a multiple of ``pp``); with ``max_cp`` > 1, context parallelism over
``cp`` = 2, 4, ... ``max_cp`` ranks with ``2 cp | seq`` (torch's ring attention: long
sequences); the rest data-parallel, ``dp = gpus / (tp * pp * cp)``; DDP, ZeRO 1-3 and FSDP full
sharding (each of a tensor-parallel rank's own parameters; beside a pipeline DDP and ZeRO-1
only, as Megatron and DeepSpeed's pipeline engine allow); no recomputation, selective or full;
with ``max_ep`` > 1, for a mixture of experts, expert parallelism over ``ep`` = 2, 4, ... ``max_ep``
ranks dividing its experts and ``dp`` (beside DDP or FSDP full sharding, without tp, pp or cp:
what :mod:`symmem.passes.expert` models); and the largest micro-batch ``b`` dividing
``global_batch / dp`` whose step fits, with ``k = global_batch / (dp * b)`` micro-batches
accumulated (ZeRO 2 and 3 accumulate none: not modelled yet, so ``b = global_batch / dp``
there; FSDP likewise) or, under a pipeline, run through it (``k >= pp``: fewer micro-batches
than stages leave stages idle).

Each layout's peak is exact (:meth:`symmem.engine.Estimate.at`): one derivation per kind of
layout, with the degrees ``d`` and ``t`` and the batch left as symbols, evaluated for every
count. Two shortcuts, both exact: a layout whose states (:data:`STATES`, the same at every
batch, never above the peak) exceed the budget is left at its first batch tried, so b = 1's
own derivation is not made; and one whose states cannot fit even at the best split
(:func:`_states_floor`, from one rank's states) is not derived at all: for a model of tens of
billions of parameters, every count of GPUs too small for its states. Accumulating ``k >= 2``
micro-batches peaks as two do (the later micro-batches are alike: each runs beside the gradients the first left), so ``accumulate=2`` stands for all; a
1F1B pipeline with ``k >= pp + 1`` micro-batches peaks as with ``pp + 1`` (the first stage's
last warm-up forwards run beside the first backward's gradients from ``pp + 1`` on; ``k = pp``
is derived on its own); interleaved, ``k >= 2 pp`` (multiples of ``pp``) peaks as ``2 pp`` (the
first rank's ``2 (pp - 1) + (v - 1) pp`` warm-up chunk forwards leave at least two steady ones
from ``k v >= (v + 1) pp`` on, :func:`symmem.passes.pipeline.in_flight`; ``k = pp`` on its
own). Context parallelism is derived with its degree ``c`` a symbol for ``cp``
>= 4 and on its own for ``cp = 2`` (whose ring has one step fewer). Expert parallelism is derived
for each ``ep`` (and, under FSDP, each ``dp = ep``: every rank its experts whole) on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from .engine import Estimate, estimate
from .errors import ConfigError
from .gpus import as_budget
from .policy import Policy
from .units import format_bytes

__all__ = ["Layout", "fit", "table", "SHARDINGS", "RECOMPUTE", "TENSOR"]

#: Data-parallel sharding tried, as Parallel fields: DDP, ZeRO 1-3, FSDP full shard.
SHARDINGS = (("ddp", {}), ("zero-1", {"zero": 1}), ("zero-2", {"zero": 2}), ("zero-3", {"zero": 3}),
             ("fsdp-full", {"fsdp": "full"}))
RECOMPUTE = ("none", "selective", "full")
TENSOR = (1, 2, 4, 8)
#: What every rank keeps through the step whatever the batch: the optimizer step runs with all
#: of it, so a peak is never below their sum (checked over policies and layouts in tests/test_fit.py)
STATES = ("params", "buffers", "grads", "master", "optimizer")
#: What a pipeline allows beside it (:func:`symmem.policy.Policy` refuses ZeRO 2-3 and FSDP).
_PIPELINE_SHARDINGS = ("ddp", "zero-1")
#: What expert parallelism allows beside it (:mod:`symmem.passes.expert`).
_EXPERT_SHARDINGS = ("ddp", "fsdp-full")


@dataclass(frozen=True)
class Layout:
    """One layout that fits: ``gpus = dp * tp * pp * cp``; ``sharding`` one of :data:`SHARDINGS`'
    names ("none" on one data-parallel rank); ``micro_batch`` b and ``accumulate`` k with ``dp
    * b * k`` the global batch (under a pipeline, k is its micro-batches per step); ``peak``
    the most loaded rank's exact bytes, ``usable`` the budget's."""
    gpus: int
    dp: int
    tp: int
    sp: bool
    sharding: str
    recompute: str
    micro_batch: int
    accumulate: int
    peak: int
    usable: int
    bytes: dict
    pp: int = 1
    cp: int = 1
    ep: int = 1
    v: int = 1

    @property
    def headroom(self) -> int:
        return self.usable - self.peak

    @property
    def parallel(self) -> str:
        """The layout as ``--parallel`` takes it."""
        return _spec({"dp": self.dp, **dict(SHARDINGS).get(self.sharding, {}),
                      **({"tp": self.tp, "sp": True} if self.tp > 1 else {}),
                      **({"pp": self.pp, "microbatches": self.accumulate} if self.pp > 1 else {}),
                      **({"schedule": "interleaved", "virtual_stages": self.v} if self.v > 1 else {}),
                      **({"cp": self.cp} if self.cp > 1 else {}), **({"ep": self.ep} if self.ep > 1 else {})})

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "dp": self.dp, "tp": self.tp, "sp": self.sp, "pp": self.pp, "cp": self.cp,
                "ep": self.ep, "virtual_stages": self.v,
                "schedule": ("interleaved" if self.v > 1 else "1f1b") if self.pp > 1 else None, "zero": _zero(self.sharding),
                "fsdp": "full" if self.sharding == "fsdp-full" else None, "recompute": self.recompute,
                "micro_batch": self.micro_batch, "accumulate": self.accumulate, "parallel": self.parallel,
                "peak": self.peak, "headroom": self.headroom, "bytes": dict(self.bytes)}


def _zero(sharding: str) -> int:
    return int(sharding[-1]) if sharding.startswith("zero") else 3 if sharding == "fsdp-full" else 0


def fit(graph, budget, seq: int, global_batch: int, *, precision: str = "bf16-mixed",
        optimizer: str = "adamw", device: str = "cuda", max_gpus: int = 64, max_pp: int = 8, max_cp: int = 1,
        max_ep: int = 1, max_v: int = 1, reserve=None, derive=estimate) -> list[Layout]:
    """Every layout of the module docstring that fits ``budget`` (minus ``reserve``: symmem's
    10% rule by default), fewest GPUs first, then the lowest peak. ``max_pp``: the most
    pipeline stages tried (1: none); ``max_cp``: the most context-parallel ranks tried (1, the
    default: none); ``max_ep``: the most expert-parallel ranks tried (1, the default: none;
    models without experts ignore it); ``max_v``: the most chunks a rank of an interleaved
    pipeline tried (1, the default: 1F1B only). ``derive(graph, policy)`` makes the estimates (the
    command line passes the cached one)."""
    for name, v in (("seq", seq), ("global batch", global_batch), ("max gpus", max_gpus), ("max pp", max_pp),
                    ("max cp", max_cp), ("max ep", max_ep), ("max v", max_v)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(name, v, "a positive integer")
    bud = as_budget(budget, reserve)
    counts = [n for n in (2 ** i for i in range(max_gpus.bit_length())) if n <= max_gpus]
    kinds: dict = {}

    def est(kind: tuple) -> Estimate | None:
        """The estimate of a kind of layout (tp > 1, sharding, recompute, accumulate, one
        data-parallel rank, pp, micro-batches, cp: 1, 2 or "c", ep, dp where it is a number
        (FSDP with dp = ep) else "d", virtual stages); None where the model refuses it (the stages do not divide
        its layers; its attention does not run as a ring)."""
        if kind not in kinds:       # one data-parallel rank: no DDP buckets, nothing sharded
            tp, sharding, recompute, accumulate, one_rank, pp, m, cp, ep, dp, v = kind
            data = {} if one_rank else {"dp": dp, **dict(SHARDINGS)[sharding]}
            par = {**data, **({"tp": "t", "sp": True} if tp else {}),
                   **({"pp": pp, "microbatches": m} if pp > 1 else {}),
                   **({"schedule": "interleaved", "virtual_stages": v} if v > 1 else {}),
                   **({"cp": cp} if cp != 1 else {}), **({"ep": ep} if ep > 1 else {})} or {"dp": 1}
            try:
                kinds[kind] = derive(graph, Policy(precision, optimizer, device, recompute=recompute,
                                                   accumulate=accumulate, parallel=_spec(par)))
            except ConfigError:
                if pp == 1 and cp == 1:
                    raise
                kinds[kind] = None
        return kinds[kind]

    whole: dict = {}

    def floor(dp, tp, pp, sharding) -> int:
        """A lower bound of the most loaded rank's states (:func:`_states_floor`), from one
        rank's whole states (the plain layout's, derived first anyway)."""
        if not whole and STATES:
            ev = est((False, "ddp", "none", 1, True, 1, 1, 1, 1, "d", 1)).at(b=2, s=seq)
            whole.update({c: ev.bytes.get(c, 0) for c in STATES})
        return _states_floor(whole, dp, tp * pp, sharding)

    contexts = [x for x in counts if x == 1 or (x <= max_cp and seq % (2 * x) == 0)]
    experts = _experts(graph)
    out = []
    for gpus in counts:
        for cp in (x for x in contexts if gpus % x == 0):
            for pp in (x for x in counts if x <= max_pp and (gpus // cp) % x == 0):
                for tp in (x for x in TENSOR if (gpus // (pp * cp)) % x == 0):
                    dp = gpus // (tp * pp * cp)
                    if global_batch % dp:
                        continue
                    alone = tp == pp == cp == 1         # what expert parallelism is modelled beside
                    for ep in (x for x in counts if x == 1 or (alone and x <= max_ep and experts % x == 0
                                                                and dp % x == 0)):
                        for sharding, fields in SHARDINGS:
                            if ((dp == 1 and fields) or (pp > 1 and sharding not in _PIPELINE_SHARDINGS)
                                    or (ep > 1 and sharding not in _EXPERT_SHARDINGS)):
                                continue    # sharding one rank; ZeRO 2-3 beside a pipeline; ZeRO beside ep
                            if floor(dp, tp, pp, sharding) // (ep if sharding == "ddp" else 1) > bud.usable:
                                continue            # the states alone do not fit: nothing derived
                            for recompute in RECOMPUTE:
                                for v in (x for x in counts if x == 1 or (pp > 1 and x <= max_v)):
                                    layout = _largest_batch(est, bud, seq, global_batch, gpus, dp, tp, pp, cp,
                                                            sharding, recompute, ep, v)
                                    if layout is not None:
                                        out.append(layout)
    return sorted(out, key=lambda x: (x.gpus, x.peak))


def _experts(graph) -> int:
    """The experts expert parallelism can split (a mixture of experts with grouped_mm's
    experts: :mod:`symmem.passes.expert`), else 0."""
    from .models.mixtral import EXPERTS_OUT
    from .symbols import E
    bound = graph.bindings.get(E)
    return int(bound) if bound is not None and any(n.name == EXPERTS_OUT for n in graph.nodes()) else 0


def _spec(fields: dict) -> str:
    return ",".join(f"{k}={1 if v is True else v}" for k, v in fields.items())


def _states_floor(whole: dict, dp: int, n: int, sharding: str) -> int:
    """At most what the most loaded rank keeps of the states (:data:`STATES`) when the model is
    split over ``n = tp * pp`` ranks and ``dp`` ranks share its data under ``sharding``, from
    one rank's ``whole`` states: every tensor is split or repeated over the ``n`` ranks (the
    most loaded holds at least their average, 1/n), and ZeRO or FSDP divides a sharded part at
    most by ``dp`` (its padding only adds). ZeRO-1 shards the master copy and the optimizer's
    states, ZeRO-2 the gradients too, ZeRO-3 and FSDP everything; DDP's buckets add more."""
    p, g = whole.get("params", 0), whole.get("grads", 0)
    rest = whole.get("master", 0) + whole.get("optimizer", 0)
    shard = {"zero-1": rest, "zero-2": g + rest, "zero-3": p + g + rest, "fsdp-full": p + g + rest}.get(
        sharding, 0) if dp > 1 else 0
    return (p + g + rest - shard + shard // dp) // n


def _largest_batch(est, bud, seq, global_batch, gpus, dp, tp, pp, cp, sharding, recompute, ep=1,
                   v=1) -> Layout | None:
    """The largest micro-batch dividing ``global_batch / dp`` that fits (None if none does)."""
    per_rank = global_batch // dp
    no_accumulation = sharding in ("zero-2", "zero-3", "fsdp-full")
    for b in sorted((x for x in range(1, per_rank + 1) if per_rank % x == 0), reverse=True):
        k = per_rank // b
        if (k > 1 and no_accumulation) or k < pp or (v > 1 and k % pp):
            continue
        ring = cp if cp <= 2 else "c"         # c >= 4 from one derivation; c = 2 on its own
        whole = ep > 1 and ep == dp and sharding == "fsdp-full"    # each rank its experts whole: its own
        ranks = dp if whole else "d"
        if pp > 1:      # k micro-batches through the pipeline; pp + 1 (interleaved: 2 pp) stands for more
            m = min(k, 2 * pp) if v > 1 else min(k, pp + 1)
            kind = (tp > 1, sharding, recompute, 1, dp == 1, pp, m, ring, ep, ranks, v)
        else:
            kind = (tp > 1, sharding, recompute, 1 if k == 1 else 2, dp == 1, 1, 1, ring, ep, ranks, 1)
        e = est(kind)
        if e is None:
            return None
        values = {"b": b, "s": seq, **({"d": dp} if dp > 1 and not whole else {}), **({"t": tp} if tp > 1 else {}),
                  **({"c": cp} if ring == "c" else {})}
        try:
            ev = e.at(**values)
        except ConfigError:             # t does not divide the heads, s past the model's limit
            return None
        if ev.peak <= bud.usable:
            name = "none" if dp == 1 else sharding
            return Layout(gpus, dp, tp, tp > 1, name, recompute, b, k, ev.peak, bud.usable, dict(ev.bytes), pp=pp,
                          cp=cp, ep=ep, v=v)
        if sum(ev.bytes.get(c, 0) for c in STATES) > bud.usable:
            return None         # the states alone do not fit: no batch does (nor b = 1's own derivation)
    return None


def table(layouts: list[Layout]) -> str:
    """The layouts as the command line prints them (a ``v`` (interleaved chunks), ``cp`` or
    ``ep`` column where one has it above 1)."""
    chunks, ring, experts = (any(getattr(x, k) > 1 for x in layouts) for k in ("v", "cp", "ep"))
    head = (f"{'gpus':>5} {'dp':>4} {'tp':>3} {'pp':>3}" + (f" {'v':>2}" if chunks else "")
            + (f" {'cp':>3}" if ring else "")
            + (f" {'ep':>3}" if experts else "")
            + f"  {'sharding':<10} {'recompute':<10} {'b':>4} {'k':>4}  {'peak':>11}  {'headroom':>11}")
    rows = [head]
    for x in layouts:
        rows.append(f"{x.gpus:>5} {x.dp:>4} {x.tp:>3} {x.pp:>3}" + (f" {x.v:>2}" if chunks else "")
                    + (f" {x.cp:>3}" if ring else "")
                    + (f" {x.ep:>3}" if experts else "")
                    + f"  {x.sharding:<10} {x.recompute:<10} {x.micro_batch:>4} {x.accumulate:>4}"
                    f"  {format_bytes(x.peak):>11}  {format_bytes(x.headroom):>11}")
    return "\n".join(rows)
