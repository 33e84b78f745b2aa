"""The notebooks run top to bottom (make test executes them) and git holds them with their
outputs, so that a reader on a code host sees them: the text each cell prints now must be
the text stored (``make notebooks`` refreshes them)."""
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

HERE = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))
sys.path.insert(0, str(HERE))
from execute import clean, execute  # noqa: E402


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_scaling_laws.ipynb",
                                           "03_largest_batch.ipynb", "04_latex_export.ipynb",
                                           "05_validation.ipynb", "06_your_own_model.ipynb",
                                           "07_seed_claims.ipynb"]


def _texts(book) -> list:
    """Per code cell: its outputs as (kind, text), images as their kind only."""
    out = []
    for cell in book.cells:
        if cell.cell_type != "code":
            continue
        items = []
        for o in cell.outputs:
            if o.output_type == "stream":
                items.append(("stream", o.text))
            elif o.output_type in ("execute_result", "display_data"):
                kinds = sorted(o.data)
                items.append(("image", None) if "image/png" in kinds else ("text", o.data.get("text/plain")))
            else:
                items.append((o.output_type, o.get("evalue")))
        out.append(items)
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_its_stored_outputs_are_current(path):
    stored = nbformat.read(path, as_version=4)
    assert any(c.get("outputs") for c in stored.cells if c.cell_type == "code"), \
        f"{path.name} has no outputs: run make notebooks"
    fresh = execute(path)      # raises CellExecutionError with the failing cell and its traceback
    # (execute() leaves out what went to stderr: warnings that name this machine's paths)
    errors = [o for c in fresh.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    clean(stored)
    assert _texts(fresh) == _texts(stored), f"{path.name}: outputs changed; run make notebooks"
