"""loadtests/gpu_check.py, the GPU path's one-shot check, kept runnable: a CPU smoke run on builtin:tiny-llama
(random weights) must find the engine's greedy tokens equal to Hugging Face's and its log-probabilities within
tolerance, and report tokens/s for every batch and cache setting. On a CUDA machine the same script runs
without --smoke (docs/benchmarks.md says where and when it last ran on one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "loadtests" / "gpu_check.py"


def test_the_gpu_check_runs_on_cpu_and_finds_the_engine_exact(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--models", "tiny-llama",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    [check] = report["checks"]
    assert check["exact_tokens"] and check["tokens_matched"] == [16, 16, 16, 16]
    assert 0 <= check["max_logprob_diff"] <= 1e-3
    cells = {(row["batch"], row["prefix_caching"]) for row in report["throughput"]}
    assert cells == {(1, False), (1, True), (4, False), (4, True)}
    assert all(row["tokens_per_s"] > 0 for row in report["throughput"])


def test_a_cuda_device_that_is_not_there_is_one_line() -> None:
    import torch
    if torch.cuda.is_available():
        return  # on a GPU machine the script runs for real instead
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--smoke"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "torch sees no CUDA device" in done.stderr
