"""recipes/gpu_ops_check.py's CPU smoke mode: every case's inputs build and run through the op and its reference.

On the CPU the op *is* its reference, so this checks the script's plumbing (case builders, tolerances, output),
not the kernels: those are checked by the script on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "gpu_ops_check.py"


@pytest.mark.slow
def test_every_case_runs_in_cpu_smoke_mode(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(RECIPE), "--out", str(tmp_path), "--cpu-smoke"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 14 and all(r["ok"] and r["dtype"] == "float32" and r["tokens"] == 939 for r in rows)
    assert {r["op"] for r in rows} >= {"gdn_prefill", "prefix_attention", "sigmoid_gate"}
