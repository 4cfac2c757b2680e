"""Strict JSON for request bodies (docs/contract.md §1, §2 item 2)."""

from __future__ import annotations

import json

import pytest

from hf_openjev.errors import RequestError
from hf_openjev.serve.strict_json import MAX_DEPTH, dumps, loads_strict

PREFIX = "request body is not valid JSON: "


def rejected(body) -> str:
    with pytest.raises(RequestError) as info:
        loads_strict(body)
    assert info.value.status == 422
    assert info.value.message.startswith(PREFIX)
    return info.value.message[len(PREFIX):]


def test_accepts_plain_json_and_keeps_key_order():
    value = loads_strict(b'{"b": 1, "a": [1.5, "\\u00e9", {"z": null, "y": true}], "c": "\xf0\x9f\x99\x82"}')
    assert list(value) == ["b", "a", "c"]
    assert value["a"][2] == {"z": None, "y": True}
    assert list(value["a"][2]) == ["z", "y"]
    assert value["c"] == "\U0001F642"
    assert loads_strict('{"x": 1e300}') == {"x": 1e300}
    assert loads_strict(b"[1, 2]") == [1, 2]  # the top-level type is the contract's next check


def test_valid_surrogate_pair_escape_is_accepted():
    assert loads_strict(b'{"s": "\\ud83d\\ude42"}') == {"s": "\U0001F642"}


@pytest.mark.parametrize("body, needle", [
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'{"q": {"x": {"k": 1, "k": 1}}}', "duplicate key 'k'"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": Infinity}', "Infinity"),
    (b'{"a": -Infinity}', "-Infinity"),
    (b'{"a": 1e400}', "out of range"),
    (b'{"a": -1e999}', "out of range"),
    (b'{"a": "\xff"}', "invalid UTF-8"),
    (b'\xef\xbb\xbf{"a": 1}', "BOM"),
    (b'{"a": "\\ud800"}', "surrogate"),
    (b'{"\\udfff": 1}', "surrogate"),
    (b'{"a": 1', "line 1"),
    (b"", "Expecting value"),
    (b"{'a': 1}", "property name"),
    (b'{"a": 1} {"b": 2}', "Extra data"),
    (b'{"a": ' + b"9" * 5000 + b"}", "digit"),
])
def test_rejects(body, needle):
    assert needle.lower() in rejected(body).lower()


def test_utf16_body_is_not_guessed():
    assert "invalid UTF-8" in rejected('{"a": 1}'.encode("utf-16"))


def test_nesting_limit():
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads_strict(ok.encode())
    assert "nesting" in rejected(("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)).encode())
    assert "nesting" in rejected(("[" * 100_000 + "]" * 100_000).encode())  # beyond the recursion limit
    deep_object = '{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1)
    assert "nesting" in rejected(deep_object.encode())


def test_dumps_is_strict_utf8_and_round_trips_floats():
    value = {"p": 0.1 + 0.2, "s": "é🙂"}
    data = dumps(value)
    assert "é🙂".encode() in data
    assert json.loads(data) == value
    with pytest.raises(ValueError):
        dumps({"x": float("nan")})
