"""A lower bound of a text's token count from its bytes alone, for texts without clean cuts.

:mod:`hf_openjev.tokenizer.prefix_cuts` settles an over-long verdict from a prefix ending at a space; a 4 MiB state of
digits, CJK or any run without spaces has no such cut and would be tokenized in full (seconds). This module bounds
the count without tokenizing: with a byte-level BPE tokenizer every token stands for a contiguous run of the
(normalized) text's bytes and the tokens cover all of them. Split the bytes into classes (ASCII digits, ASCII
letters, ASCII whitespace, other ASCII, non-ASCII bytes); if no single token of the vocabulary (nor any added token)
holds more than ``m[k]`` bytes of class ``k``, then a text with ``n[k]`` such bytes has at least ``ceil(n[k] /
m[k])`` tokens, whichever way it is tokenized. The floor is the largest of these, computed at C speed
(``bytes.translate``): a text of 4 MiB of digits is bounded in milliseconds.

Conditions (:func:`prove_token_floor` checks them, else None): a fast tokenizer whose model has a vocabulary, a
byte-level step (so vocabulary strings are bytes in GPT-2's byte-to-character map) with every one of the 256 bytes
in the vocabulary (a missing byte would be dropped, not covered), and a normalizer that is none or NFC (applied here
before counting).
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Callable

__all__ = ["BYTE_CLASSES", "count_byte_classes", "make_token_floor", "token_floor_maxima"]


_DIGITS = bytes(range(0x30, 0x3A))
_LETTERS = bytes(range(0x41, 0x5B)) + bytes(range(0x61, 0x7B))
_SPACES = b" \t\n\r\x0b\x0c"
_OTHER_ASCII = bytes(b for b in range(0x80) if b not in _DIGITS + _LETTERS + _SPACES)
_NON_ASCII = bytes(range(0x80, 0x100))
BYTE_CLASSES = (_DIGITS, _LETTERS, _SPACES, _OTHER_ASCII, _NON_ASCII)


_CLASS_OF = bytes(next(i for i, cls in enumerate(BYTE_CLASSES) if b in cls) for b in range(256))


_GIL_FREE_FROM_BYTES = 1 << 16  # texts this long are counted by torch, which lets other threads run meanwhile


def count_byte_classes(data: bytes) -> tuple[int, ...]:
    """How many bytes of ``data`` fall in each of :data:`BYTE_CLASSES`. Short data: one ``translate`` to class
    numbers and one ``count`` per class (C speed, holding the GIL); from 64 KiB on, a byte histogram by
    ``torch.bincount``, which releases the GIL, so that a server's other threads are not held for the ~10 ms a 4 MiB
    body takes."""
    if len(data) < _GIL_FREE_FROM_BYTES:
        classes = data.translate(_CLASS_OF)
        return tuple(classes.count(i) for i in range(len(BYTE_CLASSES)))
    import torch

    histogram = torch.bincount(torch.frombuffer(bytearray(data), dtype=torch.uint8), minlength=256)
    per_class = torch.zeros(len(BYTE_CLASSES), dtype=torch.int64).index_add_(0, _class_index(), histogram)
    return tuple(per_class.tolist())


@functools.cache
def _class_index():
    """The class number of each byte value, as a tensor (built once)."""
    import torch

    return torch.tensor(list(_CLASS_OF), dtype=torch.int64)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level map, reversed: vocabulary character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _has_byte_level(spec) -> bool:
    if not isinstance(spec, dict):
        return False
    if spec.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(m) for m in spec.get("pretokenizers") or [])


def _normalizer_ok(spec) -> bool:
    if spec is None:
        return True
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "Sequence":
        return all(_normalizer_ok(m) for m in spec.get("normalizers") or [])
    return kind == "NFC"


def _class_maxima(spec) -> tuple[int, ...] | None:
    """Per byte class, the most bytes of it one token holds; None when the conditions do not hold."""
    vocab = (spec.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict) or not _has_byte_level(spec.get("pre_tokenizer")):
        return None
    decoder = _byte_decoder()
    if not set(decoder) <= set(vocab):
        return None  # a byte missing from the vocabulary: its text would not be covered
    maxima = [1] * len(BYTE_CLASSES)
    pieces = [bytes(decoder[c] for c in token) for token in vocab if all(c in decoder for c in token)]
    if len(pieces) != len(vocab):
        return None  # a vocabulary entry outside the byte-level alphabet
    pieces += [(t.get("content") or "").encode("utf-8") for t in spec.get("added_tokens") or []]
    for piece in pieces:
        maxima = [max(m, n) for m, n in zip(maxima, count_byte_classes(piece))]
    return tuple(maxima)


def token_floor_maxima(spec: dict) -> tuple[int, ...] | None:
    """Per byte class, the most bytes of it one token holds, for a tokenizer given as its ``tokenizer.json``
    content (parsed); None when the module's conditions do not hold. With ``nfc = spec["normalizer"] is not None``,
    :func:`make_token_floor` turns it into the floor."""
    if not _normalizer_ok(spec.get("normalizer")):
        return None
    return _class_maxima(spec)


def make_token_floor(maxima: tuple[int, ...], nfc: bool) -> Callable[[str], int]:
    def token_floor(text: str) -> int:
        """At least this many tokens in ``text`` (see :mod:`hf_openjev.tokenizer.token_floor`)."""
        if nfc:
            text = unicodedata.normalize("NFC", text)
        counts = count_byte_classes(text.encode("utf-8", "surrogatepass"))
        return max(-(-n // m) for n, m in zip(counts, maxima))

    return token_floor
