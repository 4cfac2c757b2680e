"""``hf-openjev eval`` over several processes (issue 23): token-balanced shards, per-rank results files, the merge,
resume after the crash of one rank with another world size, and more ranks than tasks.

The multi-process tests launch ``python -m accelerate.commands.launch --multi_gpu --num_processes N`` (accelerate's
torchrun launcher; on a machine without CUDA the ranks use gloo on the CPU; ``--cpu`` would ask for mpirun) with
CUDA hidden, the tiny fp32 checkpoint and one OpenMP thread per rank. They compare with a single-process run at
``batch_size=1``: each task is then one forward batch whatever the shard, so the numbers must be bit-identical
(larger batches group other tasks' candidates in a shard than in one process: fp32 rounding of ~1e-7).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch_ranks import launch
from repo_data import JEVBENCH_EASY as EASY

from hf_openjev.eval import evaluate as ev
from hf_openjev.eval.sharding import rank_results_files, shard_by_tokens
from hf_openjev.scoring import PreparedRequest
from hf_openjev.work_tokens import task_cost

CPU = {"device": "cpu", "dtype": "float32", "progress": False, "batch_size": 1}
TESTS = Path(__file__).resolve().parent
VOLATILE = ("latency", "seconds")  # keys starting so are wall-clock numbers: never equal across runs


# -- the sharding function ------------------------------------------------------------------------------------------

def test_token_shards_cover_every_task_once_and_balance_within_the_largest_task():
    rng = random.Random(7)
    for trial in range(200):
        costs = [rng.choice([rng.randint(1, 50), rng.randint(100, 5000)]) for _ in range(rng.randint(0, 60))]
        world = rng.randint(1, 9)
        shards = shard_by_tokens(costs, world)
        assert len(shards) == world
        assert sorted(i for s in shards for i in s) == list(range(len(costs)))  # disjoint, complete
        assert all(s == sorted(s) for s in shards)  # input order within a shard
        totals = [sum(costs[i] for i in s) for s in shards]
        if costs:
            assert max(totals) - min(totals) <= max(costs), (trial, costs, world, totals)
        assert shard_by_tokens(list(costs), world) == shards  # deterministic: every rank computes the same


def test_token_shards_balance_tokens_not_task_counts():
    costs = [1000] + [10] * 100  # one long task: an even split by count gives 1490 vs 510 tokens
    shards = shard_by_tokens(costs, 2)
    totals = sorted(sum(costs[i] for i in s) for s in shards)
    assert totals == [1000, 1000]
    assert sorted(len(s) for s in shards) == [1, 100]
    assert shard_by_tokens([3, 3, 3], 2) == [[0, 2], [1]]  # ties: lower index first, into the lower rank


def test_more_ranks_than_tasks_leaves_empty_shards():
    assert shard_by_tokens([5], 2) == [[0], []]
    assert shard_by_tokens([1, 2], 3) == [[1], [0], []]
    assert shard_by_tokens([], 2) == [[], []]
    with pytest.raises(ValueError):
        shard_by_tokens([1], 0)


def test_task_cost_counts_a_shared_prefix_once_on_the_fast_path():
    prepared = PreparedRequest(parsed=None, tokens=[[[1, 2, 3, 4], [1, 2, 3, 5, 6]], [[7, 8]]])
    assert task_cost(prepared, "reference") == prepared.input_tokens == 11
    assert task_cost(prepared, "fast") == 3 + 1 + 2 + 2  # [1, 2, 3] once, the two tails, the lone candidate


def test_python_dash_m_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "hf_openjev", "--version"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.startswith("hf-openjev ")


# -- fixtures -----------------------------------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    from hf_openjev.export.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-shard")).export


@pytest.fixture(scope="module")
def single_run(tiny_export, tmp_path_factory):
    """The reference: one process, batch_size 1, every task of the JevBench sample."""
    out = tmp_path_factory.mktemp("single")
    summary = ev.evaluate(model=tiny_export, data=[EASY], out_dir=out, **CPU)
    return out, summary


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def stable(value):
    """``value`` without its wall-clock fields (at any depth)."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if not k.startswith(VOLATILE)}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def assert_same_as_single(out: Path, single_run, *, in_task_order: bool = True) -> dict:
    single_out, single = single_run
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    for key in ("overall", "by_tier", "by_family", "by_kind", "reliability", "invalid", "model", "data"):
        assert stable(summary[key]) == stable(single[key]), key
    assert summary["counts"]["scored"] == single["counts"]["scored"] == 48
    ours, theirs = lines(out / "results.jsonl"), lines(single_out / "results.jsonl")
    if in_task_order:
        assert [r["id"] for r in ours] == [r["id"] for r in theirs]
    assert {r["id"]: stable(r) for r in ours} == {r["id"]: stable(r) for r in theirs}
    assert len(ours) == 48 and rank_results_files(out) == []
    assert (out / "report.md").is_file() and (out / "reliability.png").is_file()
    return summary


# -- one process resuming what several left -------------------------------------------------------------------------

def test_one_process_resumes_and_merges_the_files_of_a_crashed_three_process_run(tiny_export, single_run, tmp_path):
    records = lines(single_run[0] / "results.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(single_run[0] / "run.json", out / "run.json")

    def write(name, part, torn=""):
        text = "".join(json.dumps(dict(r, latency=9.0)) + "\n" for r in part)
        (out / name).write_text(text + torn, encoding="utf-8")

    write("results.rank0.jsonl", records[0:10])
    write("results.rank2.jsonl", records[20:26], torn='{"id": "easy-0')  # rank 2 died writing a line
    write("results.jsonl", records[40:43])
    summary = ev.evaluate(model=tiny_export, data=[EASY], out_dir=out, **CPU)
    assert summary["counts"]["resumed"] == 19 and summary["counts"]["scored_this_run"] == 29
    assert_same_as_single(out, single_run, in_task_order=False)
    assert [r["id"] for r in lines(out / "results.jsonl")][:3] == [r["id"] for r in records[40:43]]


def test_no_resume_also_deletes_per_rank_files(tiny_export, single_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(single_run[0] / "run.json", out / "run.json")
    (out / "results.rank5.jsonl").write_text((single_run[0] / "results.jsonl").read_text(encoding="utf-8"))
    data = tmp_path / "easy.jsonl"
    data.write_text("".join(EASY.read_text(encoding="utf-8").splitlines(keepends=True)[:2]), encoding="utf-8")
    summary = ev.evaluate(model=tiny_export, data=[data], out_dir=out, resume=False, **CPU)
    assert summary["counts"]["scored_this_run"] == 2 and rank_results_files(out) == []
    assert len(lines(out / "results.jsonl")) == 2


# -- several processes ----------------------------------------------------------------------------------------------

def eval_args(model: Path, data: Path, out: Path) -> list[str]:
    return ["eval", "--model", str(model), "--data", str(data), "--out", str(out), "--dtype", "float32",
            "--batch-size", "1"]


@pytest.mark.slow
def test_two_processes_give_the_single_process_result(tiny_export, single_run, tmp_path):
    out = tmp_path / "out"
    done = launch(2, ["-m", "hf_openjev", *eval_args(tiny_export, EASY, out)])
    assert done.returncode == 0, done.stderr[-4000:]
    summary = assert_same_as_single(out, single_run)
    assert summary["counts"]["scored_this_run"] == 48 and summary["counts"]["resumed"] == 0
    assert done.stdout.count("48 tasks scored") == 1  # rank 0 alone prints the summary
    # the shards rank 0 reported: token totals of the tasks' own tokenization, within the largest task's tokens
    from hf_openjev.eval.tasks import load_tasks, resolve_inputs
    from hf_openjev.model import load_export

    tasks, _ = load_tasks(resolve_inputs([EASY]), progress=False)
    valid, prepared = ev.prepare_tasks(load_export(tiny_export, dtype="float32", device="cpu"), tasks)
    costs = [prepared[t.key][0].input_tokens for t in valid]
    expected = [sum(costs[i] for i in shard) for shard in shard_by_tokens(costs, 2)]
    shard_line = next(line for line in done.stderr.splitlines() if "pending tasks over 2 processes" in line)
    reported = [int(n) for _rank, n in re.findall(r"rank (\d+): \d+ tasks, (\d+) tokens", shard_line)]
    assert reported == expected and sum(reported) == sum(costs)
    assert abs(reported[0] - reported[1]) <= max(costs)


@pytest.mark.slow
def test_a_crashed_rank_is_resumed_on_three_processes(tiny_export, single_run, tmp_path):
    out = tmp_path / "out"
    crash = launch(2, [str(TESTS / "eval_rank_crash.py"), *eval_args(tiny_export, EASY, out)],
                   env={"CRASH_RANK": "1", "CRASH_AFTER": "2"})
    assert crash.returncode != 0
    assert not (out / "summary.json").exists()
    kept = ev.read_results(out / "results.rank1.jsonl")
    assert len(kept) == 2  # rank 1 scored two tasks (batch size 1), then died
    with open(out / "results.rank1.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"id": "easy-')  # and as if it had died in the middle of a line
    before = len(ev.read_done(out))
    assert 2 <= before < 48
    done = launch(3, ["-m", "hf_openjev", *eval_args(tiny_export, EASY, out)])
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resuming: {before} of 48 tasks done" in done.stderr
    assert "pending tasks over 3 processes" in done.stderr
    summary = assert_same_as_single(out, single_run, in_task_order=False)
    assert summary["counts"]["resumed"] == before and summary["counts"]["scored_this_run"] == 48 - before


@pytest.mark.slow
def test_more_processes_than_tasks_finish_without_hanging(tiny_export, tmp_path):
    rows = [json.loads(line) for line in EASY.read_text(encoding="utf-8").splitlines()[:2]]
    rows[1] = dict(rows[1], id="rejected", state=42)  # the contract rejects it: one task left to score
    data = tmp_path / "one.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out"
    done = launch(2, ["-m", "hf_openjev", *eval_args(tiny_export, data, out)], timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["counts"]["scored"] == 1 and summary["counts"]["invalid"] == 1
    assert done.stderr.count("invalid task: request rejected") == 1  # reported by rank 0 only
    assert "rank 1: 0 tasks, 0 tokens" in done.stderr
    assert [r["id"] for r in lines(out / "results.jsonl")] == [rows[0]["id"]] and rank_results_files(out) == []


def test_merging_the_rank_files_on_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    """Issue 36 (no temporary after any resume): a merge that fails to write leaves results.jsonl and the per-rank
    files as they were and no results.jsonl.tmp."""
    import errno

    import hf_openjev.eval.sharding as sharding

    real_open = open

    class FullDisk:
        def __init__(self, path, *args, **kwargs):
            self._file = real_open(path, *args, **kwargs)  # closed by __exit__

        def writelines(self, lines):
            raise OSError(errno.ENOSPC, "No space left on device", self._file.name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._file.close()

    (tmp_path / "results.jsonl").write_text('{"tier": "easy", "id": "a"}\n', encoding="utf-8")
    (tmp_path / "results.rank1.jsonl").write_text('{"tier": "easy", "id": "b"}\n', encoding="utf-8")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(sharding, "open", FullDisk, raising=False)
    with pytest.raises(OSError) as info:
        sharding.merge_results(tmp_path, ev.read_results, [("easy", "a"), ("easy", "b")])
    assert info.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
