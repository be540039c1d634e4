"""The benchmarks run once each, at tiny shapes, so they cannot rot (pytest-benchmark's
``--benchmark-disable`` runs every benchmark body a single time without timing it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_benchmarks_run_once_at_small_shapes():
    env = {**os.environ, "KVBENCH_PROMPT_LEN": "48", "KVBENCH_SMOKE": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "bench", "-q", "-x", "--benchmark-disable",
                           "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
