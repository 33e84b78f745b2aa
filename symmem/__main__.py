"""``python -m symmem``: the command line, as the ``symmem`` script runs it."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
