"""hf_openjev.fidelity_check.oracle.write_oracle: the file both oracle builders write (``hf-openjev fidelity`` and
recipes/oracle.py), its counts and order; oracles read from plain ``.json`` or gzipped ``.json.gz`` files (the
committed ones are gzipped), a corrupt ``.gz`` refused in one line naming the file."""

from __future__ import annotations

import gzip
import json

import pytest
from repo_data import committed_oracle_path, repo_path

from hf_openjev.fidelity_check.gate import ORACLE_FORMAT, load_oracle
from hf_openjev.fidelity_check.oracle import read_oracle_progress, write_oracle


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


# --- gzipped oracles (the committed ones: data/bench/oracle_<shape>.json.gz) ------------------------------------

@pytest.mark.parametrize("shape", ["2b", "9b", "27b", "mid"])
def test_a_committed_gzipped_oracle_reads_as_its_plain_json(shape, tmp_path):
    """The committed file is ``gzip -9 -n`` of the JSON (no name, no time in its header); the fidelity command's
    reader (``load_oracle``) and the resume path (``read_oracle_progress``) give the same oracle from it as from
    the plain JSON it holds."""
    packed = committed_oracle_path(shape)
    raw = packed.read_bytes()
    assert raw[:3] == b"\x1f\x8b\x08" and raw[3] == 0 and raw[4:8] == bytes(4)  # deflate; no FNAME; mtime 0
    plain = tmp_path / f"oracle_{shape}.json"
    plain.write_bytes(gzip.decompress(raw))
    expected = json.loads(plain.read_text())
    assert expected["format"] == ORACLE_FORMAT and expected["shape"] == shape and len(expected["requests"]) == 231
    assert load_oracle(packed) == load_oracle(plain) == expected
    assert read_oracle_progress([packed]) == read_oracle_progress([plain])
    assert read_oracle_progress([packed])["requests"] == expected["requests"]


def test_every_committed_oracle_is_stored_as_gzip_without_name_or_time():
    """Every oracle in data/bench (the shapes' and the per-seed ones to come) is a ``.json.gz`` written by
    ``gzip -9 -n``: a plain ``.json`` oracle (110 KB where the gzipped one is 33 KB) would push recipes/ past its
    size rule (issue 38), and a name or time in the header would change the bytes from one compression to the next."""
    files = sorted(repo_path("data/bench").glob("oracle_*"))
    assert len(files) >= 4
    assert [f.name for f in files if not f.name.endswith(".json.gz")] == []
    for f in files:
        header = f.read_bytes()[:10]
        assert header[:3] == b"\x1f\x8b\x08" and header[3] == 0 and header[4:8] == bytes(4), f.name


def gzip_cases() -> dict[str, bytes]:
    text = json.dumps({"format": ORACLE_FORMAT, "shape": "x", "seed": 0, "weights_sha256": "ab",
                       "requests": [entry("a")]}).encode()
    return {"plain JSON under a .gz name": text, "a cut gzip stream": gzip.compress(text)[:-12],
            "a damaged gzip stream": gzip.compress(text)[:12] + b"\xff" * 40 + gzip.compress(text)[52:],
            "gzipped non-JSON": gzip.compress(b"{not json")}


@pytest.mark.parametrize("case", ["plain JSON under a .gz name", "a cut gzip stream", "a damaged gzip stream",
                                  "gzipped non-JSON"])
def test_a_corrupt_gz_is_a_one_line_error_naming_the_file(case, tmp_path):
    path = tmp_path / "oracle_x.json.gz"
    path.write_bytes(gzip_cases()[case])
    for read in (load_oracle, lambda p: read_oracle_progress([p])):
        with pytest.raises(ValueError) as caught:
            read(path)
        message = str(caught.value)
        assert message.startswith(f"{path} is not ") and "\n" not in message, message
        assert ("valid JSON" if case == "gzipped non-JSON" else "not a valid gzip file") in message, message


def test_write_oracle_gzips_only_a_gz_path_and_the_same_oracle_gives_the_same_bytes(tmp_path):
    done, header = {"a": entry("a"), "b": entry("b")}, {"shape": "x", "seed": 0, "weights_sha256": "ab"}
    written = write_oracle(tmp_path / "oracle_x.json.gz", header, done, ["a", "b"])
    first = (tmp_path / "oracle_x.json.gz").read_bytes()
    assert first[:2] == b"\x1f\x8b" and load_oracle(tmp_path / "oracle_x.json.gz") == written
    assert not (tmp_path / "oracle_x.json.gz.tmp").exists()
    write_oracle(tmp_path / "oracle_x.json.gz", header, done, ["a", "b"])
    assert (tmp_path / "oracle_x.json.gz").read_bytes() == first  # no time in the header
    write_oracle(tmp_path / "oracle_x.json", header, done, ["a", "b"])
    assert json.loads((tmp_path / "oracle_x.json").read_text()) == written  # plain JSON, not gzipped
    assert gzip.decompress(first) == (tmp_path / "oracle_x.json").read_bytes()
