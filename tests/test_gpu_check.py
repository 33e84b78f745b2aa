"""benchmarks/gpu_check.py, the script `make gpu-check` runs on a CUDA machine, run here on
the CPU with its tiny models: its cases build, its SDPA probe names the kernel symmem is given,
and symmem agrees with the tracked step to the byte, so the script is ready when a GPU is."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402


def test_gpu_check_runs_exact_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "table.json"
    # GPT-2's five cases: eager and SDPA, fp32, bf16 autocast and pure bf16, the three AdamW
    # implementations, full recomputation
    assert gpu_check.main(["--device", "cpu", "--only", "gpt2", "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["sizes"] == "tiny" and len(table["cases"]) == 5
    assert all(c["exact"] and c["saved_predicted"] == c["saved_measured"] for c in table["cases"])
    # GPT-2's attention dropout (0.1) sends SDPA to its math fallback on the CPU
    assert {c["kernel"] for c in table["cases"] if c["attention"] == "sdpa"} == {"math"}
    assert "all exact" in capsys.readouterr().out


def test_gpu_check_says_when_there_is_no_gpu(capsys):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
