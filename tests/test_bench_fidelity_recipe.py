"""recipes/benchlib/bench_fidelity.py: the bench's --oracle mode judges with ``hf-openjev fidelity``'s back end
(``hf_openjev.fidelity_check``), its own fields kept, and refuses an oracle it cannot judge against before any work.
The oracle here is B's own answers on the tiny shape (no fp32 run needed: the code path is what is tested)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from repo_data import load_recipe

from hf_openjev.fidelity_check import entries_from_responses, items_from_workload, judge_against_oracle
from hf_openjev.fidelity_check.gate import ORACLE_FORMAT, weights_identity


@pytest.fixture(scope="module")
def bench_run():
    """(bench_fidelity module, model, work, B's responses, an oracle holding B's answers)."""
    torch.set_num_threads(1)
    bench = load_recipe("bench_jevbench")
    import benchlib.bench_fidelity as bench_fidelity

    model = bench.build_model("tiny", seed=0, device="cpu")
    work = bench.build_workload(bench.SHAPES_FILE, vocab=bench.VOCAB, seed=0, limit=2)
    responses = [r for _, r in bench.run_pass(model, work, fast=False)]
    oracle = {"format": ORACLE_FORMAT, "shape": "tiny", "seed": 0, **weights_identity(model), "complete": False,
              "requests": entries_from_responses(items_from_workload(work), responses)}
    return bench_fidelity, model, work, responses, oracle


def start(bench_fidelity, model, work, oracle, out):
    args = SimpleNamespace(shape="tiny", seed=0, dtype="bfloat16", fp8=None, oracle="oracle_tiny.json")
    results = {"command": "bench", "versions": {"device": "cpu", "torch": torch.__version__}}
    return bench_fidelity.start_fidelity(oracle, model, work, args=args, out=out, results=results)


def test_the_bench_writes_what_the_fidelity_command_s_judge_writes(bench_run, tmp_path):
    bench_fidelity, model, work, responses, oracle = bench_run
    fidelity = start(bench_fidelity, model, work, oracle, tmp_path / "bench")
    bench_fidelity.add_fidelity(fidelity, "C", responses)
    bench_fidelity.add_fidelity(fidelity, "B", responses)
    items = items_from_workload(work)
    entries = entries_from_responses(items, responses)
    judge_against_oracle(oracle, weights_sha256=weights_identity(model), items=items,
                         entries_by_name={"C": entries, "B": entries}, out=tmp_path / "package", name="tiny",
                         meta=fidelity["meta"])
    written = json.loads((tmp_path / "bench" / "fidelity_tiny.json").read_text())
    assert written == json.loads((tmp_path / "package" / "fidelity_tiny.json").read_text())
    assert (tmp_path / "bench" / "fidelity_tiny.md").read_text() == (tmp_path / "package" / "fidelity_tiny.md").read_text()
    assert list(written["configurations"]) == ["C", "B"]
    for key in ("command", "git_commit", "shape", "seed", "dtype", "fp8", "oracle", "oracle_sha256_check",
                "requests_compared"):  # the bench's own fields, which recipes/merge_fidelity.py reads
        assert key in written, key
    assert written["oracle_sha256_check"]["match"] and written["requests_compared"] == 2
    c = written["configurations"]["C"]
    assert c["passes"] is True and c["max_abs_dp"] == 0
    assert c["decision_agreement"]["agreement"] == 1.0 and c["accuracy"] is None  # the command's judge: agreement
    assert "## Decisions" in (tmp_path / "bench" / "fidelity_tiny.md").read_text()


@pytest.mark.parametrize("tamper, message", [
    (lambda o: o["requests"][1].update(tokens_sha256="0" * 64), "other token ids"),
    (lambda o: o.update(requests=o["requests"][:1]), "not in the oracle"),
    (lambda o: o.update(weights_sha256="0" * 64, stored_weights_sha256="0" * 64), "refusing to compare"),
])
def test_an_oracle_the_bench_cannot_judge_against_is_refused_before_any_arm(bench_run, tmp_path, capsys, tamper,
                                                                              message):
    bench_fidelity, model, work, _, oracle = bench_run
    other = json.loads(json.dumps(oracle))
    tamper(other)
    assert start(bench_fidelity, model, work, other, tmp_path) is None
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
