"""End-to-end benchmark: the 231 JevBench requests as text through ``hf-openjev serve``'s app over HTTP.

    python recipes/bench_e2e.py --shape 27b --arms B,C --out results/e2e

Measured the way the native server measures its published figures: the requests as text (built from
``data/jevbench/{easy,original,hard}.jsonl`` by ``hf_openjev.eval.tasks``, as ``hf-openjev eval`` builds them),
served by the package's own server app (``hf_openjev.serve.app.create_app``: arm C the fast path, arm B the
reference path, as ``serve --reference``) on 127.0.0.1 with uvicorn, the bench's seeded random weights
(``benchlib.random_model.build_model``, handed to the app in-process) and the real Qwen3.5 tokenizer
(``hf_openjev.tokenizer.qwen_tokenizer.load_qwen_tokenizer``; ``--tokenizer DIR`` loads another one instead). One client in
its own process (``benchlib/http_client.py``) holds one keep-alive connection and sends the next request when the
previous answer is parsed; serialization, HTTP, tokenization, the model and response parsing are inside the timer.
Per arm: one warm-up pass, then one timed pass.

Writes ``e2e_<shape>_<arms>.json`` (per arm: ``mean_ms``, ``p50_ms``, ``p95_ms``, the kind x longest-candidate
table, per-request ms; the command, versions, device, git commit) and ``.md`` with the native server's group means
beside it. Requests are bucketed by the exact manifest's token counts (``data/bench/jevbench231-shapes.json``,
matched by task id). ``--in-process bench_<shape>_<dtype>.json`` adds what HTTP and tokenization add per request
over that in-process run's mean (same shape and arms).

After the first arm, the same client runs the requests once more against a bare ASGI app under the same uvicorn
(``benchlib.http_floor``: it reads the body, hands off to a worker thread and back, answers the first arm's median
answer size): ``http_floor_ms`` by the same buckets as the server's own time, the part of it no server code of ours
can save.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib.groups import longest_tokens, native_comparison_lines, table
from benchlib.http_floor import bare_app, floors_ms
from benchlib.local_server import serve_in_thread
from benchlib.provenance import command_line, git_commit, versions
from benchlib.random_model import add_model_arguments, build_model, default_device
from benchlib.timing import median_and_p90, summarize
from benchlib.warmth import covers_every_shape, warmth_note
from benchlib.workload import add_manifest_argument, check_manifest_argument, manifest_identity

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "jevbench"  # the public JevBench tasks (MIT), as the repository ships them
TIERS = ("easy", "original", "hard")
CLIENT = Path(__file__).resolve().parent / "benchlib" / "http_client.py"
QWEN_CHAT = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3.5's halves


def parse_arguments(argv) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """The checked namespace (``arms`` a list) and its parser; every check before any work."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="27b")
    add_manifest_argument(parser)
    parser.add_argument("--arms", default="B,C", help="B: the reference path (serve --reference); C: the fast path")
    parser.add_argument("--data", type=Path, default=DATA,
                        help="folder of easy.jsonl, original.jsonl and hard.jsonl (default: the repository's "
                             "data/jevbench)")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only (smoke runs)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a Hugging Face tokenizer folder instead of the real Qwen3.5 tokenizer (smoke runs)")
    parser.add_argument("--in-process", type=Path, default=None, metavar="BENCH.json",
                        help="bench_jevbench.py's result of the same shape: report HTTP + tokenization over it")
    args = parser.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or not set(args.arms) <= {"B", "C"} or len(set(args.arms)) != len(args.arms):
        parser.error(f"--arms: give B and/or C, each once (got {','.join(args.arms) or 'nothing'})")
    check_manifest_argument(parser, args)
    missing = [t for t in TIERS if not (args.data / f"{t}.jsonl").is_file()]
    if missing:
        parser.error(f"--data {args.data}: no {', '.join(f'{t}.jsonl' for t in missing)} there; the JevBench "
                     "tasks belong in the repository's data/jevbench/ (or pass --data DIR)")
    if args.in_process is not None and not args.in_process.is_file():
        parser.error(f"--in-process {args.in_process}: no such file")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    return args, parser


def load_requests(data: Path, manifest: Path, *, limit: int | None) -> list[tuple[dict, dict]]:
    """(manifest item, request dict) per task of ``data``'s tiers in order (first ``limit``); a task the manifest
    does not name is an error (its bucket would be unknown)."""
    from hf_openjev.eval.tasks import Source, load_tasks

    tasks, invalid = load_tasks([Source(data / f"{t}.jsonl", t) for t in TIERS], progress=False)
    if invalid:
        raise ValueError(f"{invalid[0]['file']}:{invalid[0]['line']}: {invalid[0]['error']}")
    shapes = {item["id"]: item for item in json.loads(manifest.read_text())["requests"]}
    unknown = [t.id for t in tasks if t.id not in shapes]
    if unknown:
        raise ValueError(f"task {unknown[0]!r} is not in {manifest.name}: pass the manifest of these tasks")
    return [(shapes[t.id], t.request) for t in tasks][:limit]


def load_tokenizer(path: Path | None):
    """The real Qwen3.5 tokenizer (``hf_openjev.tokenizer.qwen_tokenizer``), or the one saved at ``path``; a one-line
    SystemExit when it is not available."""
    if path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    try:
        from hf_openjev.tokenizer.qwen_tokenizer import load_qwen_tokenizer
    except ImportError as error:
        raise SystemExit(f"bench_e2e: the real Qwen3.5 tokenizer is not available ({error}); install the project's "
                         "tokenizer extra (qwen-tokenizer), or pass --tokenizer DIR for a smoke run") from None
    return load_qwen_tokenizer()


def attach_tokenizer(model, tokenizer) -> None:
    """Give the random model ``tokenizer`` and the chat halves its template renders (Qwen3.5's own without one)."""
    from hf_openjev.errors import CheckpointError
    from hf_openjev.tokenizer.chat import render_chat_halves

    try:
        prefix, suffix = render_chat_halves(tokenizer)
    except CheckpointError:
        prefix, suffix = QWEN_CHAT
    model.tokenizer = tokenizer
    model.manifest = dataclasses.replace(model.manifest, chat_prefix=prefix, chat_suffix=suffix)


def serve_arm(model, arm: str):
    """A started uvicorn server of the package's app for ``arm`` on 127.0.0.1 (a thread), and its port."""
    from hf_openjev.family import text_model_of
    from hf_openjev.fast_options import options_for
    from hf_openjev.patches import patch_record, revert_patches
    from hf_openjev.serve.app import create_app

    if arm == "B" and patch_record(model) is not None:
        revert_patches(model)  # B is the stock model, as serve --reference loads it
    # C: the model's own defaults (a family member's), as `hf-openjev serve` runs them without --fast-options
    app = create_app(model, fast=arm == "C", options=options_for(text_model_of(model).config) if arm == "C" else None)
    return serve_in_thread(app, name=f"e2e-{arm}")


def run_client(port: int, requests: list[dict], work: Path, *, warmup_requests: int | None = None) -> dict:
    """The client process's warm-up (the first ``warmup_requests``, default all) and timed passes over
    ``requests`` (see benchlib/http_client.py)."""
    plan, result = work / "plan.json", work / "result.json"
    plan.write_text(json.dumps({"host": "127.0.0.1", "port": port, "path": "/v1/systemone",
                                "passes": ["warm-up", "timed"], "requests": requests,
                                "warmup_requests": warmup_requests}))
    done = subprocess.run([sys.executable, str(CLIENT), str(plan), str(result)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or f"the client exited with {done.returncode}")
    return json.loads(result.read_text())


def measure_arm(model, arm: str, work: list[tuple[dict, dict]], *, warmup_requests: int | None = None) -> dict:
    """One arm: serve, run the client (warm-up, timed), stop the server; the arm's summary and table.
    ``warmup_requests``: warm up on the first N requests only (a model an in-process run already warmed up)."""
    server, thread, port = serve_arm(model, arm)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            client = run_client(port, [request for _, request in work], Path(scratch),
                                warmup_requests=warmup_requests)
    finally:
        server.should_exit = True
        thread.join(60)
    times = client["passes"]["timed"]["ms"]
    warmup_s = sum(client["passes"]["warm-up"]["ms"]) / 1000
    answer_bytes = int(statistics.median(len(json.dumps(answer)) for answer in client["answers"]))
    return {**summarize(times), "warmup_s": warmup_s, "wall_s": time.perf_counter() - start,
            "table": table([(item, None) for item, _ in work], times), "per_request_ms": times,
            "path": "fast" if arm == "C" else "reference", "answer_bytes": answer_bytes}


def measure_floor(work: list[tuple[dict, dict]], *, answer_bytes: int) -> list[float]:
    """Each request's HTTP floor (ms, in ``work``'s order): the same client against
    :func:`~benchlib.http_floor.bare_app` (no wait, the thread hops kept), after a warm-up pass."""
    waits: list[float] = []
    server, thread, port = serve_in_thread(bare_app(0.0, answer_bytes, waits), name="e2e-floor")
    try:
        with tempfile.TemporaryDirectory() as scratch:
            client = run_client(port, [request for _, request in work], Path(scratch))
    finally:
        server.should_exit = True
        thread.join(60)
    return floors_ms(client["passes"]["timed"]["ms"], waits)


def add_floor(results: dict, work: list[tuple[dict, dict]], *, answer_bytes: int) -> None:
    """``results["http_floor_ms"]``: the floor per request, by the server time's buckets (median, p90, n)."""
    floors = measure_floor(work, answer_bytes=answer_bytes)
    tokens = [longest_tokens(item) for item, _ in work]
    results["http_floor_ms"] = {f"{lo}-{hi}": {"n": len(picked), **median_and_p90(picked)}
                                for lo, hi in SERVER_TIME_BUCKETS
                                if (picked := [f for f, n in zip(floors, tokens) if lo <= n <= hi])}


def request_names(work: list[tuple[dict, dict]]) -> dict:
    """The requests' ids in ``per_request_ms``'s order, and each one's longest sequence in tokens."""
    return {"request_ids": [item["id"] for item, _ in work],
            "request_tokens": [longest_tokens(item) for item, _ in work]}


# the server's own time is reported by the longest sequence's tokens: issue 37's targets are set up to 512 and at 3,400
SERVER_TIME_BUCKETS = ((1, 512), (513, 2048), (2049, 16384), (3300, 3500))


def server_time_by_bucket(http: dict[str, float], in_process: dict[str, float], tokens: dict[str, int]) -> dict:
    """``"lo-hi"`` -> {n, median_ms, p90_ms} of HTTP minus in-process per request (matched by id), by ``tokens``."""
    out = {}
    for lo, hi in SERVER_TIME_BUCKETS:
        diffs = [http[i] - in_process[i] for i in http if i in in_process and lo <= tokens[i] <= hi]
        if diffs:
            out[f"{lo}-{hi}"] = {"n": len(diffs), **median_and_p90(diffs)}
    return out


def add_in_process(results: dict, path: Path, *, bench: dict | None = None) -> None:
    """Per arm of both runs: this run's mean minus the in-process run's (HTTP, tokenization, JSON), and, where both
    name their requests (``request_ids``), the same per request by bucket (``server_ms``: the server's own time);
    ``bench``: the in-process results themselves (the same process ran both), ``path`` then only names them."""
    bench = json.loads(path.read_text()) if bench is None else bench
    same = bench.get("manifest_sha256") == results["manifest_sha256"] and bench.get("shape") == results["shape"]
    results["in_process"] = {"file": path.name, "shape": bench.get("shape"), "manifest": bench.get("manifest"),
                             "same_workload": same}
    for arm, r in results["arms"].items():
        other = bench.get("arms", {}).get(arm)
        if other and not other.get("parity_only") and not other.get("cold") and not r.get("cold"):
            r["in_process_mean_ms"] = bench["arms"][arm]["mean_ms"]
            r["over_in_process_ms"] = r["mean_ms"] - bench["arms"][arm]["mean_ms"]
            if same and bench.get("request_ids") and results.get("request_ids"):
                r["server_ms"] = server_time_by_bucket(
                    dict(zip(results["request_ids"], r["per_request_ms"])),
                    dict(zip(bench["request_ids"], other["per_request_ms"])),
                    dict(zip(results["request_ids"], results["request_tokens"])))


def write_markdown(results: dict, path: Path) -> None:
    lines = [f"# JevBench-231 end to end over HTTP, {results['shape']} shape, {results['dtype']}, random weights", "",
             f"Command: `{results['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), "",
             f"Git commit: {results['git_commit']}; tokenizer: {results['tokenizer']}; requests: {results['n']}", "",
             "| arm | path | n | mean ms | p50 ms | p95 ms | warm-up s | over in-process ms |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, r in results["arms"].items():
        over = r.get("over_in_process_ms")
        name = arm + warmth_note(r.get("cold", False), r.get("warmup_requests", r["n"]), r["n"])
        lines.append(f"| {name} | {r['path']} | {r['n']} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | "
                     f"{r['warmup_s']:.1f} | {'-' if over is None else f'{over:.1f}'} |")
    for arm, r in results["arms"].items():
        if r.get("server_ms"):
            lines += ["", f"Arm {arm}, the server's own time (HTTP minus in process, per request, by the longest "
                          "sequence's tokens): " + "; ".join(f"{b} tokens median {v['median_ms']:.2f} ms, p90 "
                                                             f"{v['p90_ms']:.2f} (n {v['n']})"
                                                             for b, v in r["server_ms"].items())]
    if results.get("http_floor_ms"):
        lines += ["", "HTTP floor (the same client against a bare ASGI app under the same uvicorn: what no server code "
                      "of ours can save): " + "; ".join(f"{b} tokens median {v['median_ms']:.2f} ms, p90 "
                                                         f"{v['p90_ms']:.2f} (n {v['n']})"
                                                         for b, v in results["http_floor_ms"].items())]
    if results.get("in_process") and not results["in_process"]["same_workload"]:
        lines += ["", f"The in-process file {results['in_process']['file']} ran another shape or manifest: its "
                      "differences are not HTTP + tokenization alone."]
    lines += native_comparison_lines(results["arms"])
    path.write_text("\n".join(lines) + "\n")


def prepare_e2e(data: Path, manifest: Path, *, limit: int | None, tokenizer: Path | None = None):
    """The requests as text and the tokenizer, loaded before any model is built (a missing one fails first)."""
    return load_requests(data, manifest, limit=limit), load_tokenizer(tokenizer)


def measure_after_bench(model, arms: list[str], prepared, *, bench: dict, out: Path, warmup_requests: int | None,
                        stem: str, seen_items: list[dict] = ()) -> dict:
    """``bench_jevbench.py --e2e``: the same model (its graphs already captured by the in-process arms) served over
    HTTP per arm of ``arms``, compared with the in-process ``bench`` results of this process; writes
    ``e2e_<shape>_<arms>.json`` and ``.md`` under ``out``. ``warmup_requests`` shortens B's warm-up only:
    ``seen_items`` (the manifest items the in-process arm B already ran) count as warmed; a B whose warm-up and
    ``seen_items`` miss a shape of its timed pass is labelled cold (``"cold": true``, no over-in-process figure)."""
    work, tokenizer = prepared
    info = versions()
    results = {"command": command_line(), "versions": info, "device": info["device"],
               "git_commit": git_commit(), "shape": bench["shape"], "seed": bench["seed"], "dtype": bench["dtype"],
               "manifest": bench["manifest"], "manifest_sha256": bench["manifest_sha256"], "data": DATA.name,
               "n": len(work), "tokenizer": f"{type(tokenizer).__name__}, {len(tokenizer)} tokens (Qwen3.5)",
               "warmup_requests": warmup_requests, **request_names(work), "arms": {}}
    attach_tokenizer(model, tokenizer)
    name = f"e2e_{bench['shape']}_{'-'.join(arms)}"
    for arm in arms:
        # C warms up on every request (a text's packs may differ from the random ids' and need their own graphs)
        limit = warmup_requests if arm == "B" else None
        results["arms"][arm] = r = measure_arm(model, arm, work, warmup_requests=limit)
        r["warmup_requests"] = len(work[:limit])
        r["cold"] = not covers_every_shape([*seen_items, *(item for item, _ in work[:limit])], [i for i, _ in work])
        print(f"e2e arm {arm}{warmth_note(r['cold'], r['warmup_requests'], len(work))}: mean {r['mean_ms']:.1f} ms, p50 {r['p50_ms']:.1f}, p95 {r['p95_ms']:.1f}", flush=True)
        add_in_process(results, out / f"{stem}.json", bench=bench)  # after every arm: a cut run keeps the first's
        if "http_floor_ms" not in results:
            add_floor(results, work, answer_bytes=r["answer_bytes"])
        (out / f"{name}.json").write_text(json.dumps(results, indent=1))
        write_markdown(results, out / f"{name}.md")
    return results


def main(argv=None) -> int:
    args, parser = parse_arguments(argv)
    try:
        work = load_requests(args.data, args.manifest, limit=args.limit)
    except ValueError as error:
        parser.error(f"--data / --manifest: {error}")
    tokenizer = load_tokenizer(args.tokenizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"e2e_{args.shape}_{'-'.join(args.arms)}"
    info = versions()
    results = {"command": command_line(), "versions": info, "device": info["device"],
               "git_commit": git_commit(), "shape": args.shape, "seed": args.seed, "dtype": args.dtype,
               **manifest_identity(args.manifest), "data": str(args.data.name), "n": len(work),
               "tokenizer": f"{type(tokenizer).__name__}, {len(tokenizer)} tokens"
                            + (f" ({args.tokenizer.name})" if args.tokenizer else " (Qwen3.5)"),
               **request_names(work), "arms": {}}
    model = build_model(args.shape, seed=args.seed, device=default_device(), dtype=getattr(torch, args.dtype))
    attach_tokenizer(model, tokenizer)
    for arm in args.arms:
        results["arms"][arm] = measure_arm(model, arm, work)
        r = results["arms"][arm]
        print(f"arm {arm}: mean {r['mean_ms']:.1f} ms, p50 {r['p50_ms']:.1f}, p95 {r['p95_ms']:.1f} "
              f"({r['n']} requests over HTTP)", flush=True)
        if "http_floor_ms" not in results:
            add_floor(results, work, answer_bytes=r["answer_bytes"])
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))  # after every arm
    if args.in_process is not None:
        add_in_process(results, args.in_process)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, out / f"{stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
