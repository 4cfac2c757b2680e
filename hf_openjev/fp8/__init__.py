"""The FP8 mode (opt-in): e4m3 projections with per-channel weight scales and per-token activation scales.

- :mod:`.option`: the ``fp8`` option of the commands and the pipeline (pure Python); which projections a mode
  quantizes and the export format's metadata are :mod:`hf_openjev.checkpoint.fp8_scheme` (fp8 reads checkpoint,
  never the reverse);
- :mod:`.prepare`: :func:`prepare_model_for_fp8`, the one call that swaps a model's projections before it moves;
- :mod:`.swap`, :mod:`.linear`: the swap and the ``Fp8Linear`` module it puts in place;
- :mod:`.quantize`, :mod:`.state`, :mod:`.loading`: writing an FP8 export, reading one back.

The op is ``hf_openjev.ops.fp8_linear``. Importing this package imports no torch; the names below load on first use.
"""

_LAZY = {"prepare_model_for_fp8": "prepare", "check_fp8_target": "prepare", "quantize_model_fp8": "swap",
         "fp8_mode_of": "swap", "fp8_modules": "swap", "Fp8Linear": "linear", "quantize_export": "quantize",
         "FP8_CHOICES": "option", "select_fp8_path": "option", "FP8_MODES": "option"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_openjev.fp8' has no attribute {name!r}")
