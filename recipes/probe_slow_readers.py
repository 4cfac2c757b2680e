"""Clients that post a valid request and never read its big answer (issue 36, item 7), against a local server.

    python recipes/probe_slow_readers.py --out recipes/results/slow_readers_cpu [--model EXPORT] [--readers 200]
        [--answer-bytes 3000000] [--write-timeout 30] [--seconds 90]

Starts ``hf-openjev serve --device cpu`` on 127.0.0.1 (on ``--model``, else on the tiny checkpoint ``hf-openjev
demo`` builds) with ``--write-timeout``, opens ``--readers`` connections with a small receive buffer, each posting
one valid request whose answer is ``--answer-bytes`` long (one question whose id is that long: the answer echoes
it), and never reads. Every 0.5 s, for at most ``--seconds``, it samples how many of them the server has closed (as
the client sees it, without reading: a reset or an end of stream), the server's resident memory (VmRSS) and the
kernel's TCP buffer memory (``/proc/net/sockstat``: the unsent answers the kernel holds). It stops once every
reader is closed or the time is up, closes the rest, and checks that the server still answers a small request.
Writes ``slow_readers.json`` and ``.md``. Linux (``/proc``), loopback only; the readers and the time are bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib.local_server import free_port, wait_healthy
from benchlib.provenance import command_line, git_commit, versions

MAX_READERS = 1000
MAX_SECONDS = 600
MAX_ANSWER_BYTES = 4 * 1024 * 1024 - 200  # the body carries the answer's id: under the default --max-body-bytes
RECEIVE_BUFFER = 4096  # the readers' SO_RCVBUF: the server's sends stall at once
PERIOD_S = 0.5
SMALL_REQUEST = {"state": "I was charged twice.",
                 "questions": {"refund": {"type": "noul", "instructions": "Does the customer want a refund?"}}}
_CLOSED = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


def slow_reader_request(answer_bytes: int) -> bytes:
    """A raw HTTP/1.1 request whose answer is over ``answer_bytes`` long: one noul question, its id that long."""
    body = json.dumps({"state": "s", "questions": {"q" * answer_bytes: {"type": "noul", "instructions": "?"}}})
    head = (f"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body.encode()


def open_readers(host: str, port: int, count: int, request: bytes, *,
                 receive_buffer: int = RECEIVE_BUFFER) -> list[socket.socket]:
    """``count`` connections to ``host:port``, each with ``request`` sent and nothing ever read."""
    readers = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.settimeout(60)
        sock.connect((host, port))
        sock.sendall(request)
        readers.append(sock)
    return readers


class ClosedWatch:
    """Which of ``readers`` the server has closed (a reset or an end of stream), seen without reading."""

    def __init__(self, readers: list[socket.socket]):
        self._poll = select.poll()
        self._by_fd = {sock.fileno(): sock for sock in readers}
        for fd in self._by_fd:
            self._poll.register(fd, _CLOSED)
        self.started = time.monotonic()
        self.closed_after: list[float] = []  # seconds from the start of the watch to each closing

    @property
    def still_open(self) -> int:
        return len(self._by_fd)

    def check(self) -> int:
        """Record the readers closed since the last check; how many are still open."""
        for fd, events in self._poll.poll(0):
            if events & _CLOSED and fd in self._by_fd:
                self._poll.unregister(fd)
                del self._by_fd[fd]
                self.closed_after.append(time.monotonic() - self.started)
        return len(self._by_fd)


def resident_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024


def kernel_tcp_bytes() -> int:
    """The kernel's TCP buffer memory (all sockets of the machine), in bytes."""
    text = Path("/proc/net/sockstat").read_text()
    return int(re.search(r"^TCP:.* mem (\d+)", text, re.M).group(1)) * os.sysconf("SC_PAGE_SIZE")


def watch(readers: list[socket.socket], pid: int, *, seconds: float, period: float = PERIOD_S) -> tuple[list, list]:
    """Sample every ``period`` for at most ``seconds``, until every reader is closed: ``(samples, closed_after)``;
    a sample is ``{"s", "open", "rss_mib", "kernel_tcp_mib"}``."""
    closed = ClosedWatch(readers)
    samples = []
    for _ in range(int(seconds / period) + 1):
        still_open = closed.check()
        samples.append({"s": round(time.monotonic() - closed.started, 1), "open": still_open,
                        "rss_mib": round(resident_bytes(pid) / 2**20, 1),
                        "kernel_tcp_mib": round(kernel_tcp_bytes() / 2**20, 1)})
        if not still_open:
            break
        time.sleep(period)
    return samples, closed.closed_after


def summarize(samples: list[dict], closed_after: list[float], *, readers: int, baseline_rss_mib: float) -> dict:
    """The figures of one run: how many readers were closed and when, and the memory before, at its peak, at the end."""
    ordered = sorted(closed_after)
    return {"readers": readers, "closed": len(ordered),
            "closed_p50_s": round(statistics.median(ordered), 1) if ordered else None,
            "closed_max_s": round(ordered[-1], 1) if ordered else None,
            "watched_s": samples[-1]["s"],
            "rss_mib": {"before": baseline_rss_mib, "peak": max(s["rss_mib"] for s in samples),
                        "end": samples[-1]["rss_mib"]},
            "kernel_tcp_mib": {"peak": max(s["kernel_tcp_mib"] for s in samples),
                               "end": samples[-1]["kernel_tcp_mib"]}}


def _answered_200(http) -> int:
    """The server's count of 200 answers to decision requests (its /metrics)."""
    text = http.get("/metrics").text
    found = re.search(r'^hf_openjev_requests_total\{route="/v1/systemone",status="200"\} ([0-9.e+]+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def probe(*, model: Path, readers: int, answer_bytes: int, write_timeout: float, seconds: float) -> dict:
    """One run: the server started, warmed, the readers opened and watched, the server checked, then stopped."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "hf_openjev.cli", "serve", "--model", str(model),
                               "--device", "cpu", "--dtype", "float32", "--port", str(port), "--log-level", "warning",
                               "--write-timeout", f"{write_timeout:g}"])
    sockets = []
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            wait_healthy(url, server, timeout=300)
            request = slow_reader_request(answer_bytes)
            big_body = request.partition(b"\r\n\r\n")[2]
            for _ in range(2):  # warm: one small answer and one big one, read in full
                http.post("/v1/systemone", json=SMALL_REQUEST)
                http.post("/v1/systemone", content=big_body, headers={"Content-Type": "application/json"})
            baseline = round(resident_bytes(server.pid) / 2**20, 1)
            before = _answered_200(http)
            sockets = open_readers("127.0.0.1", port, readers, request)
            samples, closed_after = watch(sockets, server.pid, seconds=seconds)
            for sock in sockets:
                sock.close()
            answered = _answered_200(http) - before
            small = http.post("/v1/systemone", json=SMALL_REQUEST).status_code
    finally:
        for sock in sockets:
            sock.close()
        server.terminate()
        server.wait(120)
    result = summarize(samples, closed_after, readers=readers, baseline_rss_mib=baseline)
    result.update(answer_bytes=answer_bytes, write_timeout_s=write_timeout, readers_answered_200=answered,
                  small_request_after=small, samples=samples)
    return result


def write_results(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "slow_readers.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    rss, tcp = result["rss_mib"], result["kernel_tcp_mib"]
    closing = ("" if not result["closed"] else
               f", after {result['closed_p50_s']} s (median) and {result['closed_max_s']} s (last)")
    text = "\n".join([
        f"# {result['readers']} clients that never read their {result['answer_bytes']:,}-byte answer (CPU)",
        "",
        f"`{result['command']}` at {result['commit']}, {result['cpus']} CPUs; `--write-timeout "
        f"{result['write_timeout_s']:g}`.",
        "",
        f"- closed by the server: {result['closed']} of {result['readers']} within {result['watched_s']} s"
        f"{closing}; the server had answered {result['readers_answered_200']} of them 200;",
        f"- the server's resident memory: {rss['before']} MiB before, {rss['peak']} MiB at the peak, {rss['end']} MiB "
        "at the end;",
        f"- the kernel's TCP buffers (the whole machine): {tcp['peak']} MiB at the peak, {tcp['end']} MiB at the end;",
        f"- a small request afterwards: {result['small_request_after']}.",
        "",
        f"Versions: {json.dumps(result['versions'])}",
        "",
    ])
    (out / "slow_readers.md").write_text(text, encoding="utf-8")


def _check(parser, args) -> None:
    if not 1 <= args.readers <= MAX_READERS:
        parser.error(f"--readers must be 1..{MAX_READERS}")
    if not 1 <= args.answer_bytes <= MAX_ANSWER_BYTES:
        parser.error(f"--answer-bytes must be 1..{MAX_ANSWER_BYTES} (the request carries the answer's id)")
    if not 0 < args.seconds <= MAX_SECONDS:
        parser.error(f"--seconds must be in (0, {MAX_SECONDS}]")
    if not args.write_timeout > 0:
        parser.error("--write-timeout must be a positive number of seconds")
    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model}: no such export directory")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for slow_readers.json and .md")
    parser.add_argument("--model", type=Path, default=None,
                        help="a merged export (default: build the tiny checkpoint hf-openjev demo builds)")
    parser.add_argument("--readers", type=int, default=200, help=f"connections that never read (default 200, at "
                                                                 f"most {MAX_READERS})")
    parser.add_argument("--answer-bytes", type=int, default=3_000_000, help="each answer's size (default 3000000)")
    parser.add_argument("--write-timeout", type=float, default=30.0, help="the server's --write-timeout (default 30)")
    parser.add_argument("--seconds", type=float, default=90.0,
                        help=f"longest watch of the readers (default 90, at most {MAX_SECONDS})")
    args = parser.parse_args(argv)
    _check(parser, args)
    with tempfile.TemporaryDirectory() as work:
        model = args.model
        if model is None:
            from hf_openjev.export.tiny import build_tiny_checkpoint

            model = build_tiny_checkpoint(Path(work) / "tiny").export
        result = probe(model=model, readers=args.readers, answer_bytes=args.answer_bytes,
                       write_timeout=args.write_timeout, seconds=args.seconds)
    result.update(command=command_line(argv), commit=git_commit(), cpus=os.cpu_count(), versions=versions())
    write_results(result, args.out)
    print((args.out / "slow_readers.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
