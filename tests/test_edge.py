"""The HTTP edge (hf_openjev.serve.edge): the one request-id rule and the one bounded body drain, which the
middleware and the routes share."""

from __future__ import annotations

import asyncio

from hf_openjev.serve.edge import drain_body, sane_request_id


def test_a_sane_request_id_is_kept_and_anything_else_replaced():
    assert sane_request_id("abc-1.2:x_Y") == "abc-1.2:x_Y"
    assert sane_request_id(b"abc-1.2:x_Y") == "abc-1.2:x_Y"  # raw header bytes, as the middleware reads them
    for bad in (None, "", "has space", "x" * 129, "é", b"\xc3\xa9", b"a\nb"):
        fresh = sane_request_id(bad)
        assert len(fresh) == 32 and int(fresh, 16) >= 0
    assert sane_request_id(None) != sane_request_id(None)


async def _chunks(sizes, read, *, then=None):
    for size in sizes:
        read.append(size)
        yield b"x" * size
    if then is not None:
        raise then


def test_the_drain_stops_past_its_byte_bound():
    read = []
    asyncio.run(drain_body(_chunks([10] * 10, read), seen=5, limit_bytes=30, seconds=5.0))
    assert read == [10, 10, 10]  # 5 seen before + 30 read > 30: the fourth chunk is never asked for


def test_the_drain_ends_quietly_when_the_client_leaves_or_is_too_slow():
    from starlette.requests import ClientDisconnect

    read = []
    asyncio.run(drain_body(_chunks([1], read, then=ClientDisconnect()), seen=0, limit_bytes=100, seconds=5.0))
    assert read == [1]

    async def stalled():
        yield b"x"
        await asyncio.Event().wait()  # never sends the rest
        yield b"never"

    asyncio.run(asyncio.wait_for(drain_body(stalled(), seen=0, limit_bytes=100, seconds=0.05), 10))
