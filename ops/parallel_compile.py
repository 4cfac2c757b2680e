"""Compile Triton kernels side by side, ahead of the pass that needs them (issue 39).

On an empty kernel cache a warm-up compiles one Triton kernel after another as its forwards first reach them: at the
27B shape 36 compiles in ~20 s, then each kernel's first launch builds its launcher and loads its binary (~10 s more;
recipes/RESULTS.md s33). Inside :func:`compiling_in_parallel` a Triton kernel call (``kernel[grid](...)``) launches
nothing: what it would compile goes to a thread pool through Triton's own ``AsyncCompileMode``. When the block ends
every compile has finished (or failed: the kernel is then left to its first launch, which raises as it always
would), and every compiled kernel's launcher is built and its binary loaded, on the same pool. ptxas and the
launcher's C compiler are subprocesses and Triton's LLVM passes run in C++, so the compiles overlap; by how much is
what ``recipes/warmup_breakdown.py --compile-threads`` measures.

A forward run inside computes nothing that can be read: its Triton kernels do not run and its other kernels run on
what they find. Its use is to reach every kernel call with its real arguments (the specializations a later pass will
launch); :func:`hf_openjev.patches.compiling_ahead` runs one such pass over a warm-up's packs.

Autotuned kernels (fla's): a configuration already chosen (fla's carried files, an earlier tuning) is compiled; a key
not tuned yet has every candidate configuration compiled and nothing chosen, since choosing takes timed runs: the
report counts it in ``untuned``, and the pass after the block times the candidates, compiled already. Nothing of
such a key is written to Triton's on-disk autotuning cache.

Only the calling thread is affected (a context variable): another thread (a second replica's warm-up, the server's
event loop) launches its kernels as usual while a block is open. Without Triton (a CPU build) the block changes
nothing and reports no compiles.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_BLOCK: ContextVar[dict | None] = ContextVar("hf_openjev_compiling_in_parallel", default=None)  # the open block's report
_UNTIMED: ContextVar[list | None] = ContextVar("hf_openjev_untimed_tunings", default=None)  # per autotuner call
_LOCK = threading.Lock()
_INSTALLED: dict = {"depth": 0, "originals": []}  # (owner, name, original) while any block is open


def triton_classes():
    """(JITFunction, Autotuner, AsyncCompileMode) of the installed Triton, or None without one (tests stand in)."""
    try:
        from triton import AsyncCompileMode
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    return JITFunction, Autotuner, AsyncCompileMode


def _compile_only(run):
    """``JITFunction.run`` that, inside a block, compiles without launching (Triton's ``warmup=True``)."""
    def compile_only_run(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=warmup or _BLOCK.get() is not None, **kwargs)
    return compile_only_run


def _untimed_bench(bench):
    """``Autotuner._bench`` that, inside a block, compiles the configuration instead of timing it."""
    def untimed_bench(self, *args, config, **meta):
        if _BLOCK.get() is None:
            return bench(self, *args, config=config, **meta)
        self.fn.run(*args, **{**meta, **config.all_kwargs()})  # compiled, not launched
        untimed = _UNTIMED.get()
        if untimed is not None:
            untimed.append(config)
        return [float("inf")] * 3  # no timing: the choice this makes is dropped below
    return untimed_bench


def _forgetting_tuner(run):
    """``Autotuner.run`` that, inside a block, forgets a choice made without timings (the next pass tunes it)."""
    def forgetting_run(self, *args, **kwargs):
        report = _BLOCK.get()
        if report is None:
            return run(self, *args, **kwargs)
        known, token = set(self.cache), _UNTIMED.set([])
        try:
            return run(self, *args, **kwargs)
        finally:
            if _UNTIMED.get():
                report["untuned"] += 1
                for key in set(self.cache) - known:
                    del self.cache[key]
            _UNTIMED.reset(token)
    return forgetting_run


def _no_disk_cache(check):
    """``Autotuner.check_disk_cache`` that, inside a block, neither reads nor writes Triton's autotuning files."""
    def no_disk_cache(self, tuning_key, configs, bench_fn):
        if _BLOCK.get() is None:
            return check(self, tuning_key, configs, bench_fn)
        bench_fn()
        return False
    return no_disk_cache


def _install(jit_class, tuner_class) -> None:
    """Wrap Triton's methods once, however many blocks are open (each wrapper acts only in a block's thread)."""
    with _LOCK:
        if _INSTALLED["depth"] == 0:
            wrappers = [(jit_class, "run", _compile_only), (tuner_class, "run", _forgetting_tuner),
                        (tuner_class, "_bench", _untimed_bench), (tuner_class, "check_disk_cache", _no_disk_cache)]
            _INSTALLED["originals"] = [(owner, name, owner.__dict__[name]) for owner, name, _ in wrappers]
            for owner, name, wrap in wrappers:
                setattr(owner, name, wrap(owner.__dict__[name]))
        _INSTALLED["depth"] += 1


def _uninstall() -> None:
    """Put back exactly what :func:`_install` replaced when the last block closes."""
    with _LOCK:
        _INSTALLED["depth"] -= 1
        if _INSTALLED["depth"] == 0:
            for owner, name, original in _INSTALLED["originals"]:
                setattr(owner, name, original)
            _INSTALLED["originals"] = []


def _failure_line(kernel_name: str, error: BaseException) -> str:
    return f"{kernel_name}: {type(error).__name__}: {error}"[:300]


@contextmanager
def compiling_in_parallel(threads: int = 16):
    """``with compiling_in_parallel(16) as report: <a forward>``: the Triton kernels the block calls are compiled,
    ``threads`` at a time, and loaded, not launched (module docstring). ``report`` is filled when the block ends:
    ``{"threads", "compiles", "loads", "untuned", "failures", "compile_wait_s", "load_s"}`` (``compile_wait_s``: how
    long the block's end waited for compiles still running; ``failures``: one line each, those kernels left to their
    first launch). A block opened inside another changes nothing (the outer one compiles)."""
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"compiling_in_parallel: threads must be a whole number >= 1, got {threads!r}")
    report = {"threads": threads, "compiles": 0, "loads": 0, "untuned": 0, "failures": [], "compile_wait_s": 0.0,
              "load_s": 0.0}
    classes = triton_classes()
    if classes is None or _BLOCK.get() is not None:
        yield report
        return
    jit_class, tuner_class, async_mode_class = classes
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="jev-compile") as pool:
        _install(jit_class, tuner_class)
        opened = _BLOCK.set(report)
        try:
            mode = async_mode_class(pool, ignore_errors=True)
            with mode:
                yield report
                ended = time.perf_counter()
            report["compile_wait_s"] = round(time.perf_counter() - ended, 3)  # __exit__ waited for every compile
        finally:
            _BLOCK.reset(opened)
            _uninstall()
        futures = list(mode.future_kernels.values())
        report["compiles"] = len(futures)
        kernels = []
        for future in futures:
            if future.kernel is not None:
                kernels.append(future.kernel)
            else:  # its compile raised (ignored by the mode): the first launch compiles it again, and raises
                error = future.future.exception()
                report["failures"].append(_failure_line("compile", error) if error else "compile: no kernel")
        report["load_s"], report["loads"] = _load(kernels, pool, device, report["failures"])


def _load(kernels: list, pool: ThreadPoolExecutor, device, failures: list) -> tuple[float, int]:
    """Build each compiled kernel's launcher and load its binary (what its first launch does:
    ``CompiledKernel._init_handles``), on ``pool``; returns (seconds, kernels loaded)."""
    start = time.perf_counter()

    def load(kernel):
        if device is not None:
            torch.cuda.set_device(device)  # the worker's current device: the one the kernels launch on
        kernel._init_handles()

    loadable = [kernel for kernel in kernels if hasattr(kernel, "_init_handles")]
    loaded = 0
    for kernel, future in [(kernel, pool.submit(load, kernel)) for kernel in loadable]:
        try:
            future.result()
            loaded += 1
        except Exception as error:  # noqa: BLE001 - e.g. OutOfResources: the first launch raises it again
            failures.append(_failure_line(getattr(kernel, "name", "kernel"), error))
    return round(time.perf_counter() - start, 3), loaded
