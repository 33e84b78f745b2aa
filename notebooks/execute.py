"""Run every notebook here top to bottom and keep its outputs, so that a reader on a code
host sees them: ``make notebooks`` (or ``python notebooks/execute.py [NAME ...]``).

Each runs in this folder with a fresh kernel. What changes from run to run without meaning
(execution timings, object addresses) is left out, so that re-running changes nothing when
the numbers have not changed; ``tests/test_notebooks.py`` re-runs them and requires the same
text outputs.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent
ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def clean(book) -> None:
    """Drop timings, object addresses and what goes to stderr (library warnings, which name
    this machine's paths) from an executed notebook, and join consecutive pieces of stdout
    (how the kernel cuts a cell's printing into messages depends on the machine's load; a
    reader sees one text either way)."""
    for cell in book.cells:
        cell.metadata.pop("execution", None)
        if "outputs" in cell:
            kept = []
            for o in cell.outputs:
                if o.output_type == "stream" and o.name == "stderr":
                    continue
                if o.output_type == "stream" and kept and kept[-1].output_type == "stream":
                    kept[-1]["text"] += o.text
                    continue
                kept.append(o)
            cell.outputs = kept
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = ADDRESS.sub("", out["text"])
            data = out.get("data", {})
            if "text/plain" in data:
                data["text/plain"] = ADDRESS.sub("", data["text/plain"])


def execute(path: Path, cwd: Path = HERE):
    book = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}}).execute()
    clean(book)
    return book


def main(names: list[str]) -> int:
    paths = [HERE / n for n in names] if names else sorted(HERE.glob("*.ipynb"))
    for path in paths:
        nbformat.write(execute(path), path)
        print(f"executed {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
