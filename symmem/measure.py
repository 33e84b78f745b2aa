"""Measure what PyTorch really holds: the ground truth the symbolic formulas are checked against.

Three measurements, all counting tensor *storages* (the allocations), never tensors,
so views, tied weights and in-place results are counted once:

* :func:`param_bytes` -- bytes of a module's parameters.
* :func:`saved_bytes` -- bytes autograd keeps for backward after a forward pass
  ("activations"), seen through :func:`torch.autograd.graph.saved_tensors_hooks`.
* :func:`training_step` -- live bytes after every operator of one training iteration
  (forward, backward, optimizer step), seen through a ``TorchDispatchMode``.

Limits, common to all three:

* Bytes are ``UntypedStorage.nbytes()``: the CUDA caching allocator's rounding (to
  512-byte blocks and larger segments), fragmentation, cuBLAS/cuDNN workspaces and the
  CUDA context are not modelled. On CUDA, :func:`training_step` also reports
  ``torch.cuda.max_memory_allocated()`` beside the exact storage count.
* Only dense (strided) tensors with a real storage are counted; sparse, nested and
  meta tensors are ignored.
* Memory an operator allocates and frees *inside* its kernel (scratch space) is invisible:
  it is neither an input nor an output of any dispatched operator.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

try:
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_leaves
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("symmem.measure needs PyTorch: pip install 'symmem[torch]'") from exc

__all__ = [
    "SavedEntry",
    "SavedReport",
    "Sample",
    "StepReport",
    "param_bytes",
    "saved_bytes",
    "training_step",
    "schedule_step",
    "plain_step",
    "PassReport",
    "inference_pass",
    "generation",
]

_PHASES = ("forward", "backward", "optimizer")


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a dense tensor, or None for tensors without a countable one."""
    if t.layout is not torch.strided or t.is_meta:
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return None
    return st if st.nbytes() > 0 else None


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``, or for a traceable wrapper subclass (a ``DTensor``, which has no storage of its
    own) the plain tensors it wraps (a ``DTensor``'s local shard), recursively."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()  # may name non-tensors too (a DTensor's device_mesh)
    inner = [getattr(t, name) for name in names]
    return [leaf for x in inner if isinstance(x, torch.Tensor) for leaf in _inner_tensors(x)]


def _key(st: torch.UntypedStorage) -> tuple[int, int]:
    return st.data_ptr(), st.nbytes()


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside a nest of tuples, lists and dicts (a ``ModelOutput`` is a dict)."""
    if isinstance(obj, torch.nn.Module):
        return [t for p in (*obj.parameters(), *obj.buffers()) for t in _inner_tensors(p)]
    if isinstance(obj, torch.Tensor):
        return _inner_tensors(obj)
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        return [t for item in obj for t in _tensors(item)]
    return []


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters, each storage once (a tied weight counts once)."""
    storages = {}
    for p in module.parameters():
        st = _storage(p)
        if st is not None:
            storages[_key(st)] = st.nbytes()
    return sum(storages.values())


# --------------------------------------------------------------------------- saved tensors


@dataclass(frozen=True)
class SavedEntry:
    """One tensor autograd saved for backward (metadata only, no reference to it).

    ``counted`` is True for the entry that brought its storage into ``SavedReport.total``;
    False for a later view of an already counted storage and for excluded storages.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    storage_nbytes: int
    storage_key: tuple[int, int]
    device: str
    counted: bool


@dataclass(frozen=True)
class SavedReport:
    """Bytes autograd holds for backward: ``total`` over distinct, non-excluded storages."""

    total: int
    entries: tuple[SavedEntry, ...]

    def by_dtype(self) -> dict[str, int]:
        """Counted bytes per dtype string (a storage is attributed to its first entry)."""
        out: dict[str, int] = defaultdict(int)
        for e in self.entries:
            if e.counted:
                out[e.dtype] += e.storage_nbytes
        return dict(out)


def _entry(t: torch.Tensor, st: torch.UntypedStorage) -> SavedEntry:
    dtype = str(t.dtype).removeprefix("torch.")
    return SavedEntry(tuple(t.shape), dtype, t.nbytes, st.nbytes(), _key(st), str(t.device), False)


def _sequence_mark() -> int:
    """Sequence number of a fresh autograd node: every node created later gets a larger one."""
    with torch.enable_grad():
        node = torch.empty(0, requires_grad=True).view(0).grad_fn
    return -1 if node is None else node._sequence_nr()  # None: no graph (inference mode)


def _unhooked_saved(roots: list[torch.Tensor], since: int) -> list[torch.Tensor]:
    """Tensors saved *without* hooks by graph nodes reachable from ``roots``, newer than ``since``.

    Reads ``SavedTensor.data`` of the raw saved slots, never unpacks: an unpack hook may
    have side effects (a checkpoint's recomputes its region).
    """
    found: list[torch.Tensor] = []
    names: dict[type, list[str]] = {}
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen or node._sequence_nr() <= since:
            continue
        seen.add(id(node))
        if type(node) not in names:
            names[type(node)] = [n for n in dir(node) if n.startswith("_raw_saved_")]
        for name in names[type(node)]:
            try:
                raw = getattr(node, name)
                slots = raw if isinstance(raw, (list, tuple)) else [raw]
                for slot in slots:
                    data = getattr(slot, "data", None)
                    if isinstance(data, torch.Tensor) and slot.unpack_hook is None:
                        found.append(data)
            except RuntimeError:  # already freed by a backward pass
                continue
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return found


def saved_bytes(fn: Callable[[], Any], *, exclude: Any = None) -> SavedReport:
    """Run ``fn()`` (a forward pass) and count the bytes autograd saved for backward.

    Every tensor autograd packs is recorded by a ``saved_tensors_hooks`` pack hook that
    returns the tensor detached (the same storage; see ``pack``), so autograd keeps
    and frees exactly what it would without the hook. Each
    distinct storage counts once with its full ``nbytes()`` (a view shares its base's
    storage), keyed by ``(data_ptr, nbytes)``.

    ``exclude``: an ``nn.Module`` (its parameters and buffers) or tensors whose storages
    are not counted, typically the weights, which exist whether or not they are saved.

    Python scalars (``x * 0.125``) are saved by autograd as 0-dim "wrapped number"
    tensors (float64 for a float) *without* going through the hooks; they are found by
    walking the autograd graph from ``fn``'s output (nodes created during ``fn`` only) and
    counted too. They live in host memory even for CUDA inputs; see ``SavedEntry.device``.
    Saved-tensor hooks installed inside ``fn`` take precedence over this one: what they
    pack is not seen. That is right for non-reentrant ``torch.utils.checkpoint`` (it
    keeps its inputs, seen here, and recomputes the rest) but would miss, e.g., tensors
    an offloading hook moves to the host.

    The output of ``fn`` is held until counting is done, then released (with the graph it
    owns); the report keeps metadata only. Storages that were saved but freed before
    ``fn`` returned (e.g. the graph of a discarded branch) are not counted.
    """
    records: list[tuple[SavedEntry, StorageWeakRef]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        if st is not None:
            records.append((_entry(t, st), StorageWeakRef(st)))
        # Same storage and version counter; autograd re-attaches grad_fn when unpacking.
        # Returning ``t`` itself would make a saved output own its own grad_fn: a cycle
        # the garbage collector cannot break, so the graph would outlive the output.
        return t.detach()

    since = _sequence_mark()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = fn()
    saved = [entry for entry, ref in records if not ref.expired()]
    keys = {e.storage_key for e in saved}
    for t in _unhooked_saved(_tensors(output), since):  # wrapped numbers bypass the hooks
        st = _storage(t)
        if st is not None and _key(st) not in keys:
            saved.append(_entry(t, st))
            keys.add(_key(st))
    del output

    excluded = {_key(st) for t in _tensors(exclude) if (st := _storage(t)) is not None}
    counted: set[tuple[int, int]] = set()
    entries = []
    for entry in saved:
        if entry.storage_key not in counted and entry.storage_key not in excluded:
            counted.add(entry.storage_key)
            entry = replace(entry, counted=True)
        entries.append(entry)
    return SavedReport(sum(e.storage_nbytes for e in entries if e.counted), tuple(entries))


# --------------------------------------------------------------------------- training step


class Sample(NamedTuple):
    """Live bytes right after ``op`` ran (or at a phase boundary, ``op`` = "<start>"/"<end>"),
    in micro-batch ``micro`` (1 without gradient accumulation; the optimizer step's is 0)."""

    phase: str
    op: str
    live_bytes: int
    micro: int = 1


@dataclass(frozen=True)
class StepReport:
    """Live storage bytes over one training iteration (the last of ``training_step``'s)."""

    peak: int
    peak_phase: str
    peak_op: str
    timeline: tuple[Sample, ...]
    at_start: int
    phase_peaks: dict[str, int]
    cuda_max_allocated: int | None = None
    peak_micro: int = 1


class _LiveTracker(TorchDispatchMode):
    """Registers every storage an operator reads or writes; samples live bytes after each op.

    A storage is held through a ``StorageWeakRef`` only, so the tracker never extends a
    lifetime; a storage resized by ``UntypedStorage.resize_`` (no operator) is followed through
    a patch of that method while the tracker is active; it counts while not ``expired()``. Live entries are kept in a dict with a
    running total, and expired ones are dropped at each sample. Entries are keyed by the
    storage object (``_cdata``), not its ``data_ptr``, which moves when ``resize_`` grows it.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.lock = threading.Lock()  # CUDA backward runs on the engine's device thread
        self.phase = "setup"
        self.micro = 1
        self.live = 0
        self.samples: list[Sample] = []
        self._entries: dict[int, tuple[StorageWeakRef, int]] = {}

    def register(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st is None or st.device != self.device:
            return
        key, nbytes = st._cdata, st.nbytes()
        old = self._entries.get(key)
        if old is not None:
            if not old[0].expired():
                if old[1] != nbytes:  # resized in place
                    self.live += nbytes - old[1]
                    self._entries[key] = (old[0], nbytes)
                return
            self.live -= old[1]  # freed; a new storage now has its address
        self._entries[key] = (StorageWeakRef(st), nbytes)
        self.live += nbytes

    def resized(self, st: torch.UntypedStorage) -> None:
        """``UntypedStorage.resize_`` bypasses the dispatcher (FSDP2 frees and re-allocates its
        unsharded parameters so: ``storage.resize_(0)``, ``storage.resize_(n)``); the tracker
        patches it while active and counts the new size here."""
        key, nbytes = st._cdata, st.nbytes()
        old = self._entries.get(key)
        if old is not None and not old[0].expired():
            self.live += nbytes - old[1]
            self._entries[key] = (old[0], nbytes)
        elif nbytes > 0 and st.device == self.device:
            if old is not None:
                self.live -= old[1]
            self._entries[key] = (StorageWeakRef(st), nbytes)
            self.live += nbytes

    def __enter__(self):
        tracker = self
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = original(storage, size)
            with tracker.lock:
                tracker.resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def sample(self, op: str) -> None:
        dead = [key for key, (ref, _) in self._entries.items() if ref.expired()]
        for key in dead:
            self.live -= self._entries.pop(key)[1]
        self.samples.append(Sample(self.phase, op, self.live, self.micro))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        with self.lock:
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor):
                    for inner in _inner_tensors(t):
                        self.register(inner)
            self.sample(str(func))
        return out


class _WrappedScalars(TorchFunctionMode):
    """Shows the tracker the Python numbers autograd saves as 0-dim tensors (``x * 0.125``
    saves a float64 ``0.125``). They never pass the dispatcher (a dispatch mode is handed
    the number), so after each function call the new autograd node's unhooked saved slots
    are read (never unpacked) and registered. They are host memory under CUDA (another
    device: not counted there), real CPU storages on the CPU."""

    def __init__(self, tracker: "_LiveTracker") -> None:
        super().__init__()
        self.tracker = tracker
        self.names: dict[type, list[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            if node is None:
                continue
            if type(node) not in self.names:
                self.names[type(node)] = [n for n in dir(node) if n.startswith("_raw_saved_")]
            for name in self.names[type(node)]:
                try:
                    raw = getattr(node, name)
                except RuntimeError:
                    continue
                for slot in raw if isinstance(raw, (list, tuple)) else [raw]:
                    data = getattr(slot, "data", None)
                    if isinstance(data, torch.Tensor) and data.dim() == 0 and slot.unpack_hook is None:
                        with self.tracker.lock:
                            self.tracker.register(data)
        return out


def _module_device(module: torch.nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _existing(module: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any) -> list[torch.Tensor]:
    """The tensors that exist when a tracked step starts: the module's parameters and buffers,
    their gradients, the optimizer's state and ``extra``."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return _tensors([module, grads, list(optimizer.state.values()), extra])


def training_step(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 2,
    extra: Any = (),
    accumulate: int = 1,
    scaler: Any = None,
) -> StepReport:
    """Run ``steps`` training iterations and track live memory over the last one.

    Each iteration is ``optimizer.zero_grad(set_to_none=True)``; ``loss = loss_fn(module)``
    (phase "forward"); ``loss.backward()`` ("backward"); ``optimizer.step()``
    ("optimizer"). With ``accumulate = K > 1`` forward and backward run K times (micro-batches
    1 to K, each ``loss = loss_fn(module) / K; loss.backward()``) before the step. Earlier iterations are warm-up (the optimizer creates its state in the
    first one); the last is tracked: after its ``zero_grad`` every tensor that already
    exists is registered -- parameters, buffers, gradients, optimizer state and ``extra``
    (tensors, or nests of them, e.g. the input batch) -- then every storage an operator
    reads or writes while the tracker is active. Live bytes are sampled after each
    operator and at phase boundaries; ``at_start`` is the sample before the forward.
    With a ``scaler`` (``torch.amp.GradScaler``) backward is ``scaler.scale(loss).backward()``
    and the step ``scaler.step(optimizer); scaler.update()``, as its documentation runs them;
    its scale and growth tracker count from the start.

    Only storages on the module's device count (on CUDA, Adam's ``step`` counters live on
    the host and are left out). Storages created outside the dispatcher before the step
    (e.g. by a DataLoader or ``torch.from_numpy``) count only once an operator touches them
    unless passed in ``extra``. The 0-dim tensors autograd wraps Python numbers in (see
    :func:`saved_bytes`) never pass the dispatcher: a function mode registers them when the
    node that saves them is made, so they count from the op that made them (they are
    registered just after the op's own sample). The autograd engine runs backward with the
    modes active, so backward operators appear in the timeline.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")

    def micro_batch_loss():
        return loss_fn(module) if accumulate == 1 else loss_fn(module) / accumulate

    def backward(loss):
        (loss if scaler is None else scaler.scale(loss)).backward()

    def step():
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    for _ in range(steps - 1):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            backward(micro_batch_loss())
        step()

    device = _module_device(module)
    tracker = _LiveTracker(device)
    optimizer.zero_grad(set_to_none=True)
    scaler_state = [] if scaler is None else [scaler._scale, scaler._growth_tracker]
    for t in _existing(module, optimizer, [extra, scaler_state]):
        tracker.register(t)
    del scaler_state
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    with _WrappedScalars(tracker), tracker:
        for k in range(1, accumulate + 1):
            tracker.micro = k
            tracker.phase = "forward"
            tracker.sample("<start>")
            if k == 1:
                at_start = tracker.live
            loss = micro_batch_loss()
            tracker.sample("<end>")
            tracker.phase = "backward"
            tracker.sample("<start>")
            backward(loss)
            tracker.sample("<end>")
        tracker.phase, tracker.micro = "optimizer", 0
        tracker.sample("<start>")
        step()
        tracker.sample("<end>")
    del loss
    cuda_max = None
    if cuda:
        torch.cuda.synchronize(device)
        cuda_max = torch.cuda.max_memory_allocated(device)

    return _step_report(tracker, at_start, cuda_max)


def _step_report(tracker: "_LiveTracker", at_start: int, cuda_max: int | None) -> StepReport:
    """The tracked step: its peak (the first sample at it) and each phase's maximum."""
    timeline = tuple(tracker.samples)
    top = max(timeline, key=lambda s: s.live_bytes)
    phase_peaks = {ph: max(s.live_bytes for s in timeline if s.phase == ph) for ph in _PHASES
                   if any(s.phase == ph for s in timeline)}
    return StepReport(top.live_bytes, top.phase, top.op, timeline, at_start, phase_peaks,
                      cuda_max, top.micro)


def schedule_step(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    actions: Iterable[tuple[str, int]],
    forward: Callable[[int], Any],
    backward: Callable[[int], Any],
    *,
    steps: int = 2,
    extra: Any = (),
) -> StepReport:
    """:func:`training_step` for one rank of a pipeline: each iteration is
    ``optimizer.zero_grad(set_to_none=True)``, then ``actions`` in order (``("F", i)`` calls
    ``forward(i)``, phase "forward" of micro-batch ``i + 1``; ``("B", i)`` calls
    ``backward(i)``, phase "backward"), then ``optimizer.step()``. ``forward`` and
    ``backward`` keep what the schedule holds between them (the outputs of the micro-batches
    in flight); the last iteration is tracked as :func:`training_step` tracks it."""
    actions = list(actions)
    for _ in range(steps - 1):
        optimizer.zero_grad(set_to_none=True)
        for kind, i in actions:
            (forward if kind == "F" else backward)(i)
        optimizer.step()
    device = _module_device(module)
    tracker = _LiveTracker(device)
    optimizer.zero_grad(set_to_none=True)
    for t in _existing(module, optimizer, extra):
        tracker.register(t)
    with _WrappedScalars(tracker), tracker:
        at_start = tracker.live
        for kind, i in actions:
            tracker.micro, tracker.phase = i + 1, "forward" if kind == "F" else "backward"
            tracker.sample("<start>")
            (forward if kind == "F" else backward)(i)
            tracker.sample("<end>")
        tracker.phase, tracker.micro = "optimizer", 0
        tracker.sample("<start>")
        optimizer.step()
        tracker.sample("<end>")
    return _step_report(tracker, at_start, None)


def plain_step(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int = 2,
    extra: Any = (),
) -> StepReport:
    """The live bytes of :func:`training_step`, from a run with **no** dispatch mode (CPU only).

    A dispatch mode changes what autograd does: while one is active
    ``at::areAnyTensorSubclassLike`` is true, so autograd's ``InputBuffer::accumulate`` sums
    two gradients of one tensor out of place (``old + new``) where a plain run adds in place
    (``old.add_(new)``, when it holds the last reference: torch/csrc/autograd/input_buffer.cpp).
    This function runs the step plainly under ``torch.profiler`` with ``profile_memory`` and
    replays the CPU allocator's allocation events: a storage allocated and freed inside one
    operator that a dispatch mode would see (a kernel's scratch; composite operators such as
    ``linear`` or autocast's wrappers decompose into the operators it sees) is left out, as the
    tracker cannot see it, and so is a Python number the argument parser wraps in a
    0-dim tensor for one call (allocated outside any operator, freed before the operator after
    the next one starts: Adam's ``exp_avg_sq.sqrt() / bias_correction2_sqrt``; host memory on CUDA);
    everything else counts from its allocation to its free.
    ``at_start`` and the samples are offset by the bytes of the storages that exist when the
    step starts (parameters, buffers, gradients, optimizer states, ``extra``), as the tracker
    registers them. A sample is taken at each phase's start and end and after every allocation
    and free (``op`` is the operator that made it), so ``peak`` may fall inside an operator,
    between its output's allocation and the free of a temporary input, where the tracker
    samples only after it.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    device = _module_device(module)
    if device.type != "cpu":
        raise ValueError(f"plain_step replays the CPU allocator's events; the module is on {device}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    for _ in range(steps - 1):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(module).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seen: dict[tuple[int, int], int] = {}
    for t in _existing(module, optimizer, extra):
        st = _storage(t)
        if st is not None and st.device == device:
            seen[_key(st)] = st.nbytes()
    at_start = sum(seen.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("symmem::forward"):
            loss = loss_fn(module)
        with record_function("symmem::backward"):
            loss.backward()
        with record_function("symmem::optimizer"):
            optimizer.step()
    del loss

    allocs: list[tuple[int, int, int, str]] = []        # (time, bytes, address, operator)
    ops: list[tuple[int, int]] = []                     # operators a dispatch mode sees: (start, end)
    phases: list[tuple[int, int, str]] = []

    def walk(event, op):
        if event.tag == _EventType.Allocation:
            f = event.extra_fields
            allocs.append((event.start_time_ns, f.alloc_size, f.ptr, op or "<none>"))
            return
        if event.name.startswith("symmem::"):
            phases.append((event.start_time_ns, event.end_time_ns, event.name[len("symmem::"):]))
        seen = op is None and event.name.startswith("aten::") and not _decomposes(event.name)
        if seen:
            ops.append((event.start_time_ns, event.end_time_ns))
        for child in event.children:
            walk(child, event.name if seen else op)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    allocs += [(time, 0, -1, mark) for lo, hi, _ in phases for time, mark in ((lo, "<start>"), (hi, "<end>"))]
    allocs.sort()
    ops.sort()

    def op_index(time):
        i = bisect.bisect_right(ops, (time, float("inf"))) - 1
        return i if i >= 0 and ops[i][0] <= time <= ops[i][1] else None

    def one_call_later(time):
        """The start of the second operator after ``time``."""
        i = bisect.bisect_right(ops, (time, float("inf"))) + 1
        return ops[i][0] if i < len(ops) else float("inf")

    opened: dict[int, int] = {}
    scratch: set[int] = set()
    for i, (time, size, ptr, _) in enumerate(allocs):
        if size > 0:
            opened[ptr] = i
        elif size < 0 and ptr in opened:
            j = opened.pop(ptr)
            made = allocs[j][0]
            inside = op_index(made)
            if inside is not None and inside == op_index(time):
                scratch.update((i, j))          # a kernel's scratch
            elif inside is None and time < one_call_later(made):
                scratch.update((i, j))          # a number wrapped for one call
    live, samples = at_start, []
    for i, (time, size, _, op) in enumerate(allocs):
        if i in scratch:
            continue
        phase = next((name for lo, hi, name in phases if lo <= time <= hi), None)
        live += size
        if phase is not None:
            samples.append(Sample(phase, op, live))
    timeline = tuple(samples)
    top = max(timeline, key=lambda s: s.live_bytes)
    phase_peaks = {ph: max(s.live_bytes for s in timeline if s.phase == ph) for ph in _PHASES}
    return StepReport(top.live_bytes, top.phase, top.op, timeline, at_start, phase_peaks)


def _decomposes(name: str) -> bool:
    """Whether the profiler's ``aten::name`` is a CompositeImplicitAutograd operator in every
    overload but its ``out`` ones: it decomposes above the dispatch modes' key, so a mode sees
    the operators it calls, not it."""
    if name not in _DECOMPOSES:
        packet = getattr(torch.ops.aten, name[len("aten::"):], None)
        found = []
        for overload in packet.overloads() if packet is not None else ():
            if "out" in overload:
                continue
            try:
                found.append(torch._C._dispatch_has_kernel_for_dispatch_key(
                    getattr(packet, overload).name(), "CompositeImplicitAutograd"))
            except RuntimeError:      # an overload registered only for TorchScript
                continue
        _DECOMPOSES[name] = bool(found) and all(found)
    return _DECOMPOSES[name]


_DECOMPOSES: dict[str, bool] = {}


# --------------------------------------------------------------------------- inference


@dataclass(frozen=True)
class PassReport:
    """Live storage bytes over one forward run under ``torch.no_grad`` (a prefill or one
    decoding step): ``peak`` and the operator after which it was first reached, ``at_start``
    and ``at_end`` (what is live before ``fn`` runs and once its result is returned)."""

    peak: int
    peak_op: str
    timeline: tuple[Sample, ...]
    at_start: int
    at_end: int
    cuda_max_allocated: int | None = None


def inference_pass(module: torch.nn.Module, fn: Callable[[], Any], *, extra: Any = (),
                   phase: str = "inference") -> tuple[PassReport, Any]:
    """Run ``fn()`` once under ``torch.no_grad()`` and track live memory, as
    :func:`training_step` tracks a training step: the module's parameters and buffers and
    ``extra`` (the batch, a KV cache's tensors) are registered before it runs, then every
    storage an operator reads or writes. ``extra`` may be a function returning them: a list
    made in the call would otherwise be referenced until the call returns, keeping alive
    tensors ``fn`` drops (the KV cache's previous keys and values). Returns the report and ``fn``'s result, which is
    still referenced when ``at_end`` is sampled (the caller decides when it goes)."""
    device = _module_device(module)
    tracker = _LiveTracker(device)
    for t in _tensors([module, extra() if callable(extra) else extra]):
        tracker.register(t)
    extra = t = None      # the loop's last tensor too: a previous cache's values fn drops (bound
    #                       even when there was none to register)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker.phase = phase
    with torch.no_grad(), tracker:
        tracker.sample("<start>")
        at_start = tracker.live
        out = fn()
        tracker.sample("<end>")
    cuda_max = None
    if cuda:
        torch.cuda.synchronize(device)
        cuda_max = torch.cuda.max_memory_allocated(device)
    timeline = tuple(tracker.samples)
    top = max(timeline, key=lambda s: s.live_bytes)
    return PassReport(top.live_bytes, top.op, timeline, at_start, timeline[-1].live_bytes, cuda_max), out


def generation(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, *, cache: str = "dynamic",
               max_cache_len: int | None = None, autocast: torch.dtype | None = None,
               logits: str = "last", residual_length: int = 128,
               q_group_size: int = 64) -> tuple[PassReport, PassReport, int]:
    """Text generation as transformers' ``generate`` runs a causal LM, tracked as symmem's
    inference mode derives it: the prefill of the prompt ``ids`` (b, s), ``new_tokens - 1``
    untracked decoding steps, then the tracked one, after which the cache holds s +
    ``new_tokens`` positions. Returns (prefill report, decoding-step report, the cache's bytes
    after it).

    ``cache``: transformers' ``DynamicCache`` (``"dynamic"``), ``StaticCache`` of
    ``max_cache_len`` positions (``"static"``; its layers' ``cumulative_length`` counters, made
    before the prefill, are part of it), ``QuantizedCache(backend="fp8")`` (``"fp8"``: (fp8
    tensor, float32 scale) pairs) or ``QuantizedCache(backend="quanto")`` (``"quanto-int4"``,
    ``"quanto-int2"``, of ``residual_length`` and ``q_group_size``: each layer's packed codes,
    scales and shifts, and its residual keys and values). ``autocast``: the dtype of
    ``torch.autocast`` over each forward (None: off). ``logits``: ``"last"`` calls the model with ``logits_to_keep=1``, as
    ``generate`` does; ``"all"`` without it. The new tokens are random (the memory does not
    depend on them)."""
    import transformers
    from .policy.inference import QUANTO_BITS
    keep = 1 if logits == "last" else 0
    if cache == "static":
        kv = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    elif cache == "fp8":
        kv = transformers.QuantizedCache(backend="fp8", config=model.config)
    elif cache in QUANTO_BITS:
        kv = transformers.QuantizedCache(backend="quanto", config=model.config, nbits=QUANTO_BITS[cache],
                                         residual_length=residual_length, q_group_size=q_group_size)
    else:
        kv = transformers.DynamicCache(config=model.config)
    device = ids.device

    def counters():
        return [x.cumulative_length for x in kv.layers] if cache == "static" else []

    def tensors():      # what the cache holds
        if cache == "fp8":
            return [t for x in kv.layers for t in (*x._quantized_keys, *x._quantized_values)]
        if cache in QUANTO_BITS:       # a WeightQBitsTensor has no storage: its packed codes, scale, shift
            return [t for x in kv.layers for q in (x._quantized_keys, x._quantized_values)
                    for t in _inner_tensors(q)] + [t for x in kv.layers for t in (x.keys, x.values)]
        return [t for x in kv.layers for t in (x.keys, x.values)] + counters()

    def forward(x):
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return model(x, cache=kv, use_cache=True, logits_to_keep=keep).logits
    vocab = model.config.get_text_config().vocab_size
    prefill, out = inference_pass(model, lambda: forward(ids), extra=lambda: (ids, counters()))
    del out
    b = ids.shape[0]
    for _ in range(new_tokens - 1):
        with torch.no_grad():
            forward(torch.randint(0, vocab, (b, 1), device=device))
    nxt = torch.randint(0, vocab, (b, 1), device=device)
    # the cache's tensors handed over by a function: a list made in the call would keep the
    # previous keys and values alive through it
    decode, out = inference_pass(model, lambda: forward(nxt), extra=lambda: (nxt, tensors()))
    del out
    return prefill, decode, sum(x.untyped_storage().nbytes() for x in tensors())
