"""``hf-openjev export --fp8``: merge the published package into a temporary bf16 export, then quantize it
(:func:`hf_openjev.fp8.quantize.quantize_export`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from ..checkpoint.fp8_scheme import ALL_TARGETS, resolve_targets
from ..checkpoint.out_dir import check_outside_inputs, check_replaceable, missing_parents, remove_empty
from ..checkpoint.publish import claim_temp_dir, put_back_interrupted_swap, remove_stale_temps
from ..fp8.quantize import quantize_export


def merge_and_quantize(base_dir, package_dir, out_dir, *, targets: Iterable[str] | str = ALL_TARGETS,
                       overwrite: bool = False, progress: bool = True, log: Callable[[str], None] | None = None,
                       **merge_options):
    """``hf-openjev export --fp8``: :func:`~hf_openjev.export.merge.merge_lora` into a temporary bf16 export
    beside ``out_dir`` (its verification, ``merge_options``, runs there: it checks the merge), then
    :func:`~hf_openjev.fp8.quantize.quantize_export` of it into ``out_dir``; the temporary export is removed whatever happens. Both stream
    (one tensor at a time); the disk holds the bf16 export and the FP8 one at the end. Returns
    ``(ExportReport, Fp8ExportReport)``. Bad targets, an ``out_dir`` on or inside an input, and an existing
    ``out_dir`` (without ``overwrite``; with it, one that is neither an export nor empty) are refused before the
    merge."""
    from .merge import merge_lora

    out_dir = Path(out_dir)
    modules = resolve_targets(targets)
    put_back_interrupted_swap(out_dir, say=log or (lambda _message: None), what="export")
    check_outside_inputs(out_dir, [Path(base_dir), Path(package_dir)])
    check_replaceable(out_dir, overwrite)  # an export or an empty directory only
    created = missing_parents(out_dir)
    work = None
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out_dir)
        work = claim_temp_dir(out_dir, "bf16")
        merged = merge_lora(base_dir, package_dir, work.path / "merged", progress=progress, log=log, **merge_options)
        quantized = quantize_export(work.path / "merged", out_dir, targets=modules, overwrite=overwrite,
                                    progress=progress, log=log)
    except BaseException:
        if work is not None:
            work.discard()
            work = None
        remove_empty(created)
        raise
    finally:
        if work is not None:
            work.discard()
    return merged, quantized
