"""hf_openjev.fidelity_check.oracle.write_oracle: the file both oracle builders write (``hf-openjev fidelity`` and
recipes/oracle.py), its counts and order."""

from __future__ import annotations

import json

from hf_openjev.fidelity_check.gate import ORACLE_FORMAT
from hf_openjev.fidelity_check.oracle import write_oracle


def entry(rid: str, seconds: float = 1.0) -> dict:
    return {"id": rid, "kind": "noul", "probabilities": {"q": [0.5]}, "seconds": seconds}


def test_the_entries_asked_for_come_first_and_others_are_kept(tmp_path):
    path = tmp_path / "sub" / "oracle_x.json"
    done = {"b": entry("b"), "z": entry("z", 2.0), "a": entry("a")}
    written = write_oracle(path, {"shape": "x", "seed": 0}, done, ["a", "b"])
    assert json.loads(path.read_text()) == written and not path.with_name(path.name + ".tmp").exists()
    assert [e["id"] for e in written["requests"]] == ["a", "b", "z"]
    assert (written["format"], written["n_total"], written["n_done"], written["seconds"]) == (ORACLE_FORMAT, 3, 3, 4.0)
    assert written["complete"]


def test_a_header_s_n_total_is_the_whole_workload_s_size(tmp_path):
    """recipes/oracle.py counts the whole workload in ``n_total`` while only part of it is done."""
    written = write_oracle(tmp_path / "o.json", {"shape": "x", "seed": 0, "n_total": 231}, {"a": entry("a")},
                           ["a", "b"])
    assert (written["n_total"], written["n_done"], written["complete"]) == (231, 1, False)
