"""The `vllm-lite` command line: generate, bench throughput (tiny, JSON fields), serve's refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_lite.cli import main

pytestmark = pytest.mark.e2e


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", "from vllm_lite.cli import entry; entry()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_generate_greedy_from_the_command_line():
    proc = _cli("generate", "--prompt", "The capital of France is", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert "--- 'The capital of France is'" in proc.stdout
    assert "Paris" in proc.stdout


def test_bad_flag_values_exit_with_a_clear_error():
    proc = _cli("generate", "--prompt", "hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr
    proc = _cli("serve", "--data-parallel-backend", "ray")
    assert proc.returncode == 2 and "not yet supported" in proc.stderr


def test_bench_throughput_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", "--num-prompts", "3", "--input-len", "8", "--output-len", "4"]
    assert main([*argv, "--hf-backend", "none", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["vllm_lite"]["output_tokens"] == 12
    assert result["vllm_lite"]["tokens_per_s"] > 0
    assert result["roofline_tokens_per_s"] > result["workload_bound_tokens_per_s"] > 0
    assert set(result["matmul_gflops_by_kernel"]) >= {"torch.mm"}
    assert 0 < result["ratio_vs_roofline"] < 1
