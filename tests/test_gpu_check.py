"""benchmarks/gpu_check.py runs its checks end to end (on the CPU here; on a GPU when one is lent)."""

from __future__ import annotations

import json

import pytest
import torch
from benchmarks import gpu_check


def test_gpu_check_smoke_run_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--size-gb", "0.02", "--dir", str(tmp_path / "s"), "--out", str(out)]
    assert gpu_check.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["checks"] and all(doc["checks"].values())
    assert doc["blocking_s"] > 0 and doc["torch_save_fsync_s"] > 0 and doc["state_gb"] > 0.01
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run benchmarks/gpu_check.py there)")
def test_gpu_check_on_cuda(tmp_path):
    assert gpu_check.main(["--size-gb", "0.5", "--skip-tests", "--dir", str(tmp_path / "s")]) == 0


def test_the_gpu_check_runs_every_file_that_holds_a_cuda_test():
    """A CUDA test in a file the GPU check leaves out would never run: it is skipped here."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(gpu_check.__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", "-m", "cuda", "tests"]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120, check=True).stdout
    files = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    assert "tests/test_scaler.py" in files, out[-2000:]
    assert files - {"tests/test_gpu_check.py"} <= set(gpu_check.CUDA_TEST_FILES)
