"""recipes/pytest_counts.sh: a GPU run's counts come from pytest's own summary line, not from PASSED markers."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from repo_data import REPO

SCRIPT = REPO / "recipes" / "pytest_counts.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# -v -s output: a test's own prints push its PASSED to the start of the next line, where " PASSED" misses it
LOG = """\
tests/test_a.py::test_one PASSED
tests/test_a.py::test_two warming up 3 buckets
PASSED
tests/test_a.py::test_three captured
graphs: 2
PASSED
tests/test_b.py::test_four FAILED
ERROR collecting tests/test_c.py
========== 3 passed, 1 failed, 1 error, 2 skipped, 40 deselected in 12.34s (0:00:12) ==========
pytest rc=1
"""


def _counts(tmp_path, text: str) -> subprocess.CompletedProcess:
    log = tmp_path / "pytest_gpu.log"
    log.write_text(text, encoding="utf-8")
    return subprocess.run(["bash", str(SCRIPT), str(log)], capture_output=True, text=True, timeout=30)


def test_counts_come_from_the_summary_line(tmp_path):
    result = _counts(tmp_path, LOG)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first == "passed 3 failed 1 errors 1 skipped 2"
    assert second.startswith("pytest summary: ===") and "40 deselected" in second
    assert LOG.count(" PASSED") == 1  # what the old grep counted


def test_a_log_without_a_summary_says_so_and_fails(tmp_path):
    result = _counts(tmp_path, "tests/test_a.py::test_one PASSED\n")  # killed by the time limit
    assert result.returncode == 1
    assert "none" in result.stdout and "did not finish" in result.stdout


def test_the_campaign_uses_it():
    campaign = (REPO / "recipes" / "gpu_campaign.sh").read_text(encoding="utf-8")
    assert "recipes/pytest_counts.sh" in campaign
    assert "PASSED\" \"$log\"" not in campaign and "grep -cE" not in campaign
