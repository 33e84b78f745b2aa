"""Measure a distributed training step per rank: the oracle for data, sharded and tensor parallelism.

:func:`distributed_step` runs one training iteration in ``world_size`` processes on the CPU
(``torch.distributed`` with the gloo backend, ``MASTER_ADDR`` 127.0.0.1 and a free port) and
returns, per rank, what :func:`symmem.measure.training_step` returns for one process -- the
peak, its phase, live bytes after every operator -- and the bytes of the rank's parameters,
gradients, optimizer states and communication buffers. The caller's ``setup(rank, world_size)``
builds and wraps the model (``DistributedDataParallel``, ``fully_shard``,
``parallelize_module``) inside the process group, so any wrapping is measured as it runs.

What the storage tracker (a ``TorchDispatchMode``, thread-local) sees, and what not:

* **Collectives** are dispatcher operators (``c10d.allreduce_``, ``c10d.broadcast_``,
  ``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ``_c10d_functional.all_reduce``):
  their arguments and results are counted like any operator's. What ``ProcessGroupGloo``
  allocates *inside* them is not, being either inside the operator's kernel or on gloo's
  worker thread (the mode is thread-local). Measured with ``torch.profiler``'s memory events
  (``tests/test_dist_measured.py``): ``all_reduce`` and ``broadcast`` run in place (any buffer
  of gloo's algorithm is gloo's own, outside ATen); ``all_gather_into_tensor`` allocates two
  flat output-sized temporaries, one in the operator and one on the worker thread, never seen;
  ``reduce_scatter_tensor`` clones its whole input, all-reduces the clone and copies this
  rank's chunk out on the calling thread -- the tracker meets the clone at that copy and counts
  it from there until it is freed. These are host memory of the CPU backend; the peak
  measured here is that of the tensors the training step holds, not the process's resident
  memory.
* **DDP's gradient buckets** are allocated in C++ by ``Reducer::initialize_buckets``
  (``torch/csrc/distributed/c10d/reducer.cpp``: one flat ``at::empty`` per bucket, the sum of
  its parameters' sizes) when DDP is built, and again, in gradient-ready order, by
  ``Reducer::rebuild_buckets`` in the *second* iteration's forward. The reducer exposes no
  tensor of them to Python, and the tracker would only meet a bucket when the backward first
  writes into it (``mul_out`` of the gradient by ``1/world_size`` into the bucket view). Here
  the tracked iteration is the third (after the rebuild); in the second, a recording dispatch
  mode keeps the tensors handed to ``c10d.allreduce_`` -- the reducer all-reduces each bucket
  as one flat tensor -- and they are registered at the start of the tracked iteration like
  the parameters. The tracked iteration checks that the reducer all-reduces exactly these
  storages again (otherwise :class:`MeasureError`). With ``gradient_as_bucket_view=True``
  the gradients *are* views of the buckets (one storage each bucket); with False they are
  separate tensors copied out of the buckets after the all-reduce.
* **FSDP2** (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a ``DTensor``
  whose local shard is a view of the parameter's own padded shard (dim 0 padded to a multiple
  of the world size; the optimizer's states follow the unpadded local shard). It all-gathers
  each unit into a new ``world_size``-times-larger flat tensor (``all_gather_copy_in``, then
  ``c10d._allgather_base_``) and copies it out (``split_with_sizes_copy``) into unsharded
  parameters that keep the padding, whose storages it frees and re-allocates with
  ``UntypedStorage.resize_(0)`` / ``resize_(n)`` -- no operator; the tracker follows that
  method. In forward the previous unit's all-gather output lives until the next unit's
  copy-out (``comm_ctx.all_gather_state``); in backward the next unit is prefetched and each
  unit's reduce-scatter input (a ``chunk_cat`` of its gradients) lives until the next unit
  reduces (``comm_ctx.reduce_scatter_states``). All of it runs on the calling thread and is
  counted. A ``DTensor`` (or any traceable wrapper
  subclass) has no storage of its own: the tracker counts the storages of its inner tensors.
  Operators a ``DTensor`` runs on its local tensors inside its own dispatch are not seen one
  by one (a mode handles the ``DTensor``-level operator with itself switched off); their
  results are, once wrapped in the output.

What CUDA and NCCL do differently (from PyTorch's and NCCL's documentation and sources):
NCCL reads and writes the tensors it is given (no ATen temporaries like gloo's above) and
keeps its own communication buffers (sized by ``NCCL_BUFFSIZE``, 4 MiB by default, per
channel and peer), allocated by NCCL outside PyTorch's caching allocator: neither this tracker
nor ``torch.cuda.max_memory_allocated`` sees them (``nvidia-smi`` does). ``ProcessGroupNCCL``
keeps a collective's tensors from being reused before the collective ends on its stream
(``recordStream``, or, for synchronous calls and with ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``,
by holding them in the ``Work``), so a freed bucket or all-gather output can stay reserved a
little after its last use. FSDP2 on CUDA all-gathers and reduce-scatters on their own
streams; the deferred frees measured here (the previous unit's all-gather output kept in
``comm_ctx.all_gather_state`` until the next unit's copy-out; the reduce-scatter input kept
in ``comm_ctx.reduce_scatter_states``) exist for exactly that overlap and happen the same
way on the CPU, where the streams are no-ops. DDP on CUDA uses the same reducer and buckets
(one flat tensor per bucket on the device); the gradient's division by the world size is
written into the bucket (``mul_out``) on either device.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

try:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("symmem.measure_dist needs PyTorch: pip install 'symmem[torch]'") from exc

from symmem.errors import SymmemError
from symmem.measure import StepReport, _inner_tensors, _storage, _tensors, training_step

__all__ = [
    "MeasureError",
    "RankSetup",
    "RankReport",
    "free_port",
    "run_ranks",
    "distributed_step",
    "storage_bytes",
    "in_place_reduce_scatter",
    "released_all_gather",
]


class MeasureError(SymmemError):
    """A distributed measurement that could not be made or trusted (a rank failed, timed out,
    or a buffer the measurement relies on changed between iterations)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the OS picks it; it may be taken before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, backend, timeout, queue, args):
    try:
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              start_method: str = "fork", timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes, each inside a process
    group (``init_process_group(backend)`` over TCP on 127.0.0.1), and return the results by
    rank (they travel back pickled). ``start_method`` "fork" (Linux; the processes inherit the
    imported modules and start in a fraction of a second, CPU only) or "spawn" (``fn`` and
    ``args`` must then be importable/picklable; each process imports torch again, seconds).
    A rank that raises or does not answer within ``timeout`` seconds raises
    :class:`MeasureError` with its traceback."""
    if world_size < 1:
        raise MeasureError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(3):  # the free port may be taken between free_port() and the bind
        results, errors = _run_once(fn, world_size, args, backend, start_method, timeout)
        if not any("address already in use" in e.lower() for e in errors):
            break
    if errors:
        raise MeasureError("a rank failed: " + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _run_once(fn, world_size, args, backend, start_method, timeout):
    ctx = multiprocessing.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, timeout, queue, args),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception as exc:  # queue.Empty
                raise MeasureError(f"{world_size - len(results) - len(errors)} of {world_size} "
                                   f"ranks did not answer within {timeout} s") from exc
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the others may wait forever in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return results, errors


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a nest; a ``DTensor`` counts its local
    shard's storage, the padded flat tensor FSDP2 keeps, not the logical size)."""
    seen: dict[int, int] = {}
    for t in _tensors(tensors):
        for inner in _inner_tensors(t):
            st = _storage(inner)
            if st is not None:
                seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _released(tensors: list[torch.Tensor], call: Callable[..., Any], timeout: float = 10.0) -> None:
    """Run the collective ``call(*aliases)`` on aliases of ``tensors`` and wait until gloo's
    worker thread has dropped them. The caller resumes as soon as the work is marked complete;
    the worker releases the work, and with it the tensors, a moment later -- under CPU
    contention, several operators later, which would make a buffer outlive FSDP's last
    reference by a timing-dependent amount.

    A storage's use count counts the tensors (``TensorImpl``) on it, not the references to one
    tensor: gloo's ``Work`` holding FSDP's own tensor adds nothing to it. So the collective is
    given fresh aliases (``view_as``, one ``TensorImpl`` each, the same storage) and the wait
    lasts until the storages' use counts are back to what they were before the aliases."""
    import time
    storages = [t.untyped_storage() for t in tensors]
    before = [torch._C._storage_Use_Count(st._cdata) for st in storages]
    aliases = [t.view_as(t) for t in tensors]
    call(*aliases)
    del aliases
    deadline = time.monotonic() + timeout
    while any(torch._C._storage_Use_Count(st._cdata) > n for st, n in zip(storages, before)):
        if time.monotonic() > deadline:
            raise MeasureError(f"gloo kept a collective's tensors {timeout} s after it finished")
        time.sleep(0.0005)


def in_place_reduce_scatter():
    """An FSDP2 reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that allocates nothing:
    it all-reduces FSDP's flat reduce-scatter input in place (the input is FSDP's own temporary,
    a ``chunk_cat`` of the unsharded gradients, read by nothing afterwards) and copies this
    rank's chunk into the output. Gloo's own ``reduce_scatter_tensor`` clones its whole input
    first (see the module's docstring); NCCL's ``ncclReduceScatter`` reads the input and writes
    the output, no more: with this one installed the tracked bytes are those NCCL would hold.
    It returns once gloo has let go of the input (deterministic lifetimes; see ``_released``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class InPlaceReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            _released([input_tensor], lambda t: dist.all_reduce(t, op=op, group=group))
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            output_tensor.copy_(input_tensor.view(world, -1)[rank].view_as(output_tensor))
            return None

    return InPlaceReduceScatter()


class _Completed:
    """Stands for the work of an asynchronous all-gather that already finished: FSDP2 treats a
    non-None result as asynchronous (no deferred free) and waits only on a real ``Work``."""

    def wait(self) -> bool:
        return True


def released_all_gather():
    """An FSDP2 all-gather (``FSDPModule.set_custom_all_gather``): gloo's ``all_gather_single``
    (FSDP's own call), run synchronously, returning once gloo's worker thread has let go of the
    input and output (see ``_released``), so that FSDP's frees happen when its references go,
    not when the worker is next scheduled. Asynchronous calls get a finished stand-in, so FSDP
    frees the result as it does after an asynchronous all-gather."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class ReleasedAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            _released([output_tensor, input_tensor],
                      lambda out, inp: dist.all_gather_single(out, inp, group=group))
            return _Completed() if async_op else None

    return ReleasedAllGather()


class RankSetup(NamedTuple):
    """What ``setup(rank, world_size)`` returns: the (wrapped) module, ``loss_fn(module)`` for
    one micro-batch, the optimizer over the rank's parameters and ``extra`` tensors counted from
    the start (the rank's batch)."""

    module: torch.nn.Module
    loss_fn: Callable[[torch.nn.Module], torch.Tensor]
    optimizer: torch.optim.Optimizer
    extra: Any = ()


@dataclass(frozen=True)
class RankReport:
    """One rank's tracked iteration: ``step`` (a :class:`~symmem.measure.StepReport`) and, after
    its optimizer step, the bytes of the rank's parameters (local shards for a ``DTensor``),
    gradients, optimizer states, and ``buckets`` (DDP's flat gradient buckets, each storage
    once; the gradients that are views of them are in ``grads`` too) with ``bucket_sizes`` in
    bytes in the reducer's order."""

    rank: int
    world_size: int
    step: StepReport
    params: int
    grads: int
    optimizer_state: int
    buckets: int
    bucket_sizes: tuple[int, ...]


class _AllReduceArgs(TorchDispatchMode):
    """Notes the storages handed to ``c10d.allreduce_`` (under DDP's backward, its buckets):
    with ``keep`` the tensors themselves (found in a warm-up iteration, to be registered in the
    tracked one), else only their storages' keys (a check that must not extend a lifetime)."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.keep = keep
        self.tensors: list[torch.Tensor] = []
        self.keys: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("c10d.allreduce_"):
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None:
                    self.keys.add(st._cdata)
                    if self.keep:
                        self.tensors.append(t)
        return func(*args, **(kwargs or {}))


def _one_step(case: RankSetup) -> None:
    case.optimizer.zero_grad(set_to_none=True)
    case.loss_fn(case.module).backward()
    case.optimizer.step()


def _rank_step(rank: int, world_size: int, setup: Callable[[int, int], RankSetup],
               steps: int, keep_timeline: bool) -> RankReport:
    from torch.nn.parallel import DistributedDataParallel

    case = setup(rank, world_size)
    ddp = isinstance(case.module, DistributedDataParallel)
    for _ in range(steps - 2):
        _one_step(case)
    buckets: list[torch.Tensor] = []
    if steps > 1:
        if ddp:
            recorder = _AllReduceArgs(keep=True)
            with recorder:
                _one_step(case)
            buckets = recorder.tensors
        else:
            _one_step(case)
    bucket_keys = {_storage(t)._cdata for t in buckets}
    check = _AllReduceArgs(keep=False)
    # Lifetimes by reference counts alone: the cyclic collector, whose runs depend on what
    # the process allocated before (a forked rank inherits its parent's counts), is run
    # before the tracked iteration and kept off during it.
    gc.collect()
    gc.disable()
    try:
        with check if ddp else contextlib.nullcontext():  # beneath the tracker: sees its operators
            report = training_step(case.module, case.loss_fn, case.optimizer, steps=1,
                                   extra=[case.extra, buckets])
    finally:
        gc.enable()
    if ddp:
        if steps < 3 or check.keys != bucket_keys:
            raise MeasureError(
                f"DDP's buckets are found in the iteration before the tracked one and must not "
                f"change: got steps={steps} (need >= 3: the reducer rebuilds its buckets in the "
                f"second iteration), {len(check.keys)} storages all-reduced in the tracked "
                f"iteration, {len(check.keys & bucket_keys)} of them among the "
                f"{len(bucket_keys)} buckets found")
        sizes = tuple(_storage(t).nbytes() for t in buckets)
    else:
        sizes = ()
    params = list(case.module.parameters())
    out = RankReport(
        rank, world_size,
        report if keep_timeline else _drop_timeline(report),
        storage_bytes(params),
        storage_bytes([p.grad for p in params if p.grad is not None]),
        storage_bytes(list(case.optimizer.state.values())),
        storage_bytes(buckets), sizes)
    del buckets
    return out


def _drop_timeline(report: StepReport) -> StepReport:
    from dataclasses import replace
    return replace(report, timeline=())


def distributed_step(setup: Callable[[int, int], RankSetup], world_size: int, *, steps: int = 3,
                     keep_timeline: bool = True, backend: str = "gloo", start_method: str = "fork",
                     timeout: float = 120.0) -> list[RankReport]:
    """Train ``steps`` iterations in each of ``world_size`` processes and track the last, per
    rank (see :func:`run_ranks` for the processes). Each rank calls ``setup(rank, world_size)``
    (with ``torch.set_num_threads(1)`` and the process group initialised) and trains the
    :class:`RankSetup` it returns: ``zero_grad(set_to_none=True)``, ``loss_fn(module)
    .backward()``, ``optimizer.step()``. The default of 3 iterations is what DDP needs (its
    buckets are rebuilt in the second); the optimizer's states exist from the first.
    The cyclic garbage collector is run before the tracked iteration and disabled during it,
    so storages live as long as their reference counts say, whatever the process did before.
    For FSDP2, install :func:`released_all_gather` and :func:`in_place_reduce_scatter` in
    ``setup`` on each module (``set_custom_all_gather``, ``set_custom_reduce_scatter``): gloo's
    worker thread otherwise drops a finished collective's tensors when it is next scheduled
    (under CPU contention, operators later), and its reduce-scatter clones its input; with
    them the bytes are reproducible and those NCCL would hold.
    Returns a :class:`RankReport` per rank, ``keep_timeline=False``
    leaving the per-operator timeline out (it is pickled back to the parent)."""
    if steps < 1:
        raise MeasureError(f"steps must be >= 1, got {steps}")
    return run_ranks(_rank_step, world_size, setup, steps, keep_timeline, backend=backend,
                     start_method=start_method, timeout=timeout)
