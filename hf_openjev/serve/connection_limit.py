"""A cap on the connections the server keeps open at once; the connections past it are answered 503 and closed.

Every open connection costs a file descriptor and, while its client does not read, the answer it was sent
(:mod:`~hf_openjev.serve.write_timeout`). :func:`with_connection_limit` subclasses uvicorn's HTTP protocol (as the
header timeout does): a connection that opens while ``limit`` others are open is marked in its requests' scope
(:data:`OVER_CONNECTION_LIMIT`), and :class:`~hf_openjev.serve.middleware.OpsMiddleware` answers each such request with a
JSON 503 ``server is busy`` (``Retry-After``, ``Connection: close``: counted and logged like any request), after
which uvicorn closes it. The connections already open are served as before; idle kept-alive ones count until
uvicorn's keep-alive timeout (or the header timeout) closes them.

uvicorn's own ``--limit-concurrency`` counts requests in progress too and refuses every connection's requests
with a plain-text 503 while the count is reached; this cap counts connections only and refuses the new ones.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_CONNECTIONS", "OVER_CONNECTION_LIMIT", "with_connection_limit"]

DEFAULT_MAX_CONNECTIONS = 512
OVER_CONNECTION_LIMIT = "hf_openjev.over_connection_limit"  # scope key: the cap this connection found reached


def with_connection_limit(base, limit: int):
    """``base`` (a uvicorn HTTP protocol class) whose connections opened while ``limit`` others are open get their
    requests' scope marked ``{OVER_CONNECTION_LIMIT: limit}`` (module doc)."""

    class ConnectionLimitProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)  # uvicorn adds this connection to server_state.connections
            if len(self.server_state.connections) > limit:
                self.app = _marking(self.app, limit)

    ConnectionLimitProtocol.__name__ = f"ConnectionLimit{base.__name__}"
    return ConnectionLimitProtocol


def _marking(app, limit: int):
    """``app`` with every HTTP scope marked over the limit."""

    async def marked(scope, receive, send):
        if scope["type"] == "http":
            scope[OVER_CONNECTION_LIMIT] = limit
        await app(scope, receive, send)

    return marked
