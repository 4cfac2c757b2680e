"""What ``serve`` sets for its process: torch's CPU threads (hf_openjev.serve.cpu_threads: on a CPU replica one
core fewer than the machine, at least one, unless OMP_NUM_THREADS is set; CUDA replicas change nothing) and the
startup objects frozen out of the collector's full passes (hf_openjev.serve.startup_gc)."""

import logging

import pytest
import torch

from hf_openjev.serve.cpu_threads import leave_a_core_for_the_server


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 1), (16, 15)])
def test_a_cpu_replica_leaves_one_core_to_the_server(cpus, expected):
    assert leave_a_core_for_the_server(["cpu"], cpus=cpus, environ={}) == expected
    assert torch.get_num_threads() == expected


def test_omp_num_threads_and_cuda_replicas_change_nothing():
    before = torch.get_num_threads()
    assert leave_a_core_for_the_server(["cpu"], cpus=8, environ={"OMP_NUM_THREADS": "4"}) is None
    assert leave_a_core_for_the_server(["cuda:0", "cuda:1"], cpus=8, environ={}) is None
    assert torch.get_num_threads() == before
    assert leave_a_core_for_the_server(["cuda:0", "cpu"], cpus=3, environ={}) == 2  # one CPU replica is enough


def test_serve_on_the_cpu_sets_the_threads_before_loading(tiny_checkpoint, monkeypatch, caplog):
    """torch's thread count is per thread under OpenMP: ``serve`` sets it on its loading thread, and the threads
    started after that (the batcher's workers, which score) take it up. So the check runs in a fresh thread, on a
    machine made to look like 4 cores (3 threads), which neither the default nor CI's OMP_NUM_THREADS=1 gives."""
    import os
    import threading

    import uvicorn
    from live_server import run_lifespan_without_a_socket

    from hf_openjev.serve import startup

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(uvicorn.Server, "run", run_lifespan_without_a_socket)
    with caplog.at_level(logging.INFO, logger="hf_openjev.serve.server"):
        assert startup.serve(tiny_checkpoint.export, device="cpu") == 0
    seen = []
    scorer = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    scorer.start()
    scorer.join()
    assert seen == [3]  # the autouse fixture puts the count back after the test
    assert "scoring on the CPU with 3 torch thread(s)" in caplog.text


def test_serve_freezes_what_it_loaded_before_it_answers(tiny_checkpoint, monkeypatch, caplog):
    import gc

    import uvicorn
    from live_server import run_lifespan_without_a_socket

    from hf_openjev.serve import startup

    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(uvicorn.Server, "run", run_lifespan_without_a_socket)
    with caplog.at_level(logging.INFO, logger="hf_openjev.serve.server"):
        assert startup.serve(tiny_checkpoint.export, device="cpu") == 0
    assert gc.get_freeze_count() > 10_000  # the tiny model, its tokenizer, the app (the autouse fixture unfreezes)
    assert "startup objects frozen out of the garbage collector's full passes" in caplog.text


def test_freeze_startup_objects_leaves_a_full_collection_only_the_newer_objects():
    import gc

    from hf_openjev.serve.startup_gc import freeze_startup_objects

    before = [[i] for i in range(1000)]  # tracked objects alive at the freeze
    frozen = freeze_startup_objects()
    # frozen objects that die (another thread of the test process releasing what it held) leave the permanent
    # generation, so the count read again may be lower than the one returned, never higher (s17: 24 fewer once)
    assert frozen > 1000 and 0 < gc.get_freeze_count() <= frozen
    after = [[i] for i in range(1000)]  # and made after it
    walked = {id(o) for o in gc.get_objects()}  # what a full pass walks
    assert not any(id(o) in walked for o in before) and all(id(o) in walked for o in after)
