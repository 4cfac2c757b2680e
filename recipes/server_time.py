"""The server's own time per request, phase by phase, on a CPU, with a stand-in scorer (issue 37, item 1).

    python recipes/server_time.py --out recipes/results/server_time [--latency-ms 5] [--repeats 5]
        [--http auto|h11|httptools] [--loop auto|asyncio|uvloop]
    python recipes/server_time.py --out $OUT/server_time --shape 27b   # on a GPU: the real forward

With ``--shape`` (on CUDA) the model is the bench's random one of that shape in bf16, patched for the fast path with
the default options, and the batcher scores with the real forward (the app's own ``score_prepared``), timed as
``scoring``: the other phases are then the server's own time beside a real forward, on that machine's host (the
GIL shared with the forward's host work, the GPU's synchronizations), what ``bench_e2e``'s per-request "HTTP minus in
process" measures without saying where it goes. The warm-up pass captures the CUDA graphs the requests need.

The package's own server app (``hf_openjev.serve.app.create_app``: middleware, body read, strict JSON, validation,
tokenization, the batcher and its worker thread, the answer, its serialization) runs in this process under uvicorn
on 127.0.0.1, as ``bench_e2e.py`` serves it; only the model's forward is replaced: the batcher's ``score_fn`` is a
stand-in that sleeps ``--latency-ms`` (releasing the GIL, as a forward waiting on its GPU does) and returns scores
of the right shape. The model is the bench's tiny random one set up for the fast path (what ``serve`` runs on a
GPU: the token budget counts shared prefixes once), with the real Qwen3.5 tokenizer and its chat halves
(``bench_e2e.attach_tokenizer``), its tokenizer proofs run before serving as ``serve`` does, and the GPU's slice
size (``DEFAULT_SLICE_TOKENS["cuda"]``) so that a 3,400-token request is one group as it is there. One client in its
own process (``benchlib/http_client.py``: one keep-alive connection, the next request when the answer is parsed)
sends the JevBench requests as text: every one whose longest candidate is at most 512 tokens (the exact manifest's
counts) and the ones of 3,300 to 3,500 tokens; a warm-up pass, then ``--repeats`` timed passes.

Phases (a phase timer the recipe installs by wrapping the server's functions, removed at the end; one request is in
the server at a time, so every stamp belongs to the request in flight):

- ``routing``: from the ASGI call to the body read (the middleware: request id, keys; Starlette's routing);
- ``body read``: ``read_body_in_time`` (Content-Type, the body, Content-Encoding);
- ``json parse``: ``loads_strict``; ``validation``: the rest of ``state.parse`` (``contract.parse_request``);
- ``tokenization``: ``state.tokenize`` less ``tokenizer proofs`` (the cached clean-cut and byte-floor proofs'
  look-ups);
- ``queueing``: from ``Batcher.submit`` to the stand-in's start (admission, the worker's wake-up, the group);
- ``hand-off``: the thread hops between those steps (to and from the preparing pools and the batcher's worker, the
  event loop's wake-ups); of which ``hop: start`` from the body read to the parse (the bounded work's start, a
  pool's wake-up) and ``hop: back`` from the stand-in's end to ``submit``'s return (the worker's hand-back, the
  event loop's wake-up);
- ``scoring``: the stand-in's own time (measured, not its nominal latency);
- ``answer``: ``build_answer``; ``serialization``: the rest of ``state.finish`` (``dumps``);
- ``response``: from the serialized answer to its last byte handed to uvicorn (the response object, the
  middleware's metrics and access log);
- ``in app``: the ASGI call, less scoring; ``server``: the client's wall time less scoring (HTTP, the client's own
  JSON and the loopback included), the figure bench_e2e's "HTTP minus in process" estimates;
- ``HTTP floor``: the same client and requests against a bare ASGI app under the same uvicorn
  (``benchlib.http_floor``), in passes of its own, each after one of the app's (alternated: the machine's drift
  falls on both): it reads the body, waits ``--latency-ms`` on a worker thread (as the stand-in does) and answers
  the real answers' median size; the client's wall time less that wait. What uvicorn, the loopback and the client
  cost with no server work at all: ``server`` less this is what the package's own code could still save.

Writes ``server_time.json`` (with ``--per-request``, every request's phases too) and ``.md`` (median and p90 ms per phase and group), prints the
table. Run it on the commit before a change and after, on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_e2e import DATA, attach_tokenizer, load_requests, load_tokenizer, run_client
from benchlib.groups import longest_tokens
from benchlib.http_floor import bare_app, floors_ms
from benchlib.local_server import serve_in_thread
from benchlib.provenance import command_line, git_commit, versions
from benchlib.random_model import build_model
from benchlib.timing import median_and_p90
from benchlib.workload import MANIFEST

PHASES = ("routing", "body read", "json parse", "validation", "tokenization", "tokenizer proofs", "queueing",
          "hand-off", "hop: start", "hop: back", "scoring", "answer", "serialization", "response", "in app", "server",
          "HTTP floor")
SHORT_MAX = 512  # longest candidate, tokens: the short requests
LONG_RANGE = (3300, 3500)  # the "3,400-token" requests
GROUPS = {"noul 1-128": lambda kind, n: kind == "noul" and n <= 128,
          "choice 1-512": lambda kind, n: kind == "choice" and n <= SHORT_MAX,
          "all <= 512": lambda kind, n: n <= SHORT_MAX,
          "3,300-3,500": lambda kind, n: LONG_RANGE[0] <= n <= LONG_RANGE[1]}


class PhaseTimer:
    """Stamps (``mark``) and summed durations (``add``) of the request in flight, one record per ASGI call."""

    def __init__(self):
        self.records: list[dict] = []
        self.current: dict | None = None
        self.loop = ""  # the event loop's class the server ran on (its module: asyncio or uvloop)

    def open(self) -> None:
        self.current = {"marks": {}, "sums": {}}
        self.records.append(self.current)
        self.mark("asgi_in")

    def mark(self, name: str) -> None:
        if self.current is not None:
            self.current["marks"][name] = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        if self.current is not None:
            self.current["sums"][name] = self.current["sums"].get(name, 0.0) + seconds

    def summing(self, name: str, fn):
        """``fn`` whose every call adds its seconds to ``name``."""
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
        return timed

    def marking(self, name: str, fn, *, is_async: bool = False):
        """``fn`` (a coroutine function where ``is_async``) stamped ``<name>_start`` and ``<name>_end``."""
        if is_async:
            async def timed_async(*args, **kwargs):
                self.mark(f"{name}_start")
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self.mark(f"{name}_end")
            return timed_async

        def timed(*args, **kwargs):
            self.mark(f"{name}_start")
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(f"{name}_end")
        return timed

    def wrap_asgi(self, app):
        """``app`` whose every HTTP call opens a record, stamped ``asgi_out`` at its last body message."""
        async def timed_app(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            self.open()
            self.loop = self.loop or type(asyncio.get_running_loop()).__module__.split(".")[0]

            async def timed_send(message):
                if message["type"] == "http.response.body":
                    self.current["bytes_out"] = self.current.get("bytes_out", 0) + len(message.get("body", b""))
                    if not message.get("more_body", False):
                        self.mark("asgi_out")
                await send(message)

            await app(scope, receive, timed_send)
        return timed_app


@contextlib.contextmanager
def installed(timer: PhaseTimer):
    """The phase timer's wrappers around the server's steps (restored on exit)."""
    from hf_openjev import contract, scoring
    from hf_openjev.serve import app as app_module
    from hf_openjev.serve.batcher import Batcher

    state = app_module._ServerState
    targets = [(app_module, "read_body_in_time", timer.marking("body", app_module.read_body_in_time, is_async=True)),
               (app_module, "loads_strict", timer.summing("json", app_module.loads_strict)),
               (contract, "parse_request", timer.summing("validate", contract.parse_request)),
               (scoring, "_clean_cut_for", timer.summing("proofs", scoring._clean_cut_for)),
               (scoring, "_token_floor_for", timer.summing("proofs", scoring._token_floor_for)),
               (scoring, "build_answer", timer.summing("answer", scoring.build_answer)),
               (state, "parse", timer.marking("parse", state.parse)),
               (state, "tokenize", timer.marking("tokenize", state.tokenize)),
               (state, "finish", timer.marking("finish", state.finish)),
               (Batcher, "submit", timer.marking("submit", Batcher.submit, is_async=True))]
    saved = [(owner, name, vars(owner)[name] if isinstance(owner, type) else getattr(owner, name))
             for owner, name, _ in targets]
    for owner, name, wrapper in targets:
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def stand_in_scorer(timer: PhaseTimer, latency_s: float):
    """The batcher's ``score_fn``: sleeps ``latency_s`` and returns 0.0 for every candidate (stamped ``score``)."""
    from hf_openjev.scoring import ScoreResult

    def score(model, prepared, *, fast=None):
        timer.mark("score_start")
        start = time.perf_counter()
        time.sleep(latency_s)
        scores = [[[0.0] * len(question) for question in p.tokens] for p in prepared]
        caches = [{"enabled": True, "mode": "stand-in", "shared_tokens": 0} for _ in prepared]
        result = ScoreResult(scores, time.perf_counter() - start, "fast", caches)
        timer.mark("score_end")
        return result

    return score


def alternate_passes(requests: list[dict], repeats: int, *, timer: PhaseTimer, port: int, latency_s: float,
                     http: str, loop: str) -> tuple[list[dict], list[float], list[float]]:
    """``repeats`` timed passes over ``requests`` against the package's app on ``port``, each followed by one against
    :func:`~benchlib.http_floor.bare_app` (served once the first pass has said how big an answer is), so that the
    machine's drift falls on both. The first pass of each app is preceded by a warm-up over every request, later
    ones by one request (the client's new connection). Returns the app's timer records and client ms, and the HTTP
    floor's ms (the client's wall less the bare app's measured wait), each in pass and request order."""
    records, app_ms, floor_ms, waits = [], [], [], []
    floor = None
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for index in range(repeats):
                warm = len(requests) if index == 0 else 1
                before = len(timer.records)
                client = run_client(port, requests, Path(scratch), warmup_requests=warm)
                records += timer.records[before + warm:]
                app_ms += client["passes"]["timed"]["ms"]
                if floor is None:
                    answer_bytes = int(statistics.median(record.get("bytes_out", 0) for record in records))
                    floor = serve(bare_app(latency_s, answer_bytes, waits), http=http, loop=loop)
                client = run_client(floor[2], requests, Path(scratch), warmup_requests=warm)
                floor_ms += floors_ms(client["passes"]["timed"]["ms"], waits)
    finally:
        if floor is not None:
            floor[0].should_exit = True
            floor[1].join(60)
    if not len(records) == len(app_ms) == len(floor_ms):
        raise RuntimeError(f"{len(records)} server records and {len(floor_ms)} floors for {len(app_ms)} timed requests")
    return records, app_ms, floor_ms


def phases_of(record: dict, client_ms: float) -> dict[str, float]:
    """ms per phase of one request's record (see the module docstring) and the client's wall ``client_ms``."""
    m, s = record["marks"], record["sums"]

    def span(a: str, b: str) -> float:
        return m[b] - m[a]

    scoring = span("score_start", "score_end")
    in_app = span("asgi_in", "asgi_out")
    hops = (span("body_end", "parse_start") + span("parse_end", "tokenize_start") + span("tokenize_end", "submit_start")
            + span("score_end", "submit_end") + span("submit_end", "finish_start"))
    seconds = {"routing": span("asgi_in", "body_start"), "body read": span("body_start", "body_end"),
               "json parse": s.get("json", 0.0), "validation": span("parse_start", "parse_end") - s.get("json", 0.0),
               "tokenization": span("tokenize_start", "tokenize_end") - s.get("proofs", 0.0),
               "tokenizer proofs": s.get("proofs", 0.0), "queueing": span("submit_start", "score_start"),
               "hand-off": hops, "hop: start": span("body_end", "parse_start"),
               "hop: back": span("score_end", "submit_end"), "scoring": scoring, "answer": s.get("answer", 0.0),
               "serialization": span("finish_start", "finish_end") - s.get("answer", 0.0),
               "response": span("finish_end", "asgi_out"), "in app": in_app - scoring}
    out = {name: value * 1000 for name, value in seconds.items()}
    out["server"] = client_ms - scoring * 1000
    return out


def server_stack(http: str, loop: str) -> str:
    """uvicorn's HTTP protocol for ``--http`` (``"auto"``: httptools when installed, as uvicorn picks it) and the
    event loop ``loop`` the server ran on."""
    from hf_openjev.serve.header_timeout import pick_http_protocol

    return f"{pick_http_protocol(http).__name__}, {loop}"


def serve(app, http: str = "auto", loop: str = "auto"):
    """uvicorn serving ``app`` on 127.0.0.1 in a thread (as ``bench_e2e.serve_arm``) with the HTTP protocol
    ``http`` and the event loop ``loop`` (uvicorn's names), and its port."""
    return serve_in_thread(app, name="server-time", http=http, loop=loop)


def real_scorer(timer: PhaseTimer, options):
    """The batcher's ``score_fn`` the app uses by default (``score_prepared`` with ``options``), stamped like the
    stand-in: its scores are Python floats, so the GPU's work is done at ``score_end``."""
    from hf_openjev.scoring import score_prepared

    def score(model, prepared, *, fast=None):
        timer.mark("score_start")
        result = score_prepared(model, prepared, fast=fast, options=options)
        timer.mark("score_end")
        return result

    return score


def build_app(timer: PhaseTimer, tokenizer, latency_s: float, shape: str | None = None):
    """The package's app with ``tokenizer``, the fast path's set-up and the GPU's slice size: over the tiny random
    model with the stand-in forward, or (``shape``) over that shape's random model on CUDA with the real one."""
    from hf_openjev.family import member_sized
    from hf_openjev.fast_options import options_for
    from hf_openjev.scoring import prove_tokenizer_shortcuts
    from hf_openjev.serve.app import create_app
    from hf_openjev.serve.limits import RequestLimits
    from hf_openjev.serve.slices import DEFAULT_SLICE_TOKENS

    options = options_for(member_sized(shape) if shape else None)  # the shape's defaults (a member's own)
    if shape is None:
        model, score_fn = build_model("tiny", seed=0, device="cpu", dtype=torch.float32), None
    else:
        from hf_openjev.patches import apply_patches

        model = build_model(shape, seed=0, device="cuda", dtype=torch.bfloat16)
        apply_patches(model, options)
        score_fn = real_scorer(timer, options)
    attach_tokenizer(model, tokenizer)
    prove_tokenizer_shortcuts(model)  # as serve does before it listens
    app = create_app(model, fast=True, options=options, score_fn=score_fn or stand_in_scorer(timer, latency_s),
                     limits=RequestLimits(slice_tokens=DEFAULT_SLICE_TOKENS["cuda"]))
    return timer.wrap_asgi(app)


def select(work: list[tuple[dict, dict]], limit: int | None) -> list[tuple[dict, dict]]:
    """The requests of some group (short or 3,400 tokens), the first ``limit`` short ones and every long one."""
    longest = [(item, request, longest_tokens(item)) for item, request in work]
    short = [(item, request) for item, request, n in longest if n <= SHORT_MAX][:limit]
    long = [(item, request) for item, request, n in longest if LONG_RANGE[0] <= n <= LONG_RANGE[1]]
    return short + long


def summarize_groups(rows: list[tuple[dict, dict[str, float]]]) -> dict:
    """group -> phase -> {median_ms, p90_ms}, and each group's n."""
    out = {}
    for group, member in GROUPS.items():
        picked = [ms for item, ms in rows if member(item["kind"], longest_tokens(item))]
        if not picked:
            continue
        out[group] = {"n": len(picked)}
        for phase in PHASES:
            out[group][phase] = median_and_p90([ms[phase] for ms in picked])
    return out


def table_lines(groups: dict) -> list[str]:
    names = list(groups)
    lines = ["| phase | " + " | ".join(f"{g} (n {groups[g]['n']}) p50 / p90" for g in names) + " |",
             "|---|" + "---|" * len(names)]
    for phase in PHASES:
        lines.append(f"| {phase} | " + " | ".join(f"{groups[g][phase]['median_ms']:.3f} / "
                                                   f"{groups[g][phase]['p90_ms']:.3f}" for g in names) + " |")
    return lines


def write_markdown(result: dict, path: Path) -> str:
    scorer = f"the {result['shape']} model's forward" if result.get("shape") else \
        f"stand-in scorer of {result['latency_ms']:g} ms"
    lines = [f"# The server's own time per request, by phase (ms; {scorer}, {result['repeats']} timed passes)", "",
             f"Command: `{result['command']}`", "",
             f"Commit: {result['git_commit']}", "", f"Device: {result['device']}; uvicorn: {result['http']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
             *table_lines(result["groups"]), "",
             "`in app`: the ASGI call less scoring; `server`: the client's wall time less scoring (what bench_e2e's "
             "HTTP minus in process measures); `HTTP floor`: the same client against a bare ASGI app that only reads "
             "the body, waits and answers as many bytes (what no server code of ours can save). Phases per "
             "recipes/server_time.py's docstring."]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--latency-ms", type=float, default=5.0, help="the stand-in forward's latency")
    parser.add_argument("--shape", choices=("2b", "9b", "27b"), default=None,
                        help="on CUDA: that shape's random model and the real forward instead of the stand-in")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over the requests")
    parser.add_argument("--limit", type=int, default=None, help="the first N short requests only (smoke runs)")
    parser.add_argument("--data", type=Path, default=DATA, help="the JevBench tasks' folder (bench_e2e's --data)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a Hugging Face tokenizer folder instead of the real Qwen3.5 tokenizer (smoke runs)")
    parser.add_argument("--per-request", action="store_true", help="every request's phases in the json too")
    parser.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto",
                        help="uvicorn's HTTP protocol (auto: httptools when installed, as serve picks it)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="uvicorn's event loop (auto: uvloop when installed)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.latency_ms < 0 or (args.limit is not None and args.limit < 1):
        parser.error("--repeats and --limit must be at least 1, --latency-ms at least 0")
    if args.shape is not None and not torch.cuda.is_available():
        parser.error(f"--shape {args.shape}: the real forward needs a CUDA GPU (without --shape: the stand-in)")
    return args


def main(argv=None) -> int:
    args = parse_arguments(argv)
    work = select(load_requests(args.data, MANIFEST, limit=None), args.limit)
    timer = PhaseTimer()
    server, thread, port = serve(build_app(timer, load_tokenizer(args.tokenizer), args.latency_ms / 1000, args.shape),
                                 http=args.http, loop=args.loop)
    requests = [request for _, request in work]
    try:
        with installed(timer):
            timed, client_ms, floor_ms = alternate_passes(requests, args.repeats, timer=timer, port=port,
                                                          latency_s=args.latency_ms / 1000, http=args.http,
                                                          loop=args.loop)
    finally:
        server.should_exit = True
        thread.join(60)
    rows = [(item, {**phases_of(record, ms), "HTTP floor": floor})
            for (item, _), record, ms, floor in zip(work * args.repeats, timed, client_ms, floor_ms, strict=True)]
    script_argv = None if argv is None else ["recipes/server_time.py", *argv]
    result = {"command": command_line(script_argv), "git_commit": git_commit(), "versions": versions(),
              "device": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "latency_ms": None if args.shape else args.latency_ms, "shape": args.shape, "repeats": args.repeats,
              "n": len(work),
              "http": server_stack(args.http, timer.loop), "groups": summarize_groups(rows)}
    if args.per_request:
        result["requests"] = [{"id": item["id"], **{k: round(v, 4) for k, v in ms.items()}} for item, ms in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_time.json").write_text(json.dumps(result, indent=1))
    print("\n".join(table_lines(result["groups"])), flush=True)
    write_markdown(result, out / "server_time.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
