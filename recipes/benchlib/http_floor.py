"""The HTTP floor: what the client, the loopback and uvicorn cost with no server code of ours at all.

:func:`bare_app` is an ASGI app that reads a request's body, waits on a worker thread (as a forward does, so the
two thread hops stay in) and answers a JSON object of a given size. Served under the same uvicorn and hit by the same
client as the package's app, each request's wall time less that wait is its floor: the server's own time
(``bench_e2e``'s "HTTP minus in process", ``server_time``'s ``server``) less the floor is what the package's own
code could still save (issue 37's 1.0 ms target up to 512 tokens counts both).
"""

from __future__ import annotations

import asyncio
import json
import time


def bare_app(latency_s: float, answer_bytes: int, waits: list[float]):
    """The floor's ASGI app: reads the body, waits ``latency_s`` on a worker thread (the seconds it took go to
    ``waits``, one entry per request), answers a JSON object of ``answer_bytes`` bytes; lifespan accepted."""
    body = json.dumps({"pad": "x" * max(0, answer_bytes - 11)}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    def wait() -> float:
        start = time.perf_counter()
        time.sleep(latency_s)
        return time.perf_counter() - start

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body", False):
            pass
        waits.append(await asyncio.get_running_loop().run_in_executor(None, wait))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def floors_ms(client_ms: list[float], waits: list[float]) -> list[float]:
    """Each timed request's floor (ms): the client's wall time less the bare app's measured wait; ``waits`` holds
    the warm-up's requests first (the timed pass's are its last ``len(client_ms)``)."""
    timed = waits[len(waits) - len(client_ms):] if client_ms else []
    if len(timed) != len(client_ms):
        raise RuntimeError(f"floor: {len(waits)} waits for {len(client_ms)} timed requests")
    return [ms - wait * 1000 for ms, wait in zip(client_ms, timed, strict=True)]
