"""ops/parallel_compile.py on the CPU, against stand-ins that follow Triton 3.6's control flow (JITFunction.run with
its ``warmup`` flag and kernel cache, AsyncCompileMode's submit / finalize, Autotuner.run / _bench /
check_disk_cache): inside a block nothing launches, compiles run side by side on the pool and are loaded there, a
tuning made without timings is forgotten, other threads are untouched, and Triton's methods come back exactly."""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar

import pytest
import torch

from hf_openjev.ops import parallel_compile

MODE: ContextVar = ContextVar("standin_async_mode", default=None)


class FutureKernel:
    def __init__(self, finalize, future):
        self.finalize, self.future, self.kernel = finalize, future, None

    def result(self, ignore_errors=False):
        if self.kernel is None:
            try:
                kernel = self.future.result()
            except Exception:
                if ignore_errors:
                    return None
                raise
            self.finalize(kernel)
            self.kernel = kernel
        return self.kernel


class AsyncMode:
    """Triton's AsyncCompileMode: compiles submitted to the executor, finalized (cached) when the block ends."""

    def __init__(self, executor, *, ignore_errors=False):
        self.executor, self.ignore_errors, self.future_kernels = executor, ignore_errors, {}

    def submit(self, key, compile_fn, finalize_fn):
        if key not in self.future_kernels:
            self.future_kernels[key] = FutureKernel(finalize_fn, self.executor.submit(compile_fn))
        return self.future_kernels[key]

    def __enter__(self):
        MODE.set(self)
        return self

    def __exit__(self, *exc):
        for future in self.future_kernels.values():
            future.result(self.ignore_errors)
        MODE.set(None)


class Compiled:
    def __init__(self, name, key, log):
        self.name, self.key, self.log, self.module = name, key, log, None

    def _init_handles(self):
        if self.name == "too_big":
            raise RuntimeError("out of resource: shared memory")
        self.log.append(("load", self.name, threading.current_thread().name))
        self.module = "loaded"


class JIT:
    """Triton's JITFunction.run: compile on a cache miss (through the async mode when one is active), launch unless
    ``warmup``."""

    def __init__(self, name, log, fail=False, seconds=0.05):
        self.name, self.log, self.fail, self.seconds, self.kernel_cache = name, log, fail, seconds, {}

    def run(self, *args, grid, warmup, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        kernel = self.kernel_cache.get(key)
        if kernel is None:
            mode = MODE.get()
            if mode is not None:
                kernel = mode.submit((self.name, key), lambda: self.compile(key),
                                     lambda done: self.kernel_cache.__setitem__(key, done))
            else:
                kernel = self.kernel_cache[key] = self.compile(key)
        if not warmup:
            kernel = kernel.result() if hasattr(kernel, "result") else kernel
            if kernel.module is None:
                kernel._init_handles()
            self.log.append(("launch", self.name, key))
        return kernel

    def compile(self, key):
        self.log.append(("compile start", self.name, threading.current_thread().name))
        time.sleep(self.seconds)
        self.log.append(("compile end", self.name, threading.current_thread().name))
        if self.fail:
            raise RuntimeError("ptxas failed")
        return Compiled(self.name, key, self.log)


class Config:
    def __init__(self, block, ms):
        self.block, self.ms = block, ms

    def all_kwargs(self):
        return {"BLOCK": self.block}


class Tuner:
    """Triton's Autotuner: a key not in ``cache`` is benchmarked (each config run and timed), the fastest kept;
    with ``cache_results`` through the on-disk cache."""

    def __init__(self, fn, configs, cache_results=False):
        self.fn, self.configs, self.cache_results, self.cache, self.disk = fn, configs, cache_results, {}, {}

    def run(self, *args, **kwargs):
        key = args[0]
        if key not in self.cache:
            def benchmark():
                timings = {config: self._bench(*args, config=config, **kwargs) for config in self.configs}
                self.cache[key] = min(timings, key=timings.get)

            self.check_disk_cache(key, self.configs, benchmark) if self.cache_results else benchmark()
        return self.fn.run(*args, **kwargs, **self.cache[key].all_kwargs())

    def _bench(self, *args, config, **meta):
        self.fn.run(*args, **{**meta, "warmup": False}, **config.all_kwargs())
        return [config.ms] * 3

    def check_disk_cache(self, key, configs, bench_fn):
        if key in self.disk:
            self.cache[key] = self.disk[key]
            return True
        bench_fn()
        self.disk[key] = self.cache[key]
        return False


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.setattr(parallel_compile, "triton_classes", lambda: (JIT, Tuner, AsyncMode))
    return {name: JIT.__dict__[name] for name in ("run",)} | {f"tuner.{name}": Tuner.__dict__[name]
                                                             for name in ("run", "_bench", "check_disk_cache")}


def launches(log):
    return [entry for entry in log if entry[0] == "launch"]


def test_inside_a_block_kernels_compile_side_by_side_and_load_on_the_pool_without_launching(standins):
    log = []
    kernels = [JIT(f"k{i}", log) for i in range(4)]
    with parallel_compile.compiling_in_parallel(4) as report:
        for kernel in kernels:
            kernel.run(8, 16, grid=(1,), warmup=False)
            kernel.run(8, 16, grid=(1,), warmup=False)  # the same specialization again: one compile
        assert launches(log) == [] and all(kernel.kernel_cache == {} for kernel in kernels)  # not finalized yet
    assert launches(log) == []
    compiles = [entry for entry in log if entry[0] == "compile start"]
    assert len(compiles) == 4 and all(thread.startswith("jev-compile") for _, _, thread in compiles)
    # side by side: every compile started before the first one ended
    first_end = next(i for i, entry in enumerate(log) if entry[0] == "compile end")
    assert all(log.index(entry) < first_end for entry in compiles)
    loads = [entry for entry in log if entry[0] == "load"]
    assert sorted(name for _, name, _ in loads) == ["k0", "k1", "k2", "k3"]
    assert all(thread.startswith("jev-compile") for _, _, thread in loads)
    assert report["compiles"] == 4 and report["loads"] == 4 and report["failures"] == [] and report["untuned"] == 0
    assert report["compile_wait_s"] >= 0 and report["load_s"] >= 0
    log.clear()
    kernels[0].run(8, 16, grid=(1,), warmup=False)  # after the block: compiled and loaded already, it launches
    assert [entry[0] for entry in log] == ["launch"]


def test_an_autotuned_kernel_compiles_its_chosen_config_or_every_candidate_and_keeps_no_untimed_choice(standins):
    log = []
    tuner = Tuner(JIT("tuned", log, seconds=0.0), [Config(32, 2.0), Config(64, 1.0)], cache_results=True)
    tuner.cache[128] = tuner.configs[0]  # a carried configuration for size 128
    with parallel_compile.compiling_in_parallel(2) as report:
        tuner.run(128, grid=(1,), warmup=False)
        tuner.run(256, grid=(1,), warmup=False)  # not tuned: every candidate compiled, none chosen
    assert launches(log) == [] and report["untuned"] == 1 and report["compiles"] == 3
    assert set(tuner.cache) == {128} and tuner.disk == {}  # no untimed choice kept, nothing written to disk
    assert {key[1] for key in tuner.fn.kernel_cache} == {(("BLOCK", 32),), (("BLOCK", 64),)}
    log.clear()
    tuner.run(256, grid=(1,), warmup=False)  # after the block: timed for real, no compile needed
    assert tuner.cache[256].block == 64 and tuner.disk[256].block == 64
    assert [entry[0] for entry in log] == ["launch"] * 3 and not any("compile" in entry[0] for entry in log)


def test_another_thread_launches_as_usual_while_a_block_is_open(standins):
    log = []
    kernel = JIT("shared", log, seconds=0.0)
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait(5)
        kernel.run(1, grid=(1,), warmup=False)
        done.set()

    worker = threading.Thread(target=other, name="event-loop")
    worker.start()
    with parallel_compile.compiling_in_parallel(2):
        kernel.run(2, grid=(1,), warmup=False)
        inside.set()
        assert done.wait(5)
    worker.join()
    assert launches(log) == [("launch", "shared", ((1,), ()))]


def test_triton_methods_come_back_exactly_after_a_block_an_error_and_overlapping_blocks(standins):
    def current():
        return {"run": JIT.__dict__["run"]} | {f"tuner.{n}": Tuner.__dict__[n] for n in ("run", "_bench",
                                                                                         "check_disk_cache")}

    with parallel_compile.compiling_in_parallel(1):
        assert current()["run"] is not standins["run"]
    assert current() == standins
    with pytest.raises(KeyError, match="boom"), parallel_compile.compiling_in_parallel(1):
        raise KeyError("boom")
    assert current() == standins
    opened, release = threading.Event(), threading.Event()

    def second_block():
        with parallel_compile.compiling_in_parallel(1):
            opened.set()
            release.wait(5)

    worker = threading.Thread(target=second_block)
    worker.start()
    assert opened.wait(5)
    with parallel_compile.compiling_in_parallel(1):
        pass
    assert current()["run"] is not standins["run"]  # the other thread's block is still open
    release.set()
    worker.join()
    assert current() == standins


def test_failed_compiles_and_loads_are_reported_and_left_to_the_first_launch(standins):
    log = []
    broken, big = JIT("broken", log, fail=True, seconds=0.0), JIT("too_big", log, seconds=0.0)
    with parallel_compile.compiling_in_parallel(2) as report:
        broken.run(1, grid=(1,), warmup=False)
        big.run(1, grid=(1,), warmup=False)
    assert report["compiles"] == 2 and report["loads"] == 0
    assert report["failures"] == ["compile: RuntimeError: ptxas failed",
                                  "too_big: RuntimeError: out of resource: shared memory"]
    assert broken.kernel_cache == {} and launches(log) == []
    with pytest.raises(RuntimeError, match="ptxas failed"):  # the first launch compiles again, and raises
        broken.run(1, grid=(1,), warmup=False)


def test_a_nested_block_and_a_build_without_triton_change_nothing(standins, monkeypatch):
    log = []
    kernel = JIT("k", log, seconds=0.0)
    with parallel_compile.compiling_in_parallel(2) as outer:
        with parallel_compile.compiling_in_parallel(2) as inner:
            kernel.run(1, grid=(1,), warmup=False)
        assert inner["compiles"] == 0 and launches(log) == []
    assert outer["compiles"] == 1
    monkeypatch.setattr(parallel_compile, "triton_classes", lambda: None)
    with parallel_compile.compiling_in_parallel(2) as report:
        kernel.run(2, grid=(1,), warmup=False)
    assert report["compiles"] == 0 and len(launches(log)) == 1 and JIT.__dict__["run"] is standins["run"]


def test_the_overlap_recipe_says_it_needs_triton_before_doing_anything(tmp_path, capsys):
    from repo_data import load_recipe

    recipe = load_recipe("compile_overlap")
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--out", str(tmp_path / "o"), "--threads", "0"])
    assert stop.value.code == 2 and "1 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # the project's CPU environment has no Triton
        recipe.main(["--out", str(tmp_path / "o")])
    assert stop.value.code == 2 and "needs torch and triton" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("threads", [0, -1, 1.5, "4"])
def test_threads_must_be_a_whole_number_of_one_or_more(threads):
    with pytest.raises(ValueError, match="threads must be a whole number >= 1"):
        with parallel_compile.compiling_in_parallel(threads):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_triton_kernel_called_in_a_block_compiles_without_running_and_runs_after_it_on_cuda():
    import triton
    import triton.language as tl

    @triton.jit
    def fill(OUT, N, VALUE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + offsets, VALUE, mask=offsets < N)

    out = torch.zeros(100, device="cuda")
    with parallel_compile.compiling_in_parallel(4) as report:
        for value in (1.0, 2.0, 3.0):
            fill[(1,)](out, 100, VALUE=value, BLOCK=128)
        torch.cuda.synchronize()
        assert out.abs().sum().item() == 0  # nothing launched
    assert (report["compiles"], report["loads"], report["failures"]) == (3, 3, [])
    cache = fill.device_caches[torch.cuda.current_device()][0]
    assert len(cache) == 3 and all(kernel.module is not None for kernel in cache.values())  # compiled and loaded
    fill[(1,)](out, 100, VALUE=2.0, BLOCK=128)
    torch.cuda.synchronize()
    assert torch.all(out == 2.0) and len(cache) == 3  # launched with no compile of its own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_autotuned_triton_kernel_is_left_untuned_in_a_block_and_tuned_after_it_on_cuda():
    import triton
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    @triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["N"])
    @triton.jit
    def fill(OUT, N, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + offsets, 7.0, mask=offsets < N)

    assert isinstance(fill, Autotuner)
    out = torch.zeros(300, device="cuda")
    with parallel_compile.compiling_in_parallel(2) as report:
        fill[lambda meta: (triton.cdiv(300, meta["BLOCK"]),)](out, 300)
    torch.cuda.synchronize()
    assert report["untuned"] == 1 and report["compiles"] == 2 and fill.cache == {} and out.abs().sum().item() == 0
    fill[lambda meta: (triton.cdiv(300, meta["BLOCK"]),)](out, 300)
    torch.cuda.synchronize()
    assert len(fill.cache) == 1 and torch.all(out == 7.0)  # tuned with real timings after the block
