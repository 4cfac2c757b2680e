"""Strict JSON for request bodies (docs/contract.md §1 "Strict JSON", §2 item 2).

``loads_strict(body)`` accepts exactly what a strict JSON parser would and raises
:class:`~hf_openjev.errors.RequestError` (status 422, ``request body is not valid JSON: <detail>``) for:

* bytes that are not valid UTF-8 (the body is decoded as UTF-8 only; no UTF-16/32 guessing, no BOM);
* syntax errors;
* duplicate keys in any object (``{"a": 1, "a": 2}``);
* ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON), and numbers that overflow a float to infinity (``1e400``);
* integers beyond Python's digit limit;
* strings holding lone UTF-16 surrogates (``"\\ud800"``): they cannot be encoded as UTF-8, so they are not text;
* nesting deeper than :data:`MAX_DEPTH` levels (also keeps the parser and the prompt renderer off the recursion limit).

A decoded top level that is not an object is *not* rejected here: that is docs/contract.md §2's next check
(``request body must be a JSON object``), done by :func:`hf_openjev.contract.parse_request`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import RequestError

__all__ = ["MAX_DEPTH", "MSG_INVALID_JSON", "dumps", "loads_strict"]

MSG_INVALID_JSON = "request body is not valid JSON"
MAX_DEPTH = 256


class _Reject(ValueError):
    """Raised from inside the parser hooks; becomes a RequestError."""


def _invalid(detail: str) -> RequestError:
    return RequestError(f"{MSG_INVALID_JSON}: {detail}", status=422)


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict:
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise _Reject(f"duplicate key {key!r}")
        result[key] = value
    return result


def _constant(name: str):
    raise _Reject(f"{name} is not a JSON value")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Reject(f"number {text[:40]!r} is out of range")
    return value


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():  # O(1) for CPython's compact strings: a 4 MiB ASCII state is not re-encoded
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_tree(value: Any) -> None:
    """Depth and lone-surrogate checks without recursion (the tree may be deep)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_DEPTH:
                raise _invalid(f"nesting is deeper than {MAX_DEPTH} levels")
            for key, child in node.items():
                if _has_lone_surrogate(key):
                    raise _invalid("a key contains an unpaired UTF-16 surrogate")
                if isinstance(child, (dict, list, str)):
                    stack.append((child, depth + 1))
        elif isinstance(node, list):
            if depth > MAX_DEPTH:
                raise _invalid(f"nesting is deeper than {MAX_DEPTH} levels")
            for child in node:
                if isinstance(child, (dict, list, str)):
                    stack.append((child, depth + 1))
        elif isinstance(node, str) and _has_lone_surrogate(node):
            raise _invalid("a string contains an unpaired UTF-16 surrogate")


def loads_strict(body: bytes | bytearray | memoryview | str) -> Any:
    """Decode a request body as strict JSON; raises ``RequestError`` (422) on anything that is not."""
    if isinstance(body, str):
        text = body
    else:
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _invalid(f"invalid UTF-8 at byte {exc.start}") from None
    try:
        value = json.loads(text, object_pairs_hook=_object_pairs, parse_constant=_constant, parse_float=_float)
    except _Reject as exc:
        raise _invalid(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise _invalid(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _invalid(f"nesting is deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # e.g. an integer beyond the int digit limit
        raise _invalid(str(exc).split("\n")[0][:200]) from None
    _check_tree(value)
    return value


def dumps(value: Any) -> bytes:
    """Response JSON: UTF-8, no NaN/Infinity (a non-finite number raises ``ValueError``), floats round-tripping."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
