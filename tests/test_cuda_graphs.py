"""Graph-ready (padded) packs give the rows of unpadded ones (CPU); capture and replay on CUDA (``-m gpu``)."""

from __future__ import annotations

import random
import types

import pytest
import torch
from aligned_plans import plan_requests  # dict() below: the aligned layout; tails are asked for
from small_plans import random_token_requests

from hf_openjev import load_export
from hf_openjev.checkpoint.tiny import tiny_text_config
from hf_openjev.export.tiny import build_tiny_checkpoint
from hf_openjev.family import text_model_of
from hf_openjev.fast_options import DENSE_ATTENTION_TOKENS, FastPathOptions
from hf_openjev.packing.layout_steps import SegmentState
from hf_openjev.packing.pack_context import build_pack_context, move_inputs
from hf_openjev.packing.planner import Pack
from hf_openjev.patches import apply_patches, patch_record, read_options, revert_patches

DEFAULTS = FastPathOptions()  # the fast path's options as packing receives them

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def patched_model(tiny_checkpoint):
    model = load_export(tiny_checkpoint.export, dtype=torch.float32, device="cpu")
    apply_patches(model)
    yield model
    revert_patches(model)


@pytest.mark.parametrize("tails", [dict(), dict(share_tails=True, min_shared_tokens=8)])
def test_padded_packs_give_the_same_rows(patched_model, tails):
    text_model = text_model_of(patched_model)
    vocab = patched_model.config.vocab_size
    rng = random.Random(0)
    keys, checked, gathered = set(), 0, 0
    for _ in range(12):
        plan = plan_requests(random_token_requests(rng, vocab), **tails)
        for pack in plan.packs:
            plain = build_pack_context(plan, pack, {}, "cpu", DEFAULTS)
            padded = build_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=True)
            assert padded.input_ids.shape[0] >= plain.input_ids.shape[0]  # dummies, or levels that fill a bucket
            rows = text_model(pack=padded)
            assert rows.shape[0] == padded.final_rows.shape[0] >= len(padded.leaf_ids)
            torch.testing.assert_close(rows[: len(padded.leaf_ids)], text_model(pack=plain), rtol=1e-5, atol=1e-5)
            keys.add(padded.graph_key)
            checked += 1
            gathered += sum(call.rows is not None for call in padded.gdn_calls)
    assert checked >= 12 and len(keys) > 1
    assert (gathered > 0) == bool(tails)  # levels that re-run a tail's rows were padded and checked


@pytest.mark.parametrize("tails", [dict(), dict(share_tails=True, min_shared_tokens=8)])
def test_equal_keys_mean_equal_tensor_shapes(patched_model, tails):
    vocab = patched_model.config.vocab_size
    rng = random.Random(1)
    by_key = {}
    for _ in range(40):
        prefix = [rng.randrange(5, vocab) for _ in range(rng.choice([0, 20, 70]))]
        plan = plan_requests([[[prefix + [rng.randrange(5, vocab) for _ in range(rng.randint(1, 60))]
                                for _ in range(rng.randint(1, 4))]]], **tails)
        ctx = build_pack_context(plan, plan.packs[0], {}, "cpu", DEFAULTS, pad=True)
        shapes = [tuple(t.shape) for t in ctx.static_tensors()] + [(d, tuple(t.shape)) for d, t in ctx.inputs.items()]
        assert by_key.setdefault(ctx.graph_key, shapes) == shapes  # and so the flat input buffers a replay copies
    assert len(by_key) < 40  # buckets are shared


@pytest.mark.parametrize("tails", [dict(), dict(share_tails=True, min_shared_tokens=8)])
def test_every_device_input_of_a_padded_context_is_copied_in_at_replay(patched_model, tails):
    """A graph replays with the captured context's tensors: every tensor the forward reads (each level's and each
    GDN call's metadata included) must be one of ``static_tensors()``, or replays would reuse the captured pack's
    values (wrong rows on the GPU only)."""
    import dataclasses

    rng = random.Random(3)
    seen = set()
    for _ in range(10):
        plan = plan_requests(random_token_requests(rng, patched_model.config.vocab_size), **tails)
        for pack in plan.packs:
            if pack.external or pack.export:
                continue
            ctx = build_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=True)
            static = {id(t) for t in ctx.static_tensors()}
            for holder in [ctx, *ctx.levels, *ctx.gdn_calls]:
                for f in dataclasses.fields(holder):
                    value = getattr(holder, f.name)
                    if isinstance(value, torch.Tensor):
                        assert id(value) in static, (type(holder).__name__, f.name)
                        seen.add((type(holder).__name__, f.name))
    assert {("LevelSpec", "prefix_lengths"), ("GdnCall", "chunk_offsets"), ("GdnCall", "parent_rows")} <= seen


def test_dense_attention_is_for_long_single_sequences_without_a_prefix():
    one = plan_requests([[[[7] * 100]]])
    shared = plan_requests([[[[7] * 70 + [8], [7] * 70 + [9]]]])  # a 64-token prefix level, then two children
    apart = plan_requests([[[[7] * 70]], [[[8] * 80]]])  # two roots in one level

    def dense(plan, threshold, pad=False):
        options = FastPathOptions(dense_attention_tokens=threshold)
        return [level.dense for level in build_pack_context(plan, plan.packs[0], {}, "cpu", options, pad=pad).levels]

    assert dense(one, 64) == dense(one, 100) == dense(one, 64, pad=True) == [True]
    assert dense(one, 101) == dense(one, 0) == [False]
    assert dense(shared, 64) == [True, False] and dense(shared, 65) == [False, False]
    assert dense(apart, 16) == [False]
    keys = {build_pack_context(one, one.packs[0], {}, "cpu", FastPathOptions(dense_attention_tokens=t),
                               pad=True).graph_key for t in (64, 0)}
    assert len(keys) == 2  # a graph captured with one attention call never replays the other
    with pytest.raises(ValueError, match="dense_attention_tokens"):
        build_pack_context(one, one.packs[0], {}, "cpu", FastPathOptions(dense_attention_tokens=-1))


@pytest.mark.parametrize("pad", [False, True])
def test_dense_attention_gives_the_same_rows(patched_model, pad):
    """One dense causal call over a long single-sequence level (its dummies after it when padded) gives the rows of
    the varlen call; forcing it on a level of several sequences does not (they would read each other's keys)."""
    text_model = text_model_of(patched_model)
    rng = random.Random(4)
    plans = []
    for _ in range(10):
        requests = random_token_requests(rng, patched_model.config.vocab_size)
        plans += [plan_requests(requests[:1]), plan_requests(requests)]  # one request: its prefix level alone
    dense_levels = forced = 0
    for plan in plans:
        for pack in (p for p in plan.packs if not (p.external or p.export)):
            varlen = build_pack_context(plan, pack, {}, "cpu", FastPathOptions(dense_attention_tokens=0), pad=pad)
            dense = build_pack_context(plan, pack, {}, "cpu", FastPathOptions(dense_attention_tokens=16), pad=pad)
            dense_levels += sum(level.dense for level in dense.levels)
            torch.testing.assert_close(text_model(pack=dense), text_model(pack=varlen), rtol=1e-5, atol=1e-5)
            # the last level holds scored rows (the model's attention layer is its last: earlier levels' rows
            # reach no scored row after it)
            last = build_pack_context(plan, pack, {}, "cpu", FastPathOptions(dense_attention_tokens=0)).levels[-1]  # real
            if last.cu_seqlens.shape[0] > 2 and not last.has_parents:
                varlen.levels[-1].dense = True
                assert (text_model(pack=varlen) - text_model(pack=dense)).abs().max() > 1e-3
                forced += 1
    assert dense_levels >= 4 and forced >= 1, (dense_levels, forced)


@pytest.mark.parametrize("pad", [False, True])
def test_inputs_are_aligned_views_of_one_flat_buffer_per_dtype(pad):
    rng = random.Random(6)
    checked = 0
    for _ in range(6):
        plan = plan_requests(random_token_requests(rng, 400), share_tails=True, min_shared_tokens=8)
        for pack in (p for p in plan.packs if not (p.external or p.export)):
            ctx = build_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=pad)
            tensors = ctx.static_tensors()
            assert {t.dtype for t in tensors} == set(ctx.inputs) <= {torch.int32, torch.int64}
            for t in tensors:
                flat = ctx.inputs[t.dtype]
                assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and t.is_contiguous()
                assert (t.data_ptr() - flat.data_ptr()) % 16 == 0
            values = [t.clone() for t in tensors]
            old = dict(ctx.inputs)
            move_inputs(ctx, "cpu")  # again, from views: the same values, in new buffers
            assert all(torch.equal(a, b) for a, b in zip(values, ctx.static_tensors()))
            assert all(ctx.inputs[d].data_ptr() != old[d].data_ptr() for d in old)
            checked += 1
    assert checked >= 6


def test_an_input_missing_from_static_tensors_is_refused():
    plan = plan_requests([[[[7] * 30 + [8], [9] * 20]]])
    ctx = build_pack_context(plan, plan.packs[0], {}, "cpu", DEFAULTS)
    assert not ctx.levels[0].has_parents
    ctx.levels[0].chain_index = torch.zeros(3, dtype=torch.long)  # read only with parents: not a static tensor
    with pytest.raises(RuntimeError, match="LevelSpec.chain_index is missing from static_tensors"):
        move_inputs(ctx, "cpu")


def test_packs_with_handed_over_states_are_not_padded(patched_model):
    plan = plan_requests([[[[7] * 130 + [8], [7] * 130 + [9], [7] * 130 + [10]]]], max_sequences=1)
    split = next(p for p in plan.packs if p.external)
    with pytest.raises(ValueError, match="without external states"):
        build_pack_context(plan, split, {}, "cpu", DEFAULTS, pad=True)


def test_a_tail_continued_from_another_pack_is_refused():
    """The planner keeps a tail and its children in one pack; a hand-made plan that does not is refused."""
    plan = plan_requests([[[[7] * 40 + [8], [7] * 40 + [9]]]], share_tails=True, min_shared_tokens=16)
    tail, first, second = plan.segments
    assert not tail.hands_state and first.parent == second.parent == tail.id
    split = Pack(segments=[first.id, second.id], external=[tail.id])
    with pytest.raises(ValueError, match="continues tail 0 from another pack"):
        build_pack_context(plan, split, {tail.id: SegmentState(length=40)}, "cpu", DEFAULTS)


def heads27_config(num_layers: int = 4):
    """A tiny config (hidden 256) with the 27B model's Gated DeltaNet and attention head layouts. fla compiles and
    autotunes its kernels per head layout: on a fresh GPU machine the tiny default layout costs minutes of tuning
    that the ops' 27B-shape GPU tests, run first in the same process, have already done for this one."""
    return tiny_text_config(num_layers=num_layers, hidden_size=256, linear_num_key_heads=16, linear_num_value_heads=48,
                            linear_key_head_dim=128, linear_value_head_dim=128, num_attention_heads=24,
                            num_key_value_heads=4, head_dim=256,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})


@pytest.fixture(scope="module")
def heads27_checkpoint(tmp_path_factory):
    """A tiny checkpoint of :func:`heads27_config` (4 layers)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("heads27"), config=heads27_config())


def test_recording_always_ends_the_capture_it_began():
    """The capture context (no device-wide synchronize or cache release, unlike ``torch.cuda.graph``) begins in
    thread-local mode on the given pool and ends the capture on the way out, also when the forward raised: a capture
    left open would poison the next one. (``torch.cuda.stream(None)`` is a no-op, so this runs on a CPU.)"""
    from hf_openjev.patches.cuda_graphs import recording

    class Graph:
        def __init__(self):
            self.calls = []

        def capture_begin(self, **kwargs):
            self.calls.append(("begin", kwargs))

        def capture_end(self):
            self.calls.append(("end", {}))

    graph = Graph()
    with recording(graph, "pool", None):
        graph.calls.append(("work", {}))
    assert graph.calls == [("begin", {"pool": "pool", "capture_error_mode": "thread_local"}), ("work", {}),
                           ("end", {})]
    graph = Graph()
    with pytest.raises(RuntimeError, match="forward failed"), recording(graph, "pool", None):
        raise RuntimeError("forward failed")
    assert [name for name, _ in graph.calls] == ["begin", "end"]


def stand_in_cuda(monkeypatch, events: list, on_replay=lambda: None) -> type:
    """torch.cuda's streams and graphs stood in for, so that a capture's order runs on a CPU: each stream wait,
    synchronize, capture begin and end and replay is appended to ``events``. Returns a tensor subclass whose
    ``record_stream`` is logged too (the answer's)."""
    import contextlib

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

        def synchronize(self):
            events.append(f"synchronize {self.name}")

    class Graph:
        def capture_begin(self, **kwargs):
            events.append("capture_begin")

        def capture_end(self):
            events.append("capture_end")

        def replay(self):
            events.append("replay")
            on_replay()

    class Answer(torch.Tensor):
        def record_stream(self, stream):
            events.append(f"answer read on {stream.name}")

    caller = Stream("caller")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: caller)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("synchronize device"))
    return Answer


def test_a_new_bucket_is_answered_by_its_eager_run_and_recorded_without_a_wait(monkeypatch):
    """A bucket's first pack: one eager forward (its answer) then one recorded forward, with no synchronize and no
    replay in between; the caller's stream waits for the side stream. Its second pack: the inputs copied into the
    captured context and one replay, whose static output is the answer. (A stand-in for torch.cuda's streams and
    graphs, so this runs on a CPU.)"""
    from hf_openjev.patches import cuda_graphs

    events = []
    Answer = stand_in_cuda(monkeypatch, events)
    forwards = []

    def text_model(*, pack, layers=None):
        assert layers is None  # the whole forward runs eagerly
        forwards.append(pack)
        events.append(f"forward {len(forwards)}")
        return torch.full((2, 3), float(len(forwards))).as_subclass(Answer)

    class Ctx:
        graph_key = ("key",)

        def __init__(self):
            self.input_buffer = (torch.zeros(4),)

    graphs = cuda_graphs.PackGraphs(text_model)
    first = Ctx()
    answer = graphs.run(first)
    assert events == ["side waits for caller", "forward 1", "capture_begin", "forward 2", "capture_end",
                      "caller waits for side", "answer read on caller"]
    assert torch.equal(answer, torch.full((2, 3), 1.0)) and forwards == [first, first]  # the eager run's rows
    assert graphs.stats()["captures"] == 1 and set(graphs.stats()["capture_phases_s"]) == {"eager", "record"}
    events.clear()
    second = Ctx()
    second.input_buffer[0].fill_(7.0)
    replayed = graphs.run(second)
    assert events == ["replay"] and len(forwards) == 2
    assert torch.equal(first.input_buffer[0], torch.full((4,), 7.0))  # copied into the captured context
    assert torch.equal(replayed, torch.full((2, 3), 2.0))  # the recorded forward's static output
    assert graphs.stats()["replays"] == 1


def test_a_probed_capture_runs_the_probe_then_records_and_replays_once(monkeypatch):
    """``probe_layers``: the eager run takes only those layers, then the whole forward is recorded and replayed once
    on the side stream, and the replay's static output is the answer; no synchronize. (Stand-ins, on a CPU.)"""
    from hf_openjev.patches import cuda_graphs

    events, outputs = [], []
    # a replay writes the recorded forward's rows into its static output
    Rows = stand_in_cuda(monkeypatch, events, on_replay=lambda: outputs[-1].fill_(5.0))

    def text_model(*, pack, layers=None):
        events.append(f"forward layers={layers}")
        outputs.append(torch.zeros(2, 3).as_subclass(Rows))
        return outputs[-1]

    class Ctx:
        graph_key = ("key",)
        input_buffer = (torch.zeros(4),)

    graphs = cuda_graphs.PackGraphs(text_model, probe_layers=(0, 3, 6))
    answer = graphs.run(Ctx())
    assert events == ["side waits for caller", "forward layers=(0, 3, 6)", "capture_begin", "forward layers=None",
                      "capture_end", "replay", "caller waits for side", "answer read on caller"]
    assert answer is outputs[1] and torch.equal(answer, torch.full((2, 3), 5.0))  # the graph's rows, not the probe's


def test_inside_warming_a_capture_records_without_its_replay_and_a_captured_bucket_replays_nothing(monkeypatch):
    """PackGraphs.warming: a probed capture records and returns zeros (no replay); the bucket's next pack returns
    the static output without copying or replaying; after the block, packs are answered again. (Stand-ins.)"""
    from hf_openjev.patches import cuda_graphs

    events, outputs = [], []
    Rows = stand_in_cuda(monkeypatch, events, on_replay=lambda: outputs[-1].fill_(5.0))

    def text_model(*, pack, layers=None):
        events.append(f"forward layers={layers}")
        outputs.append(torch.full((2, 3), 9.0).as_subclass(Rows))  # memory the graph has not written
        return outputs[-1]

    class Ctx:
        graph_key = ("key",)

        def __init__(self, value=0.0):
            self.input_buffer = (torch.full((4,), value),)

    graphs = cuda_graphs.PackGraphs(text_model, probe_layers=(0, 3))
    first = Ctx()
    with graphs.warming():
        rows = graphs.run(first)
        assert events == ["side waits for caller", "forward layers=(0, 3)", "capture_begin", "forward layers=None",
                          "capture_end", "caller waits for side", "answer read on caller"]  # no replay
        assert rows is outputs[1] and torch.equal(rows, torch.zeros(2, 3))
        events.clear()
        assert graphs.run(Ctx(7.0)) is outputs[1] and events == []  # nothing copied, nothing replayed
        assert torch.equal(first.input_buffer[0], torch.zeros(4))
    assert graphs.answering and graphs.stats()["replays"] == 0 and graphs.stats()["captures"] == 1
    answer = graphs.run(Ctx(7.0))
    assert events == ["replay"] and torch.equal(answer, torch.full((2, 3), 5.0))
    assert torch.equal(first.input_buffer[0], torch.full((4,), 7.0))


def test_an_eager_capture_inside_warming_still_answers_from_its_eager_run(monkeypatch):
    from hf_openjev.patches import cuda_graphs

    events = []
    Rows = stand_in_cuda(monkeypatch, events)
    runs = []

    def text_model(*, pack, layers=None):
        runs.append(torch.full((2, 3), float(len(runs) + 1)).as_subclass(Rows))
        return runs[-1]

    class Ctx:
        graph_key = ("key",)
        input_buffer = (torch.zeros(4),)

    graphs = cuda_graphs.PackGraphs(text_model)
    with graphs.warming():
        assert torch.equal(graphs.run(Ctx()), torch.full((2, 3), 1.0)) and "replay" not in events


def test_a_compiling_pass_probes_new_buckets_ahead_and_their_captures_record_without_a_probe(monkeypatch):
    """PackGraphs.compiling: a new bucket's pack runs its probe on the side stream and records nothing (no capture,
    no graph kept); later, inside warming, that bucket's capture records at once, while a bucket not probed ahead
    still probes first. (Stand-ins, on a CPU.)"""
    from hf_openjev.patches import cuda_graphs

    events = []
    Rows = stand_in_cuda(monkeypatch, events)

    def text_model(*, pack, layers=None):
        events.append(f"forward {pack.graph_key[0]} layers={layers}")
        return torch.full((2, 3), 9.0).as_subclass(Rows)

    class Ctx:
        def __init__(self, key):
            self.graph_key = (key,)
            self.input_buffer = (torch.zeros(4),)

    graphs = cuda_graphs.PackGraphs(text_model, probe_layers=(0, 3))
    with graphs.compiling():
        assert not graphs.answering
        graphs.run(Ctx("a"))
        assert events == ["side waits for caller", "forward a layers=(0, 3)", "caller waits for side",
                          "answer read on caller"]
    assert graphs.answering and not graphs.probing_ahead
    stats = graphs.stats()
    assert stats["captures"] == 0 and stats["graphs"] == 0 and stats["probes_ahead"] == 1
    events.clear()
    with graphs.warming():
        graphs.run(Ctx("a"))
        graphs.run(Ctx("b"))
    assert events == ["side waits for caller", "capture_begin", "forward a layers=None", "capture_end",
                      "caller waits for side", "answer read on caller",
                      "side waits for caller", "forward b layers=(0, 3)", "capture_begin", "forward b layers=None",
                      "capture_end", "caller waits for side", "answer read on caller"]
    assert graphs.probed_ahead == set() and graphs.stats()["captures"] == 2


def test_compiling_ahead_keeps_the_probes_when_a_kernel_was_left_untuned_and_run_warm_up_runs_the_pass_twice(
        tmp_path, monkeypatch):
    """patches.compiling_ahead: the graph cache's compiling mode around ops.parallel_compile's block; an untuned
    kernel (tuning needs timed runs) empties ``probed_ahead``. run_warm_up: the pass inside compiling_ahead, then
    inside warming_up; without compile threads or a graph cache, once. (Stand-ins for the block and the cache.)"""
    import contextlib

    from hf_openjev.ops import parallel_compile
    from hf_openjev.patches import record as record_module

    untuned = []

    @contextlib.contextmanager
    def block(threads):
        report = {"untuned": 0, "failures": [], "threads": threads}
        yield report
        report["untuned"] = untuned.pop() if untuned else 0

    monkeypatch.setattr(parallel_compile, "compiling_in_parallel", block)
    modes = []

    class Graphs:
        answering, probed_ahead = True, set()

        @contextlib.contextmanager
        def compiling(self):
            modes.append("compiling")  # the modes open at a time
            try:
                yield self
            finally:
                modes.remove("compiling")

        @contextlib.contextmanager
        def warming(self):
            modes.append("warming")
            try:
                yield self
            finally:
                modes.remove("warming")

    graphs = Graphs()
    monkeypatch.setattr(record_module, "patch_record", lambda model: types.SimpleNamespace(graphs=graphs))
    graphs.probed_ahead = {("a",)}
    with record_module.compiling_ahead("model", 3) as report:
        assert report["threads"] == 3
    assert graphs.probed_ahead == {("a",)}
    untuned.append(1)
    with record_module.compiling_ahead("model", 3):
        pass
    assert graphs.probed_ahead == set()
    graphs.probed_ahead = {("a",)}
    with pytest.raises(RuntimeError, match="pass stopped"), record_module.compiling_ahead("model", 3):
        raise RuntimeError("pass stopped")
    assert graphs.probed_ahead == set()  # an unfinished pass: every probe kept
    failed = []

    @contextlib.contextmanager
    def failing_block(threads):
        report = {"untuned": 0, "failures": failed}
        yield report
        failed.append("k: RuntimeError: ptxas failed")

    monkeypatch.setattr(parallel_compile, "compiling_in_parallel", failing_block)
    graphs.probed_ahead = {("a",)}
    with record_module.compiling_ahead("model", 3):
        pass
    assert graphs.probed_ahead == set()  # a failed compile: its kernel compiles at first use, so probes stay
    monkeypatch.setattr(parallel_compile, "compiling_in_parallel", block)
    passes = []
    result = record_module.run_warm_up("model", lambda stage: passes.append((stage, list(modes))),
                                       compile_threads=4)
    assert passes == [("compile-ahead", ["compiling"]), ("warm-up", ["warming"])]
    assert result["compile_ahead"]["threads"] == 4
    assert result["compile_ahead"]["seconds"] >= 0 and result["warm_up_s"] >= 0
    passes.clear()
    assert record_module.run_warm_up("model", lambda stage: passes.append((stage, list(modes))),
                                     compile_threads=0)["compile_ahead"] is None
    assert passes == [("warm-up", ["warming"])]
    monkeypatch.setattr(record_module, "COMPILE_THREADS", 6)  # the package's default, when a caller names none
    assert record_module.run_warm_up("model", lambda stage: None)["compile_ahead"]["threads"] == 6
    monkeypatch.setattr(record_module, "patch_record", lambda model: types.SimpleNamespace(graphs=None))
    passes.clear()
    record_module.run_warm_up("model", passes.append, compile_threads=4)
    assert passes == ["warm-up"]  # no graph cache (the CPU): nothing to compile ahead for
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="compile_threads"):
            record_module.run_warm_up("model", lambda stage: None, compile_threads=bad)


def test_inside_a_warm_up_every_score_is_zero_even_where_the_rows_read_are_not_finite(tmp_path):
    """A warm-up's rows answer nothing (a graph's stale static output, a probe's): ``score_fast`` returns 0.0 for
    each score there, so ``score_prepared``'s non-finite check cannot fail a warm pass (s31: the bench's sweep warm
    pass at 27B raised "non-finite score"). Outside, the same packs are answered. (The graph cache stood in for:
    unanswered, its rows are NaN, memory a graph has not written.)"""
    from hf_openjev.contract import parse_request
    from hf_openjev.patches import warming_up
    from hf_openjev.patches.cuda_graphs import PackGraphs
    from hf_openjev.scoring import PreparedRequest, score_prepared

    checkpoint = build_tiny_checkpoint(tmp_path, config=tiny_text_config(num_layers=4, hidden_size=32))
    model = load_export(checkpoint.export, dtype=torch.float32, device="cpu")
    record = apply_patches(model, FastPathOptions())
    text_model = text_model_of(model)

    class Graphs(PackGraphs):
        def run(self, ctx):
            rows = text_model(pack=ctx)
            return rows if self.answering else torch.full_like(rows, float("nan"))

    parsed = parse_request({"state": "x", "questions": {"q": {"type": "choice", "instructions": "q",
                                                               "criteria": {"a": None, "b": None, "c": None}}}})
    rng = random.Random(5)
    prefix = [rng.randrange(10, 200) for _ in range(70)]
    prepared = [PreparedRequest(parsed, [[prefix + [rng.randrange(10, 200) for _ in range(n)] for n in (3, 1, 5)]])]
    eager = score_prepared(model, prepared, fast=True).scores  # no graph cache on the CPU: answered eagerly
    record.graphs = Graphs(text_model)
    with warming_up(model):
        warm = score_prepared(model, prepared, fast=True).scores
    assert [x for q in warm[0] for x in q] == [0.0, 0.0, 0.0]
    answered = score_prepared(model, prepared, fast=True).scores
    assert [x for q in answered[0] for x in q] == pytest.approx([x for q in eager[0] for x in q], abs=1e-5)


def test_warming_up_a_model_turns_answers_off_inside_only_and_is_a_no_op_without_graphs(tmp_path):
    from hf_openjev.patches import warming_up
    from hf_openjev.patches.cuda_graphs import PackGraphs

    checkpoint = build_tiny_checkpoint(tmp_path, config=tiny_text_config(num_layers=4, hidden_size=32))
    model = load_export(checkpoint.export, dtype=torch.float32, device="cpu")
    with warming_up(model):  # not patched: nothing to do
        pass
    record = apply_patches(model, FastPathOptions())
    assert record.graphs is None  # the CPU: no graph cache
    with warming_up(model):
        pass
    record.graphs = PackGraphs(text_model_of(model))  # never captures here: only its flag is read
    with pytest.raises(RuntimeError, match="inside"):
        with warming_up(model):
            assert patch_record(model).graphs.answering is False
            raise RuntimeError("inside")
    assert record.graphs.answering is True


def test_first_use_layers_are_the_first_of_each_block_type_and_the_last(tmp_path):
    from hf_openjev.patches.cuda_graphs import first_use_layers

    for layers, expected in ((7, (0, 3, 6)), (8, (0, 3, 7)), (4, (0, 3)), (64, (0, 3, 63))):
        checkpoint = build_tiny_checkpoint(tmp_path / str(layers), config=tiny_text_config(num_layers=layers,
                                                                                          hidden_size=32))
        model = load_export(checkpoint.export, dtype=torch.float32, device="cpu")
        assert first_use_layers(text_model_of(model)) == expected


def test_apply_patches_makes_probed_captures_on_cuda(tmp_path, monkeypatch):
    """The graph cache apply_patches makes for a CUDA model probes the first-use layers (its device stood in for:
    a PackGraphs touches CUDA only at its first capture)."""
    from hf_openjev.patches import record as patch_records
    from hf_openjev.patches.cuda_graphs import first_use_layers

    checkpoint = build_tiny_checkpoint(tmp_path, config=tiny_text_config(num_layers=8, hidden_size=32))
    model = load_export(checkpoint.export, dtype=torch.float32, device="cpu")
    monkeypatch.setattr(patch_records, "_device_of", lambda module: torch.device("cuda"))
    apply_patches(model, FastPathOptions(cuda_graphs=True))
    graphs = patch_record(model).graphs
    assert graphs is not None and graphs.probe_layers == first_use_layers(text_model_of(model)) == (0, 3, 7)
    revert_patches(model)


def _op_calls(text_model, ctx, layers):
    """Every op a packed forward calls at the dispatcher: its name, each tensor's shape, strides and dtype, and its
    other arguments: what a GPU's first uses (compiles, autotuning, plans) are keyed on."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.stride(), str(value.dtype))
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        return repr(value)

    calls = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            calls.add((str(func), describe(args), describe(sorted(kwargs.items()))))
            return func(*args, **kwargs)

    with Record():
        text_model(pack=ctx, layers=layers)
    return calls


@pytest.mark.parametrize("pad", [True, False], ids=["padded", "eager"])
@pytest.mark.parametrize("tails", [dict(), dict(share_tails=True, min_shared_tokens=8)])
def test_a_probe_of_the_first_use_layers_calls_every_op_the_whole_forward_calls(tmp_path, tails, pad):
    """The probe of a capture (:func:`first_use_layers`) meets every op call of the whole padded forward, shapes,
    strides, dtypes and arguments alike, so that recording meets none for the first time; leaving a block type
    out does not. So does the probe of an unpadded (eager) pack inside a warm-up (``PackGraphs.eager_layers``)."""
    from hf_openjev.patches.cuda_graphs import first_use_layers

    checkpoint = build_tiny_checkpoint(tmp_path, config=tiny_text_config(num_layers=7))
    model = load_export(checkpoint.export, dtype=torch.float32, device="cpu")
    apply_patches(model)
    text_model = text_model_of(model)
    probe = first_use_layers(text_model)
    assert probe == (0, 3, 6)
    rng = random.Random(3)
    checked = 0
    for _ in range(3):
        plan = plan_requests(random_token_requests(rng, model.config.vocab_size), **tails)
        for pack in plan.packs:
            ctx = build_pack_context(plan, pack, {}, "cpu", read_options(model), pad=pad)
            whole = _op_calls(text_model, ctx, None)
            assert whole <= _op_calls(text_model, ctx, probe)
            assert not whole <= _op_calls(text_model, ctx, (0, 6))  # no full-attention layer: its ops are missed
            checked += 1
    assert checked >= 3
    revert_patches(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dense", [DENSE_ATTENTION_TOKENS, 64], ids=["default", "dense64"])
def test_graph_replay_matches_eager_on_cuda(heads27_checkpoint, dense):
    """Replays equal captures, and both stay within bf16 rounding of the eager forward; ``dense64``: every level of
    one sequence of >= 64 tokens without a prefix runs its attention through cuDNN (graphs and eager)."""
    from hf_openjev.fast_path import score_fast

    model = load_export(heads27_checkpoint.export, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(2)
    batches = [random_token_requests(rng, model.config.vocab_size) for _ in range(4)]
    apply_patches(model, FastPathOptions(cuda_graphs=False))
    eager = [score_fast(model, b, read_options(model).replace(dense_attention_tokens=dense))[0] for b in batches]
    varlen = [score_fast(model, b, read_options(model).replace(dense_attention_tokens=0))[0] for b in batches]
    apply_patches(model, FastPathOptions(cuda_graphs=True))
    graphed = read_options(model).replace(dense_attention_tokens=dense)
    first = [score_fast(model, b, graphed)[0] for b in batches]  # captures
    captures = patch_record(model).graphs.captures
    again = [score_fast(model, b, graphed)[0] for b in batches]  # replays, no new captures
    assert patch_record(model).graphs.captures == captures and patch_record(model).graphs.replays > 0
    for e, v, f, a in zip(eager, varlen, first, again):
        assert f == a
        # bf16: padded GEMM shapes round differently; this model's scores reach ~24, where one bf16 step of a
        # hidden row moves a score by ~0.1 (recipes/RESULTS.md, s8); a misrouted state
        # moves it by O(score)
        bound = 0.01 * max(abs(x) for x in e)
        assert max(abs(x - y) for x, y in zip(e, f)) <= bound
        assert max(abs(x - y) for x, y in zip(e, v)) <= bound  # cuDNN's rounding against FA2's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_probed_capture_answers_as_the_whole_eager_run_did_on_cuda(tmp_path):
    """8 layers with the 27B's head layouts: captures whose first-use run is the probe (first_use_layers) answer
    each pack bit for bit as the eager-run captures do, and so do their replays; nothing tunes or compiles while
    recording (a capture would fail)."""
    from hf_openjev.fast_path import score_fast
    from hf_openjev.patches.cuda_graphs import PackGraphs, first_use_layers

    checkpoint = build_tiny_checkpoint(tmp_path, config=heads27_config(num_layers=8))
    model = load_export(checkpoint.export, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(4)
    batches = [random_token_requests(rng, model.config.vocab_size) for _ in range(4)]
    apply_patches(model, FastPathOptions(cuda_graphs=True))
    record = patch_record(model)
    text_model = record.graphs.text_model
    assert record.graphs.probe_layers == first_use_layers(text_model) == (0, 3, 7)  # apply_patches' default
    record.graphs = PackGraphs(text_model)  # the eager capture
    eager_captured = [score_fast(model, b)[0] for b in batches]
    record.graphs = PackGraphs(text_model, probe_layers=first_use_layers(text_model))
    probed = [score_fast(model, b)[0] for b in batches]
    captures = record.graphs.captures
    replayed = [score_fast(model, b)[0] for b in batches]
    assert captures > 0 and record.graphs.captures == captures and record.graphs.replays > 0
    assert probed == eager_captured and replayed == eager_captured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_captures_the_graphs_that_requests_of_its_shapes_replay(heads27_checkpoint):
    from hf_openjev.fast_path import score_fast
    from hf_openjev.serve.warmup import warm_up

    model = load_export(heads27_checkpoint.export, dtype=torch.bfloat16, device="cuda")
    apply_patches(model, FastPathOptions(cuda_graphs=True))
    shapes = [(0, [107]), (38, [43, 37, 40]), (200, [30, 31]), (130, [5, 9, 12, 3, 7])]
    report = warm_up(model, shapes, progress=False)
    captures = report["graphs"]["captures"]
    assert report["requests"] == 4 and captures >= 3
    rng = random.Random(9)
    for prefix_tokens, suffixes in shapes:  # other ids, same token counts
        prefix = [rng.randrange(5, 200) for _ in range(prefix_tokens)]
        score_fast(model, [[[prefix + [rng.randrange(5, 200) for _ in range(n)] for n in suffixes]]])
    stats = patch_record(model).graphs.stats()
    assert stats["captures"] == captures and stats["replays"] >= 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_threads", [0, 4], ids=["plain", "compile_ahead"])
def test_graphs_captured_unanswered_in_a_warm_up_answer_as_answered_captures_do_on_cuda(heads27_checkpoint,
                                                                                         compile_threads):
    """warm_up captures without replaying (nothing answers there); the first real packs of those buckets then
    replay graphs never replayed before, and answer what graphs captured and replayed at once answer, bit for bit.
    With compile_threads=4, after a compile-ahead pass (Triton's compiles on a pool, each new bucket probed there,
    nothing recorded) whose buckets are then captured without probes, and nothing failed to compile or load."""
    from hf_openjev.fast_path import score_fast
    from hf_openjev.patches.cuda_graphs import PackGraphs, first_use_layers
    from hf_openjev.serve.warmup import warm_up

    model = load_export(heads27_checkpoint.export, dtype=torch.bfloat16, device="cuda")
    record = apply_patches(model, FastPathOptions(cuda_graphs=True))
    shapes = [(0, [107]), (38, [43, 37, 40]), (130, [5, 9, 12, 3, 7])]
    rng = random.Random(4)
    requests = []
    for prefix_tokens, suffixes in shapes:
        prefix = [rng.randrange(5, 200) for _ in range(prefix_tokens)]
        requests.append([[prefix + [rng.randrange(5, 200) for _ in range(n)] for n in suffixes]])
    answered = [score_fast(model, [r])[0] for r in requests]  # an empty cache: captured, replayed, answered
    text_model = text_model_of(model)
    record.graphs = PackGraphs(text_model, probe_layers=first_use_layers(text_model))
    report = warm_up(model, shapes, progress=False, compile_threads=compile_threads)
    assert report["graphs"]["captures"] >= 3 and report["graphs"]["replays"] == 0
    if compile_threads:
        assert report["graphs"]["probes_ahead"] == report["graphs"]["captures"]
        assert report["compile_ahead"]["failures"] == [] and record.graphs.probed_ahead == set()
    assert [score_fast(model, [r])[0] for r in requests] == answered
    assert record.graphs.captures == report["graphs"]["captures"]  # the warm-up captured every bucket


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_elementwise_equals_the_plain_code_in_the_fast_path_on_cuda(heads27_checkpoint):
    """The whole fast path (bf16, eager) with the Triton elementwise kernels (the default) equals the plain code's
    scores exactly: tails, several levels and exports included."""
    from hf_openjev.fast_path import score_fast

    model = load_export(heads27_checkpoint.export, dtype=torch.bfloat16, device="cuda")
    requests = random_token_requests(random.Random(5), model.config.vocab_size)
    for options in (dict(share_tails=True, min_shared_tokens=8), dict(max_sequences=2)):  # tails; split packs
        apply_patches(model, FastPathOptions(cuda_graphs=False, fused_elementwise=False, **options))
        plain = score_fast(model, requests)[0]
        apply_patches(model, FastPathOptions(cuda_graphs=False, fused_elementwise=True, **options))
        fused = score_fast(model, requests)[0]
        assert plain != [] and plain == fused, options


@pytest.mark.parametrize("tails", [dict(), dict(share_tails=True, min_shared_tokens=16)])
def test_a_bounded_graph_cache_covers_the_jevbench_workload(tails):
    """The 231 JevBench request shapes (data/bench) need fewer graph buckets than the cache holds, at <= 20%
    padding, and almost every pack is graph-ready (design: a cache smaller than the shapes in use thrashes)."""
    import json
    from pathlib import Path

    from hf_openjev.patches.cuda_graphs import DEFAULT_CAPACITY, graph_ready

    shapes = json.loads((Path(__file__).resolve().parents[1] / "data/bench/jevbench231-shapes.json").read_text())
    rng = random.Random(0)
    keys, packs, eager, real, padded = set(), 0, 0, 0, 0
    for item in shapes["requests"]:
        prefix = [rng.randrange(5, 1000) for _ in range(item["prefix_tokens"])]
        plan = plan_requests([[[prefix + [rng.randrange(5, 1000) for _ in range(n)] for n in item["suffix_tokens"]]]],
                             **tails)
        for pack in plan.packs:
            packs += 1
            if not graph_ready(plan, pack):
                eager += 1
                continue
            ctx = build_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=True)
            keys.add(ctx.graph_key)
            real += pack.tokens(plan)
            padded += ctx.input_ids.shape[0]
    assert len(shapes["requests"]) == 231
    assert 10 < len(keys) <= DEFAULT_CAPACITY // 2  # room to spare for the server's merged groups
    assert eager <= packs // 50
    assert padded <= 1.2 * real


def test_graph_keys_tell_compiled_from_plain_elementwise():
    plan = plan_requests([[[[7] * 70 + [8], [7] * 70 + [9]]]])
    plain = build_pack_context(plan, plan.packs[0], {}, "cpu", DEFAULTS, pad=True)
    compiled = build_pack_context(plan, plan.packs[0], {}, "cpu", FastPathOptions(compile_elementwise=True), pad=True)
    assert compiled.options.compile_elementwise and not plain.options.compile_elementwise
    assert compiled.graph_key != plain.graph_key  # a graph captured with one never replays for the other
    unfused = build_pack_context(plan, plan.packs[0], {}, "cpu", FastPathOptions(fused_elementwise=False), pad=True)
    assert plain.options.fused_elementwise and unfused.graph_key not in (plain.graph_key, compiled.graph_key)


def test_graph_ready_packs():
    from hf_openjev.patches.cuda_graphs import graph_ready
    assert FastPathOptions().cuda_graphs  # the fast path replays graphs by default (on CUDA)
    small = plan_requests([[[[7] * 70 + [8], [7] * 70 + [9]]]])
    assert graph_ready(small, small.packs[0])
    cut = FastPathOptions().graph_tokens
    long = plan_requests([[[[7] * (cut + 1)]]])
    assert len(long.packs) == 1 and not graph_ready(long, long.packs[0])  # runs alone, eagerly
    at_cut = plan_requests([[[[7] * cut]]])
    assert graph_ready(at_cut, at_cut.packs[0]) and not graph_ready(at_cut, at_cut.packs[0], cut - 1)
    assert graph_ready(small, small.packs[0], small.packs[0].tokens(small))  # a cut counts tokens, before padding
    split = plan_requests([[[[7] * 130 + [8], [7] * 130 + [9], [7] * 130 + [10]]]], max_sequences=1)
    assert not any(graph_ready(split, pack) for pack in split.packs if pack.external or pack.export)
    assert any(pack.external for pack in split.packs) and any(pack.export for pack in split.packs)


def test_score_fast_sends_only_packs_within_graph_tokens_to_the_graphs(tmp_path):
    """``graph_tokens`` is the longest pack that replays a graph; longer packs run eagerly, with the same answers.
    Inside a warm-up an eager pack that hands no state on runs the probe layers alone. (The graph cache's captures
    stood in for on the CPU: its ``run`` runs the padded forward eagerly and counts the packs it gets.)"""
    from hf_openjev.fast_path import score_fast
    from hf_openjev.patches import warming_up
    from hf_openjev.patches.cuda_graphs import PackGraphs, first_use_layers

    checkpoint = build_tiny_checkpoint(tmp_path, config=tiny_text_config(num_layers=7, hidden_size=32))
    model = load_export(checkpoint.export, dtype=torch.float32, device="cpu")
    record = apply_patches(model, FastPathOptions())
    text_model = text_model_of(model)
    received, layers_run = [], []

    class Graphs(PackGraphs):
        def run(self, ctx):
            received.append(ctx.graph_key)
            return text_model(pack=ctx)

    for layer in text_model.layers:
        layer.register_forward_pre_hook(lambda module, args: layers_run.append(module))
    rng = torch.Generator().manual_seed(3)
    short = [[[torch.randint(10, 200, (12 + c,), generator=rng).tolist() for c in range(3)]]]  # one pack, 39 tokens
    long = [[[torch.randint(10, 200, (90,), generator=rng).tolist()]]]  # one pack of 90
    for requests, graphed_at_60 in ((short, 1), (long, 0)):
        eager, _ = score_fast(model, requests, record.options.replace(cuda_graphs=False))
        record.graphs = Graphs(text_model, probe_layers=first_use_layers(text_model))
        received.clear()
        everything, _ = score_fast(model, requests)
        assert len(received) == 1  # the default cut (4,096) graphs both
        received.clear()
        cut, _ = score_fast(model, requests, record.options.replace(graph_tokens=60))
        assert len(received) == graphed_at_60  # the 90-token pack runs eagerly
        if not graphed_at_60:  # inside a warm-up the eager pack runs the probe, (0, 3, 6) of 7 layers
            layers_run.clear()
            with warming_up(model):
                score_fast(model, requests, record.options.replace(graph_tokens=60))
            assert [list(text_model.layers).index(m) for m in layers_run] == list(first_use_layers(text_model)) == [0, 3, 6]
        record.graphs = None
        for scores in (everything, cut):
            assert scores == pytest.approx(eager, rel=1e-4, abs=1e-4)
    with pytest.raises(ValueError, match="graph_tokens"):
        FastPathOptions(graph_tokens=0)


def test_an_eager_pack_that_hands_states_on_runs_every_layer_inside_a_warm_up_too(tmp_path):
    from hf_openjev.patches.cuda_graphs import PackGraphs

    graphs = PackGraphs(object(), probe_layers=(0, 3, 6))
    exporting, leaf = Pack(segments=[], export=[1]), Pack(segments=[], export=[])
    assert graphs.eager_layers(exporting) is None and graphs.eager_layers(leaf) is None  # answering: all layers
    with graphs.warming():
        assert graphs.eager_layers(exporting) is None and graphs.eager_layers(leaf) == (0, 3, 6)
    assert PackGraphs(object()).eager_layers(leaf) is None  # an eager capture's cache probes nothing


def _calls_and_levels(plan, pack):
    ctx = build_pack_context(plan, pack, {}, "cpu", DEFAULTS)
    return [(call.first, call.last, call.rows is not None) for call in ctx.gdn_calls], len(ctx.levels)


def test_levels_share_a_gdn_call_only_when_none_reads_the_others_states():
    """A tail hands no state on, so the tail's level and its children's (which re-run its rows from the same
    anchor) run as one conv + GDN call; a level that reads a state of the open call starts a new one."""
    prefix = list(range(100, 140))  # 40 tokens: no multiple of 64 inside, so all of it is a tail
    short = [[prefix + [7, 8, 9], prefix + [5, 6]]]
    plan = plan_requests([short], share_tails=True, min_shared_tokens=16)
    assert _calls_and_levels(plan, plan.packs[0]) == ([(0, 1, True)], 2)  # tail + children: one gathered call
    long = [[list(range(100, 180)) + [7, 8, 9], list(range(100, 180)) + [5, 6]]]  # 80 = 64 aligned + 16 tail
    plan = plan_requests([long], share_tails=True, min_shared_tokens=16)
    assert _calls_and_levels(plan, plan.packs[0]) == ([(0, 0, False), (1, 2, True)], 3)
    plan = plan_requests([long])  # aligned sharing only: each level reads its parent level's states
    assert _calls_and_levels(plan, plan.packs[0]) == ([(0, 0, False), (1, 1, False)], 2)



@pytest.mark.parametrize("pad", [False, True])
def test_a_call_reads_one_earlier_calls_final_states_directly(pad):
    """Children of one prefix level start from that level's call's final states, read there (``source``, rows of
    that call: the prefix is its row 0); children of a prefix computed in an earlier pack read the bank (its
    external rows)."""
    state = list(range(100, 180))  # 64 shared (level 0), the rest per candidate
    plan = plan_requests([[[state + [7, 8, 9], state + [5, 6]]]])
    ctx = build_pack_context(plan, plan.packs[0], {}, "cpu", DEFAULTS, pad=pad)
    first, second = ctx.gdn_calls
    assert first.source is None and not first.has_parents
    assert second.source == 0 and second.parent_rows.tolist()[:2] == [0, 0]
    if pad:
        return  # packs with states from earlier packs are never padded
    split = plan_requests([[[state + [7, 8, 9], state + [5, 6]]]], max_sequences=1)
    pack = next(p for p in split.packs if p.external)
    store = {seg: SegmentState(length=split.segments[seg].end) for seg in pack.external}
    ctx = build_pack_context(split, pack, store, "cpu", DEFAULTS)
    (call,) = ctx.gdn_calls
    assert call.has_parents and call.source is None and call.parent_rows.tolist() == [1]  # bank row 1: external


def _prefix_reads(plan, pack, pad):
    """Per level with parents: (read in place, the [external ; pack] K/V rows each real sequence reads)."""
    ctx = build_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=pad)
    out = []
    for level in ctx.levels:
        if level.has_parents:
            pool = level.chain_index if level.chain_index is not None else torch.arange(len(ctx.input_ids))
            reads = [pool[s: s + n].tolist() for s, n in zip(level.prefix_starts.tolist(), level.prefix_lengths.tolist())]
            assert level.prefix_lengths.max() <= level.max_chain  # FA2's bound holds
            out.append((level.chain_index is None, reads))
    return out


@pytest.mark.parametrize("pad", [False, True])
def test_attention_reads_parent_keys_in_place_unless_a_chain_is_split(pad):
    """A level whose parents' chains are runs of consecutive pack rows reads them in place (no gather); a chain split
    by other segments' rows (a question prefix after the state prefix, with another question's between) is
    gathered once per distinct block."""
    state = list(range(100, 180))  # 80 tokens: 64 shared by all, the rest per question
    plan = plan_requests([[[state + [7, 8, 9], state + [5, 6]]]])  # two levels
    ((in_place, reads),) = _prefix_reads(plan, plan.packs[0], pad)
    assert in_place and reads[:2] == [list(range(64)), list(range(64))]
    tails = plan_requests([[[state + [7, 8, 9], state + [5, 6]]]], share_tails=True, min_shared_tokens=16)
    assert [in_place for in_place, _ in _prefix_reads(tails, tails.packs[0], pad)] == [True, True]  # 64 | 16 | ..
    questions = [[state + list(range(300, 370)) + [c] for c in (1, 2)],
                 [state + list(range(400, 470)) + [c] for c in (3, 4)]]
    plan = plan_requests([questions])
    levels = _prefix_reads(plan, plan.packs[0], pad)
    assert [in_place for in_place, _ in levels] == [True, False]
    first_question, second_question = levels[1][1][0], levels[1][1][2]
    assert first_question[:64] == second_question[:64] == list(range(64))  # the shared state prefix, then ...
    assert first_question[64:] != second_question[64:] and len(second_question) > 64  # ... each question's own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [False, True])
def test_merged_gdn_calls_give_the_rows_of_one_call_per_level(tiny_checkpoint, dtype, pad):
    _compare_merged_and_per_level(tiny_checkpoint, "cpu", dtype, pad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pad", [False, True])
def test_merged_gdn_calls_give_the_rows_of_one_call_per_level_on_cuda(heads27_checkpoint, pad):
    """fla's varlen kernels: a sequence's result does not depend on the other sequences of its call."""
    _compare_merged_and_per_level(heads27_checkpoint, "cuda", torch.bfloat16, pad)


def _compare_merged_and_per_level(tiny_checkpoint, device, dtype, pad):
    model = load_export(tiny_checkpoint.export, dtype=dtype, device=device)
    apply_patches(model, FastPathOptions(cuda_graphs=False))
    text_model = text_model_of(model)
    rng = random.Random(7)
    merged_calls = compared = 0
    with torch.no_grad():
        for _ in range(8):
            plan = plan_requests(random_token_requests(rng, model.config.vocab_size), share_tails=True, min_shared_tokens=8)
            for pack in plan.packs:
                if pack.external or pack.export:
                    continue
                merged = build_pack_context(plan, pack, {}, device, DEFAULTS, pad=pad)
                apart = build_pack_context(plan, pack, {}, device, DEFAULTS, pad=pad, merge_levels=False)
                assert len(apart.gdn_calls) == len(apart.levels)
                merged_calls += len(merged.gdn_calls) < len(merged.levels)
                assert torch.equal(text_model(pack=merged), text_model(pack=apart))
                compared += 1
    assert compared >= 8 and merged_calls >= 4  # packs where levels shared a call were among them
