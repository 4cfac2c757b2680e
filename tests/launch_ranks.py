"""Launch a script on N CPU ranks with ``accelerate launch`` (its torchrun launcher), for the multi-process tests.

``--multi_gpu`` picks accelerate's torchrun launcher (``--cpu`` would ask for mpirun); with CUDA hidden every rank
runs on the CPU and ``torch.distributed`` uses gloo. One OpenMP thread per rank, a free port per launch (other
test runs may share the machine), and the whole process group is killed on timeout, so a hang fails the test
instead of blocking the suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, script: list[str], *, timeout: float = 150, env=None) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``script`` on ``processes`` CPU ranks; the whole process group is killed on timeout
    (a hang fails the test instead of blocking the suite)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), *script]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{processes} processes did not finish within {timeout} s (hang?)\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
