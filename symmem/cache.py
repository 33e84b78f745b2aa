"""A cache of derived estimates on disk, so that a second ``symmem estimate`` of the same model
and policy skips the derivation.

An entry is the pickled :class:`~symmem.engine.Estimate`, in one file named by its key: the
SHA-256 of the model's structure (every node, parameter, shape and binding of the graph, in
order, parameters numbered by identity so that tying counts), the policy, and symmem itself
(its version and the bytes of its source files, so that an edited rule never reads an entry
derived by the old one). The file starts with the SHA-256 of the rest and the key again; an
entry whose checksum, key or unpickling fails is treated as absent, derived afresh and written
again, never trusted. Entries are written to a temporary file and renamed into place, so that
two processes never read half an entry.

Where: ``$SYMMEM_CACHE_DIR``, else the user's cache directory (``$XDG_CACHE_HOME/symmem``,
``~/.cache/symmem``; ``%LOCALAPPDATA%\\symmem`` on Windows). ``SYMMEM_NO_CACHE=1`` turns it
off (the derivation benchmarks and the test suite run with it). A directory that cannot be
written leaves the cache off for that run, silently: caching is an optimisation only.

Like every pickle, an entry runs code when loaded: the cache directory must be yours alone,
as the default one is.

**Answers.** A command's output is a function of its arguments, the files it reads, symmem's
code and the libraries that compute it (sympy, numpy). For ``estimate``, ``infer``,
``max-batch`` and ``solve`` without ``--config`` (so no file is read: a preset and numbers),
the printed answer is stored too, keyed by the arguments as typed, symmem's version and
source bytes and the installed sympy's and numpy's files; :func:`replay` prints a stored
answer without importing sympy, the engine or a model family (``python -m symmem`` asks it
first). A question asked another way is a miss there; at another batch, sequence or number of
tokens generated, ``estimate`` and ``infer`` answer from the question's kit (:mod:`symmem.kit`,
beside the answers), without sympy either; otherwise the estimate entry is read: the
derivation is skipped, the evaluation is not. Only a successful run with nothing on standard
error is stored. An answer is plain text under a checksum, not a pickle.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

__all__ = ["cache_dir", "fingerprint", "cached_estimate", "store", "clear", "answer_key", "replay",
           "recording"]

_MAGIC = b"symmem-estimate-1\n"


def cache_dir() -> Path | None:
    """The cache's directory, or None when ``SYMMEM_NO_CACHE`` is set to anything but 0."""
    if os.environ.get("SYMMEM_NO_CACHE", "0") not in ("", "0"):
        return None
    if os.environ.get("SYMMEM_CACHE_DIR"):
        return Path(os.environ["SYMMEM_CACHE_DIR"])
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "symmem"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "symmem"


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """symmem's version and the bytes of every source file of the package, hashed."""
    from . import __version__
    root = Path(__file__).resolve().parent
    h = hashlib.sha256(__version__.encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _graph_terms(graph, params: dict) -> tuple:
    """The graph as nested tuples of strings, in its own order; ``params`` numbers each Param
    object by first appearance (the same object twice is a tied weight)."""
    from .graph import Node

    def param(p):
        return params.setdefault(id(p), (len(params), p.name, str(p.shape), p.trainable, p.dtype))

    items = []
    for item in graph.items:
        if isinstance(item, Node):
            items.append(("node", item.name, item.op, item.inputs, tuple(param(p) for p in item.params),
                          repr(tuple((k, _stable(v)) for k, v in item.attrs)), str(item.shape)))
        else:
            items.append(("repeat", item.name, str(item.count), _graph_terms(item.body, params), item.carried,
                          item.output, str(item.shape), item.names, repr(item.layer_attrs)))
    bindings = sorted((str(k), str(v)) for k, v in graph.bindings.items())
    return (graph.name, tuple(items), tuple(bindings), graph.externals, graph.outputs,
            tuple(sorted(map(str, graph.requirements))), repr(graph.locals), graph.attention)


def _stable(value):
    """An attribute's value as the same text in every process: a function (a model's check
    that a pass calls) by its module and name, not by its address."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return value


def fingerprint(graph, policy) -> str:
    """The cache key of ``graph`` under ``policy``: equal across processes for equal inputs."""
    terms = (_code_digest(), _graph_terms(graph, {}), repr(policy))
    return hashlib.sha256(repr(terms).encode()).hexdigest()


def _read(path: Path, key: str):
    """The estimate stored at ``path`` under ``key``, or None if it is absent or not sound."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head = len(_MAGIC) + 32 + 64
    if len(blob) <= head or not blob.startswith(_MAGIC):
        return None
    digest, stored, payload = blob[len(_MAGIC):len(_MAGIC) + 32], blob[len(_MAGIC) + 32:head], blob[head:]
    if stored != key.encode() or hashlib.sha256(payload).digest() != digest:
        return None
    import pickle              # here: a stored answer (replay) needs none
    from sympy.core.parameters import evaluate
    try:
        # Without evaluation: each stored expression was canonical when written, so its
        # arguments are rebuilt as they are (the same objects sympy's flattening and sorting
        # would make, at a third of the cost).
        with evaluate(False):
            return pickle.loads(payload)
    except Exception:          # a class that changed shape, a truncated stream: derive afresh
        return None


def _write(path: Path, key: str, est) -> None:
    import pickle
    payload = pickle.dumps(est, protocol=pickle.HIGHEST_PROTOCOL)
    _write_blob(path, _MAGIC + hashlib.sha256(payload).digest() + key.encode() + payload)


def _write_blob(path: Path, blob: bytes) -> None:
    """``blob`` into ``path`` through a temporary file renamed into place; silently nothing
    where the directory cannot be written."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    except OSError:            # a read-only or full disk: the cache is an optimisation only
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


#: entries derived in this process and not yet written: (path, key, estimate)
_PENDING: list = []


def cached_estimate(graph, policy):
    """:func:`symmem.engine.estimate` of ``graph`` under ``policy``, read from the cache when an
    entry is there and sound, else derived; a derived one is written by :func:`store`."""
    from .engine import Estimate, estimate
    where = cache_dir()
    if where is None:
        return estimate(graph, policy)
    key = fingerprint(graph, policy)
    path = where / f"{key}.pickle"
    est = _read(path, key)
    if not isinstance(est, Estimate):
        est = estimate(graph, policy)
        _PENDING.append((path, key, est))
    return est


def store() -> None:
    """Write the entries derived since the last call. The command line calls it when a command
    has finished, so that an entry holds what the command computed from the formulas too (the
    expanded candidates, the regions where each binds), which a warm run then reads instead of
    recomputing."""
    while _PENDING:
        _write(*_PENDING.pop())


def clear() -> int:
    """Remove every entry of the cache, the stored answers and kits with them; the number of
    derived estimates removed (an answer is a copy of what a command printed from one)."""
    where = cache_dir()
    if where is None or not where.is_dir():
        return 0
    for pattern in ("answers/*.txt", "answers/*.kit.json"):
        for path in where.glob(pattern):
            path.unlink(missing_ok=True)
    gone = 0
    for path in where.glob("*.pickle"):
        path.unlink(missing_ok=True)
        gone += 1
    return gone


# ----- answers ------------------------------------------------------------------------------
#: the commands whose printed answer is stored (their output depends on nothing but the
#: arguments once no file is named)
ANSWERED = ("estimate", "infer", "max-batch", "solve")
_ANSWER_MAGIC = b"symmem-answer-1\n"


def _stamp(package: str) -> str:
    """Where an installed library lives and when its files were written (a new version, an
    upgrade in place: a new stamp), found without importing it."""
    from importlib.util import find_spec
    try:
        spec = find_spec(package)
    except (ImportError, ValueError):
        return f"{package}: none"
    if spec is None or not spec.origin:
        return f"{package}: none"
    try:
        st = os.stat(spec.origin)
    except OSError:
        return f"{package}: {spec.origin}"
    return f"{package}: {spec.origin} {st.st_size} {st.st_mtime_ns}"


def answer_key(argv: list[str]) -> str | None:
    """The key of the answer to ``argv`` (the command line's arguments), or None when the
    answer is not stored: another command, or a ``--config`` (or an abbreviation of it) that
    names a file whose contents the key would not see."""
    if not argv or argv[0] not in ANSWERED:
        return None
    for tok in argv[1:]:
        name = tok.split("=", 1)[0]
        if len(name) > 2 and name.startswith("--") and "--config".startswith(name):
            return None
    terms = (_code_digest(), sys.version, _stamp("sympy"), _stamp("numpy"), tuple(argv))
    return hashlib.sha256(repr(terms).encode()).hexdigest()


def _answer_path(key: str) -> Path | None:
    where = cache_dir()
    return None if where is None else where / "answers" / f"{key}.txt"


def replay(argv: list[str]) -> int | None:
    """Print the stored answer to ``argv`` and return the exit status 0; None when there is
    none (the cache off, a command not answered so, no entry, or one not sound)."""
    key = answer_key(argv) if cache_dir() is not None else None
    path = None if key is None else _answer_path(key)
    if path is None:
        return None
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head = len(_ANSWER_MAGIC) + 32 + 64
    digest, stored, payload = blob[len(_ANSWER_MAGIC):len(_ANSWER_MAGIC) + 32], \
        blob[len(_ANSWER_MAGIC) + 32:head], blob[head:]
    if not blob.startswith(_ANSWER_MAGIC) or stored != key.encode() \
            or hashlib.sha256(payload).digest() != digest:
        return None
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return None
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


class _Tee:
    """A text stream that writes through to ``stream`` and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.stream.write(text)

    def __getattr__(self, name):          # flush, encoding, isatty, fileno, ...
        return getattr(self.stream, name)


class recording:
    """``with recording(argv) as rec: ...; rec.status = status``: what the command prints is
    stored as the answer to ``argv`` when it ends with status 0 and printed nothing on
    standard error (a warning, a progress bar) and the streams were left in place."""

    def __init__(self, argv: list[str]):
        self.key = answer_key(argv) if cache_dir() is not None else None
        self.status = None

    def __enter__(self):
        if self.key is not None:
            self.out, self.err = _Tee(sys.stdout), _Tee(sys.stderr)
            self.saved = sys.stdout, sys.stderr
            sys.stdout, sys.stderr = self.out, self.err
        return self

    def __exit__(self, kind, value, tb):
        if self.key is None:
            return False
        intact = sys.stdout is self.out and sys.stderr is self.err
        if intact:
            sys.stdout, sys.stderr = self.saved
        else:                             # the command replaced a stream (a closed pipe)
            sys.stderr = self.saved[1]
        if kind is None and intact and self.status == 0 and not self.err.parts:
            path = _answer_path(self.key)
            if path is not None:
                payload = "".join(self.out.parts).encode("utf-8")
                _write_blob(path, _ANSWER_MAGIC + hashlib.sha256(payload).digest() + self.key.encode() + payload)
        return False
