"""The one-off analysis of a tokenizer behind :func:`hf_openjev.scoring.tokenize_request`'s shortcuts for over-long
texts, cached on disk by the tokenizer's fingerprint so that a new process does not redo it on its first request.

Three facts are derived from a fast tokenizer's ``tokenizer.json`` content: whether its clean cuts are proven
(:func:`hf_openjev.tokenizer.prefix_cuts.explain_unclean_spec`), whether they split its ids
(:func:`hf_openjev.tokenizer.prefix_cuts.explain_unsplit_spec`: a request's shared text is then tokenized once) and the per-byte-class maxima of its byte floor
(:func:`hf_openjev.tokenizer.token_floor.token_floor_maxima`, which walks the whole vocabulary: seconds for Qwen3.5's).

The fingerprint (:func:`tokenizer_fingerprint`, with :data:`FORMAT`) of a tokenizer loaded from a ``tokenizer.json``
that :func:`note_tokenizer_file` was told of (:func:`hf_openjev.checkpoint.files.load_tokenizer` does) is the file's
SHA-256, taken at load, plus the loaded tokenizer's small parts (normalizer, pre-tokenizer, added tokens, model type,
dropout, size), so that tokens added after loading count; any other tokenizer's is the SHA-256 of its whole
serialization (a fraction of a second to seconds for a large vocabulary). The result lives in ``<cache root>/tokenizer-analysis/<fingerprint>.json`` (root:
``$HF_OPENJEV_CACHE`` or ``~/.cache/hf_openjev``, as the Qwen tokenizer's conversion). A missing, unreadable or
stale file is recomputed and rewritten (temporary file + rename, so concurrent processes are safe); a cache that
cannot be written is skipped with a log line. A tokenizer that cannot be serialized (a slow one, a stand-in) is
analysed without the disk.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.files import note_tokenizer_file, tokenizer_file_digest
from .prefix_cuts import explain_unclean_spec, explain_unsplit_spec, find_clean_cut
from .token_floor import make_token_floor, token_floor_maxima

__all__ = ["FORMAT", "TokenizerAnalysis", "analyse_tokenizer", "analysis_path", "direct_backend", "note_tokenizer_file",
           "prove_clean_cuts", "prove_clean_splits", "prove_token_floor", "tokenizer_fingerprint"]

logger = logging.getLogger(__name__)

FORMAT = 2  # bump when what the analysis derives changes (patterns, conditions), so that old files are ignored
_SUBDIR = "tokenizer-analysis"
_analyses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_clean_cut_finders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> find_clean_cut or None
_token_floors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> floor(text) or None
_clean_splits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> bool


@dataclass(frozen=True)
class TokenizerAnalysis:
    """``unclean``: why clean cuts are not proven (None: they are); ``floor_maxima``: the byte floor's per-class
    maxima (None: no floor); ``floor_nfc``: whether the floor normalizes to NFC first; ``unsplit``: why clean cuts
    are not proven to split the ids (None: they are)."""

    unclean: str | None
    floor_maxima: tuple[int, ...] | None
    floor_nfc: bool = False
    unsplit: str | None = "not analysed"

    def to_json(self) -> dict:
        return {"format": FORMAT, "unclean": self.unclean, "unsplit": self.unsplit, "floor_nfc": self.floor_nfc,
                "floor_maxima": None if self.floor_maxima is None else list(self.floor_maxima)}

    @classmethod
    def from_json(cls, data) -> "TokenizerAnalysis":
        """The analysis a cache file holds; ValueError for a file of another format or shape."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("another format")
        unclean, maxima, nfc = data.get("unclean"), data.get("floor_maxima"), data.get("floor_nfc")
        unsplit = data.get("unsplit", 0)  # a file without it is refused
        if not all(v is None or isinstance(v, str) for v in (unclean, unsplit)) or not isinstance(nfc, bool):
            raise ValueError("bad fields")
        if maxima is not None and not (isinstance(maxima, list) and all(
                isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in maxima)):
            raise ValueError("bad maxima")
        return cls(unclean, None if maxima is None else tuple(maxima), nfc, unsplit)


def tokenizer_fingerprint(tokenizer) -> str:
    """The cache key of ``tokenizer``'s analysis (see the module docstring); raises what serializing a tokenizer that
    cannot be serialized raises."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    digest = hashlib.sha256(f"hf_openjev tokenizer analysis v{FORMAT}\n".encode())
    file_digest = tokenizer_file_digest(tokenizer)
    if file_digest is None:
        digest.update(backend.to_str().encode("utf-8", "surrogatepass"))
    else:
        digest.update(f"file {file_digest}\n{_small_parts(backend)}".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _small_parts(backend) -> str:
    """What the analysis reads of a loaded tokenizer besides its file's vocabulary, as one string."""
    def state(component):
        return None if component is None else component.__getstate__().decode("utf-8")

    added = [[i, t.content, t.special, t.single_word, t.lstrip, t.rstrip, t.normalized]
             for i, t in sorted(backend.get_added_tokens_decoder().items())]
    return json.dumps({"normalizer": state(backend.normalizer), "pre_tokenizer": state(backend.pre_tokenizer),
                       "model": type(backend.model).__name__, "dropout": getattr(backend.model, "dropout", None),
                       "size": backend.get_vocab_size(with_added_tokens=True), "added": added}, sort_keys=True)


def analysis_path(fingerprint: str, cache_dir: str | Path | None = None) -> Path:
    """Where the analysis of the tokenizer of ``fingerprint`` is cached (``cache_dir``: the cache root)."""
    from ..checkpoint.tiny import default_cache_dir

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / _SUBDIR / f"{fingerprint}.json"


def analyse_tokenizer(tokenizer, *, cache_dir: str | Path | None = None) -> TokenizerAnalysis:
    """The :class:`TokenizerAnalysis` of ``tokenizer`` (a Transformers fast tokenizer or a ``tokenizers.Tokenizer``):
    from this process's memory, else from the disk cache, else computed and written there."""
    try:
        return _analyses[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        fingerprint = tokenizer_fingerprint(tokenizer)
    except Exception as exc:  # noqa: BLE001 - a slow tokenizer, a stand-in: nothing to analyse or cache
        problem = f"not a fast tokenizer ({type(exc).__name__})"
        analysis = TokenizerAnalysis(problem, None, unsplit=problem)
    else:
        analysis = _cached_analysis(tokenizer, analysis_path(fingerprint, cache_dir))
    try:
        _analyses[tokenizer] = analysis
    except TypeError:  # not weak-referenceable
        pass
    return analysis


def _cached_analysis(tokenizer, path: Path) -> TokenizerAnalysis:
    try:
        return TokenizerAnalysis.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):  # missing, unreadable, torn or stale: recompute
        pass
    analysis = _compute(json.loads(getattr(tokenizer, "backend_tokenizer", tokenizer).to_str()))
    _write(path, analysis)
    return analysis


def _compute(spec: dict) -> TokenizerAnalysis:

    return TokenizerAnalysis(explain_unclean_spec(spec), token_floor_maxima(spec),
                             floor_nfc=spec.get("normalizer") is not None, unsplit=explain_unsplit_spec(spec))


def _write(path: Path, analysis: TokenizerAnalysis) -> None:
    """Write ``analysis`` to ``path`` through a temporary file and a rename; a failure is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(analysis.to_json(), fh)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        logger.info("the tokenizer analysis is not cached (%s): the next process redoes it", exc)


def prove_clean_cuts(tokenizer) -> Callable[[str, int], int | None] | None:
    """:func:`find_clean_cut` when its cuts are clean for ``tokenizer`` (see the module docstring), else None
    (logged once per tokenizer: over-long candidates are then tokenized in full). Cached per tokenizer, and on disk
    by the tokenizer's fingerprint (:func:`analyse_tokenizer`)."""
    try:
        return _clean_cut_finders[tokenizer]
    except (KeyError, TypeError):
        pass
    problem = analyse_tokenizer(tokenizer).unclean
    finder = None if problem else find_clean_cut
    if problem:
        logger.info("over-long candidates are tokenized in full: %s", problem)
    try:
        _clean_cut_finders[tokenizer] = finder
    except TypeError:  # not weak-referenceable
        pass
    return finder


def prove_token_floor(tokenizer) -> Callable[[str], int] | None:
    """``floor(text)``: a lower bound of ``len(tokenizer.encode(text, add_special_tokens=False))``, when the
    module's conditions hold for ``tokenizer`` (a Transformers fast tokenizer or a ``tokenizers.Tokenizer``), else
    None. Cached per tokenizer, and on disk by the tokenizer's fingerprint
    (:func:`analyse_tokenizer`)."""
    try:
        return _token_floors[tokenizer]
    except (KeyError, TypeError):
        pass
    analysis = analyse_tokenizer(tokenizer)
    floor = None if analysis.floor_maxima is None else make_token_floor(analysis.floor_maxima, analysis.floor_nfc)
    if floor is None:
        logger.info("no byte-level token floor for this tokenizer: over-long texts without clean cuts are tokenized "
                    "in full")
    try:
        _token_floors[tokenizer] = floor
    except TypeError:  # not weak-referenceable
        pass
    return floor


def prove_clean_splits(tokenizer) -> bool:
    """Whether :func:`find_clean_cut`'s cuts split ``tokenizer``'s ids: ``encode(text) == encode(text[:c]) +
    encode(text[c:])`` (:func:`hf_openjev.tokenizer.prefix_cuts.explain_unsplit_spec`); when not (logged once per
    tokenizer), every candidate is tokenized whole. Cached per tokenizer, and on disk by the tokenizer's fingerprint
    (:func:`analyse_tokenizer`)."""
    try:
        return _clean_splits[tokenizer]
    except (KeyError, TypeError):
        pass
    problem = analyse_tokenizer(tokenizer).unsplit
    if problem:
        logger.info("every candidate is tokenized whole (a request's shared text is not split off): %s", problem)
    try:
        _clean_splits[tokenizer] = not problem
    except TypeError:  # not weak-referenceable
        pass
    return not problem


def direct_backend(tokenizer):
    """The Rust tokenizer behind ``tokenizer`` when calling it directly gives the ids of ``tokenizer(text,
    add_special_tokens=False)["input_ids"]``, else None. Transformers' call wraps one ``encode_batch`` of its
    backend in ~20 us of Python a call (set_truncation_and_padding, split_special_tokens, the BatchEncoding), which a
    request's few calls per candidate add up.

    The same ids are certain where: the tokenizer is Transformers' own fast class (its ``__call__`` and
    ``_encode_plus`` not overridden, no input/target mode), the backend has no truncation and no padding set (the
    call would turn them off for the text; set, they would cut it here), and it splits no special tokens (the call
    sets ``encode_special_tokens`` from ``split_special_tokens`` each time). Checked at every call: a user's own call
    with truncation leaves it set on the backend, and a class's methods may be replaced (tests record calls so)."""
    classes = _fast_classes()
    kind = type(tokenizer)
    if classes is None or not issubclass(kind, classes[1]) or kind.__call__ is not classes[0].__call__ \
            or kind._encode_plus is not classes[1]._encode_plus or hasattr(kind, "_switch_to_input_mode"):
        return None
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None or tokenizer.split_special_tokens \
            or backend.encode_special_tokens:
        return None
    return backend



@functools.cache
def _fast_classes():
    """(PreTrainedTokenizerBase, TokenizersBackend), imported once; None under another Transformers layout."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    return PreTrainedTokenizerBase, TokenizersBackend
