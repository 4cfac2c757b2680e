"""The end-to-end benchmark's client: one persistent HTTP/1.1 connection, one request at a time, in its own process.

    python recipes/benchlib/http_client.py PLAN.json RESULT.json

``PLAN.json``: ``{"host", "port", "path", "passes": ["warm-up", "timed"], "requests": [request dicts]}``, and
optionally ``"warmup_requests": N`` (the warm-up pass sends the first N requests only). For each
pass, every request in order: the clock starts before the dict is serialized and stops once the answer's JSON is
parsed (serialization, HTTP, the server's tokenization and model, response parsing); the next request goes out
only then, on the same keep-alive connection. ``RESULT.json``: ``{"passes": {name: {"ms": [...]}}, "answers":
[the last pass's parsed answers]}``. A non-200 answer stops the run with its status and body (exit code 1).
Standard library only, so the process starts fast and shares nothing with the server's.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path


def post_all(connection: http.client.HTTPConnection, path: str, requests: list[dict]) -> tuple[list[float], list]:
    """ms per request and the parsed answers, each request sent when the previous answer is parsed."""
    times, answers = [], []
    for request in requests:
        start = time.perf_counter()
        body = json.dumps(request).encode()
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {payload[:500].decode(errors='replace')}")
        answers.append(json.loads(payload))
        times.append((time.perf_counter() - start) * 1000)
    return times, answers


def run_plan(plan: dict) -> dict:
    """Every pass of ``plan`` over one connection; the result file's content."""
    connection = http.client.HTTPConnection(plan["host"], plan["port"], timeout=600)
    result = {"passes": {}}
    try:
        for name in plan["passes"]:
            requests = plan["requests"]
            if name == "warm-up" and plan.get("warmup_requests") is not None:
                requests = requests[: plan["warmup_requests"]]  # a shorter warm-up (the server already warm)
            times, answers = post_all(connection, plan["path"], requests)
            result["passes"][name] = {"ms": times}
        result["answers"] = answers
    finally:
        connection.close()
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: http_client.py PLAN.json RESULT.json", file=sys.stderr)
        return 2
    plan = json.loads(Path(argv[0]).read_text())
    try:
        result = run_plan(plan)
    except (RuntimeError, OSError, http.client.HTTPException) as error:
        print(f"e2e client: {error}", file=sys.stderr)
        return 1
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
