"""Run the jevcompat conformance suite (PyPI ``jevcompat``) against a live ``hf-openjev serve``.

    pip install jevcompat            # brings typesafe-sdk, whose parsing is one of the MUST checks
    python recipes/jevcompat_conformance.py                       # tiny random checkpoint on CPU
    python recipes/jevcompat_conformance.py --model /path/to/export --device cuda --dtype auto
    python recipes/jevcompat_conformance.py --key SECRET    # server with that API key; jevcompat's auth checks run

It starts the server in a subprocess on a free 127.0.0.1 port, waits for ``/health``, runs every jevcompat case
(the official typesafe-sdk client included), writes ``report.json`` and ``report.md`` to ``--out``, then stops
the server with SIGTERM and checks that it shut down cleanly (drained, ``shutdown complete`` in ``server.log``).

Exit status: 0 when every MUST requirement passed (requirements named with ``--known-deviation`` may fail, and are
reported as such), 1 otherwise, 2 when the suite could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib.local_server import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("jevcompat-report")  # in the current directory; summaries go to recipes/RESULTS.md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="merged export directory (default: build the tiny random checkpoint)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"report directory (default {DEFAULT_OUT})")
    parser.add_argument("--timeout", type=float, default=120.0, help="jevcompat's per-request timeout")
    parser.add_argument("--known-deviation", action="append", default=[], metavar="REQ",
                        help="a MUST requirement id allowed to fail (repeatable), e.g. noul.criteria")
    parser.add_argument("--server-arg", action="append", default=[], help="extra argument for hf-openjev serve")
    parser.add_argument("--key", default=None,
                        help="start the server with this API key ($HF_OPENJEV_API_KEYS, not on its command line) "
                             "and pass it to jevcompat (--key), which then also checks missing and wrong keys")
    args = parser.parse_args(argv)

    try:
        from jevcompat import __version__ as jevcompat_version
        from jevcompat import report, runner
    except ImportError:
        print("jevcompat is not installed: pip install jevcompat", file=sys.stderr)
        return 2

    model_dir = args.model
    if model_dir is None:
        from hf_openjev.export.tiny import build_tiny_checkpoint

        cache = Path(os.environ.get("HF_OPENJEV_CACHE") or tempfile.gettempdir()) / "hf_openjev-tiny-conformance"
        model_dir = str(build_tiny_checkpoint(cache).export)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "server.log"
    cmd = [sys.executable, "-m", "hf_openjev.cli", "serve", "--model", model_dir, "--port", str(port),
           "--device", args.device, "--dtype", args.dtype, "--log-level", "info", *args.server_arg]
    print("starting:", " ".join(cmd), flush=True)
    with open(log_path, "w", encoding="utf-8") as log:
        env = {**os.environ, "HF_OPENJEV_API_KEYS": args.key} if args.key else None
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            wait_healthy(url, proc, timeout=300)
            started = time.perf_counter()
            rep = runner.run(url, key=args.key, timeout=args.timeout)
            seconds = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001
            print(f"conformance run failed: {exc}", file=sys.stderr)
            proc.kill()
            proc.wait()
            return 2
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    (out / "report.json").write_text(report.to_json(rep) + "\n", encoding="utf-8")
    title = f"hf-openjev serve ({Path(model_dir).name}, {args.device}, {args.dtype}) — jevcompat {jevcompat_version}"
    (out / "report.md").write_text(report.markdown(rep, title=title) + "\n", encoding="utf-8")
    print(report.terminal(rep, color=False))

    # uvicorn re-raises SIGTERM after its graceful shutdown, so the status is -SIGTERM; the log tells the rest.
    server_log = log_path.read_text(encoding="utf-8", errors="replace")
    graceful = proc.returncode in (0, -signal.SIGTERM) and "shutdown complete" in server_log
    failed_musts = sorted(r.id for r in rep.results if r.level == "MUST" and r.status == "fail")
    unexpected = [r for r in failed_musts if r not in args.known_deviation]
    summary = {
        "jevcompat": jevcompat_version,
        "verdict": rep.verdict,
        "summary": rep.summary(),
        "failed_musts": failed_musts,
        "known_deviations": [r for r in failed_musts if r in args.known_deviation],
        "failed_shoulds": sorted(r.id for r in rep.results if r.level == "SHOULD" and r.status == "fail"),
        "untested_musts": rep.untested_musts,
        "api_key": bool(args.key),
        "server_exit_status": proc.returncode,
        "server_shutdown_graceful": graceful,
        "seconds": round(seconds, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))
    if not graceful:
        print(f"the server did not shut down cleanly (exit status {proc.returncode}); see {log_path}", file=sys.stderr)
        return 1
    if rep.aborted:
        return 2
    if unexpected or rep.untested_musts:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
