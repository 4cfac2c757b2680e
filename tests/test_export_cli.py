"""hf_openjev.export.cli: the options checked before any file is read (``--max-shard-size``, issue 36)."""

from __future__ import annotations

import os

import pytest

import hf_openjev.checkpoint.publish as publish
import hf_openjev.export.merge as merge
from hf_openjev.errors import UsageError
from hf_openjev.export.cli import check_shard_size


def _cli(monkeypatch, argv):
    import hf_openjev.cli as cli

    monkeypatch.setattr(cli, "COMMANDS", {"export": cli.COMMANDS["export"]})
    return cli.main(argv)


@pytest.mark.parametrize("size, what", [("5", "means 5 bytes"), ("30KB", "means 30,000 bytes"),
                                        ("6GB", "means 6,000,000,000 bytes"), ("5 GiB", "is not a size")])
def test_a_shard_size_that_is_surely_a_mistake_is_one_line_before_any_work(size, what, tiny_checkpoint, tmp_path,
                                                                            monkeypatch, capsys):
    """--max-shard-size 5 silently meant 5 bytes (55 shards). Now 1MB..5GB, one line naming the option."""
    monkeypatch.setattr(merge, "plan_export", lambda *a, **k: pytest.fail("the export started"))
    monkeypatch.setattr(publish, "claim_temp_dir", lambda *a, **k: pytest.fail("a temporary was made"))
    rc = _cli(monkeypatch, ["export", "--base", str(tiny_checkpoint.base), "--package", str(tiny_checkpoint.package),
                            "--out", str(tmp_path / "export"), "--max-shard-size", size])
    assert rc == 2
    assert capsys.readouterr().err == (f"hf-openjev export: error: --max-shard-size {size} {what}; give 1MB to 5GB "
                                       "with its unit, e.g. 2GB or 500MB\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("size, nbytes", [("5GB", 5 * 10**9), ("2gb", 2 * 10**9), ("500MB", 500 * 10**6),
                                          ("1.5 GB", 1_500_000_000), ("1MB", 10**6), ("2000000", 2_000_000)])
def test_sizes_in_range_are_decimal_bytes(size, nbytes):
    assert check_shard_size(size) == nbytes


def test_the_floor_and_the_ceiling():
    with pytest.raises(UsageError, match="means 999,999 bytes"):
        check_shard_size("999999")
    with pytest.raises(UsageError, match="means 5,000,000,001 bytes"):
        check_shard_size("5000000001")
