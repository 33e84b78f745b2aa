"""``python -m symmem`` and the ``symmem`` script: the command line.

A question answered before is printed from the cache (:func:`symmem.cache.replay`) before the
command line's modules (sympy, the engine, the model families) are imported, and so is a table
(or JSON) of a model and policy asked before at other values (:func:`symmem.kit.answer`);
otherwise :func:`symmem.cli.main` runs, and its answer is stored (:class:`symmem.cache.recording`).
"""
import sys

from .cache import recording, replay

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (see :func:`symmem.cli.main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    status = replay(argv)
    if status is None:
        from .kit import answer
        status = answer(argv)
    if status is not None:
        return status
    from .cli import main as run
    with recording(argv) as rec:
        rec.status = run(argv)
    return rec.status


if __name__ == "__main__":
    raise SystemExit(main())
