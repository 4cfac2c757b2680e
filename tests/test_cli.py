"""hf_openjev.cli: the ``hf-openjev`` command line (demo here; export/eval/serve are tested in their own files)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_openjev import cli
from hf_openjev.checkpoint.manifest import MANIFEST_NAME
from hf_openjev.contract import KIND_NAMES
from hf_openjev.demo import cli as demo
from hf_openjev.demo.cli import demo_build_dir


def _stamp(root: Path) -> dict:
    return {p.relative_to(root): (p.stat().st_mtime_ns, p.stat().st_ino) for p in root.rglob("*") if p.is_file()}


def test_build_parser_knows_every_subcommand():
    parser = cli.build_parser("demo")
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == ["demo", "export", "quantize", "eval", "serve", "fidelity"]
    args = parser.parse_args(["demo", "--cache-dir", "/x", "--device", "cpu", "--dtype", "bfloat16"])
    assert (args.command, args.cache_dir, args.device, args.dtype) == ("demo", "/x", "cpu", "bfloat16")
    assert parser.parse_args(["demo"]).dtype == "float32"


def test_only_the_chosen_command_module_is_imported():
    code = ("import sys; from hf_openjev import cli; cli.build_parser('demo'); "
            "print(sorted(m for m in ('hf_openjev.serve.startup', 'hf_openjev.eval.evaluate', 'hf_openjev.export.cli') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "usage: hf-openjev" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_prints_responses_and_reuses_the_cache(tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli.main(["demo", "--cache-dir", str(cache), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "The weights are RANDOM" in out
    for kind in KIND_NAMES:  # the demo asks one question of every kind
        assert f'"type": "{kind}"' in out
    assert '"model": "open-jev/tiny-random"' in out
    built = [d for d in cache.iterdir()]  # the demo builds in a folder of its own (tiny-demo, or tiny-demo-toy)
    assert [d.name for d in built] in (["tiny-demo"], ["tiny-demo-toy"])
    assert (built[0] / "export" / MANIFEST_NAME).is_file()
    stamp = _stamp(cache)

    assert cli.main(["demo", "--cache-dir", str(cache), "--device", "cpu"]) == 0
    again = capsys.readouterr().out
    assert _stamp(cache) == stamp  # nothing rebuilt or rewritten
    strip = [line for line in out.splitlines() if "inference_seconds" not in line]
    assert [line for line in again.splitlines() if "inference_seconds" not in line] == strip


def test_demo_reports_a_broken_cache_as_an_error(tmp_path, capsys, tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(demo, "pick_demo_tokenizer", lambda: "toy")  # the fixture's tokenizer: no upgrade rebuild
    cache = tmp_path / "cache"
    build = demo_build_dir(cache, "toy")  # the demo's own folder under --cache-dir
    shutil.copytree(tiny_checkpoint.root, build)
    manifest = build / "export" / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    data["format"] = "something-else/9"
    manifest.write_text(json.dumps(data))
    assert cli.main(["demo", "--cache-dir", str(cache), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("hf-openjev demo: error: ")]
    assert len(errors) == 1, err
    assert errors[0].endswith("unknown format 'something-else/9'; this version reads 'open-jev-text-merged/1' and "
                              "'open-jev-text-merged-fp8/1'")


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("hf-openjev")
    assert script.is_file()
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: hf-openjev")
    for name in ("demo", "export", "eval", "serve"):
        assert name in out.stdout
