"""CUDA-graph replay of packed forwards, one graph per shape bucket (:mod:`.graph_buckets`).

The first pack of a new bucket runs once eagerly on a side stream (Triton autotuning, compiles, cuDNN plans and lazy
allocations stay out of the graph); the same forward is then recorded, not run. By default that eager run is a probe
of a few layers and a replay of the new graph answers the pack (below); with ``probe_layers=None`` it is the whole
forward, and its answer.
Later packs of the bucket copy their inputs into the captured context's tensors (one flat byte buffer,
``PackContext.input_buffer``) and replay. All graphs share one memory pool (they never run
concurrently, and each graph's output is read before the next replay). At most ``capacity`` graphs are kept
(least recently used first out); ``stats()`` reports captures, replays and evictions.

Captures use ``capture_error_mode="thread_local"``: the server's event-loop thread may touch CUDA while its
worker thread captures. ``stats()`` also reports the host's seconds spent capturing (eager run included).

Nothing waits for the device during a capture: recording begins while the eager run may still be running on the
same stream (a capture records the work launched after it began; recording reads only the context's static
inputs, which the eager run only reads too), and the caller's stream waits for the side stream at the end. Until
s22 the eager run was synchronized and the new graph replayed once to answer the pack: a whole forward of GPU time
per bucket, which the eager run had computed already.

A capture records through :func:`recording`, not ``torch.cuda.graph``: that context synchronizes the device and
empties the caching allocator's cache (``torch.cuda.empty_cache``, host cache too) at every capture, so a warm-up
of many buckets frees every cached block before each capture and allocates it again in the next bucket's eager run.
Here the eager runs and the captures share one side stream, and the blocks an eager run freed stay cached for the
next one (what the caching allocator does everywhere else); ``torch.cuda.empty_cache()`` still returns them.

A probed capture (``PackGraphs(..., probe_layers=first_use_layers(text_model))``, what ``apply_patches`` makes since
s25): the eager run before recording takes only the layers that meet every first use (the first layer, the first of
each block type, the last: every op of the forward on every shape it takes), then the whole forward is recorded and
replayed once to answer the pack. Its answers equal the eager capture's bit for bit (a GPU test); the replay costs a
forward of GPU time, not host. ``probe_layers=None`` is the eager capture (recipes/RESULTS.md s25 compares them).

A warm-up discards its answers, so inside :meth:`PackGraphs.warming` (``patches.warming_up(model)``, what the
server's warm-up and the bench's C warm-up pass use) nothing answers: a probed capture records without its replay
and a captured bucket's pack replays nothing; the rows returned are zeros, or a graph's output as its last replay
left it. Those replays were a forward of GPU time each that the warm-up waited for (recipes/RESULTS.md s26). The
first replay of each graph then comes in the first real pack of its bucket. A pack that takes no graph (longer than
``graph_tokens``) runs eagerly; inside a warm-up, when it hands no prefix state on, only the probe layers
(:meth:`PackGraphs.eager_layers`): its first uses are met, a whole forward of GPU time is not spent (s30).

A compile-ahead pass (:meth:`PackGraphs.compiling`, what ``patches.compiling_ahead`` opens) runs before a warm-up
pass over the same packs, its Triton kernels compiling side by side instead of launching
(:mod:`hf_openjev.ops.parallel_compile`): there a new bucket's pack runs its probe alone and records nothing, and
the warm-up's capture of that bucket then records without a probe of its own (opt-in; recipes/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

import torch

from hf_openjev.fast_options import GRAPH_TOKENS

DEFAULT_CAPACITY = 256


def graph_ready(plan, pack, max_tokens: int = GRAPH_TOKENS) -> bool:
    """Whether a planner pack can replay a graph: it neither receives nor hands on prefix states (padding would
    shift their rows) and has at most ``max_tokens`` tokens (``FastPathOptions.graph_tokens``; longer ones run
    eagerly)."""
    return not pack.external and not pack.export and pack.tokens(plan) <= max_tokens


def copy_inputs(ctx, static) -> None:
    """Copy a context's inputs into the captured context's: ONE copy of the byte buffer every input lies in
    (``PackContext.input_buffer``, :mod:`hf_openjev.packing.input_buffer`), asynchronous."""
    src, dst = ctx.input_buffer, static.input_buffer
    if len(src) != 1 or len(dst) != 1 or src[0].shape != dst[0].shape:
        raise RuntimeError(f"graph key {ctx.graph_key} maps to another input layout; this is a bug")
    dst[0].copy_(src[0], non_blocking=True)


@contextlib.contextmanager
def recording(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream):
    """Record the work launched inside into ``graph`` (memory from ``pool``) on ``stream``: ``torch.cuda.graph``'s
    capture without its device-wide synchronize and cache release. Work launched on ``stream`` before is not
    recorded: it runs as usual, also while the recording goes on."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


def first_use_layers(text_model) -> tuple[int, ...]:
    """The decoder layers whose eager run meets every first-use cost of a packed forward: the first layer (its
    input is the embedding), the first of each block type and the last (the final-row MLP), in order."""
    layers = text_model.layers[: text_model.config.num_hidden_layers]
    first_of_type = {}
    for i, layer in enumerate(layers):
        first_of_type.setdefault(layer.block_type, i)
    return tuple(sorted({0, len(layers) - 1, *first_of_type.values()}))


class PackGraphs:
    """A bounded cache of captured packed forwards of one text model. ``probe_layers`` (layer indices, e.g.
    :func:`first_use_layers`): a capture's eager run takes only those layers and a replay answers the pack; None:
    the whole forward runs eagerly and answers it."""

    def __init__(self, text_model, *, capacity: int = DEFAULT_CAPACITY, probe_layers: tuple[int, ...] | None = None):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.text_model = text_model
        self.probe_layers = probe_layers
        self.capacity = capacity
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, object, torch.Tensor]] = OrderedDict()
        self.pool = self.stream = None
        self.captures = self.replays = self.evictions = 0
        self.answering = True  # False inside warming(): no replay answers a pack
        self.probing_ahead = False  # True inside compiling(): a new bucket's probe runs, nothing is recorded
        # buckets whose first uses a compiling() pass met (its probe ran there): their capture records without one
        self.probed_ahead: set[tuple] = set()
        self.capture_s = 0.0
        # capture_s split, host time (nothing synchronized): launching the eager forward on the side stream (with its
        # first-use costs: autotuning, Triton compiles, cuDNN plans, allocations), recording and instantiating
        self.phases_s = {"eager": 0.0, "record": 0.0}
        self.probes_ahead, self.ahead_s = 0, 0.0  # compiling(): probes run ahead of their captures, host time

    def stats(self) -> dict:
        return {"graphs": len(self.graphs), "capacity": self.capacity, "captures": self.captures,
                "replays": self.replays, "evictions": self.evictions, "capture_s": round(self.capture_s, 3),
                "capture_phases_s": {k: round(v, 3) for k, v in self.phases_s.items()},
                "probes_ahead": self.probes_ahead, "ahead_s": round(self.ahead_s, 3)}

    @contextlib.contextmanager
    def warming(self):
        """Inside, packs are not answered: a capture records without its answering replay (a probed one; an eager
        one still answers from its eager run), a captured bucket's pack replays nothing and an ungraphed pack that
        hands no state on runs the probe layers alone (:meth:`eager_layers`). For warm-ups, which discard what they
        score; the rows returned are zeros, a graph's output as its last replay left it, or a probe's."""
        previous, self.answering = self.answering, False
        try:
            yield self
        finally:
            self.answering = previous

    @contextlib.contextmanager
    def compiling(self):
        """Inside, as inside :meth:`warming`, but a new bucket's pack runs its probe alone (on the side stream, as a
        capture's eager run does) and records nothing: the pass a compile-ahead runs
        (:func:`hf_openjev.patches.compiling_ahead`), whose kernels compile rather than launch. Each bucket probed
        so goes into ``probed_ahead``, and its later capture records without a probe of its own (its first uses are
        met); the caller empties ``probed_ahead`` when the pass left something undone (an untuned kernel)."""
        previous = self.answering, self.probing_ahead
        self.answering, self.probing_ahead = False, True
        try:
            yield self
        finally:
            self.answering, self.probing_ahead = previous

    def eager_layers(self, pack) -> tuple[int, ...] | None:
        """The layers an eager (ungraphed) planner ``pack`` runs: inside :meth:`warming`, the probe layers when it
        hands no prefix state on (its rows answer nothing; a later pack reads every layer's exported states);
        otherwise None, all of them."""
        return self.probe_layers if not self.answering and not pack.export else None

    def run(self, ctx) -> torch.Tensor:
        """Rows ``[R_b, hidden]`` of a padded context (``ctx.graph_key`` set); keep the first ``len(leaf_ids)``."""
        if ctx.graph_key is None:
            raise ValueError("PackGraphs.run needs a padded context (build_pack_context(..., pad=True))")
        entry = self.graphs.get(ctx.graph_key)
        if entry is None:
            return self._probe_ahead(ctx) if self.probing_ahead else self._capture(ctx)
        self.graphs.move_to_end(ctx.graph_key)
        graph, static, output = entry
        if not self.answering:
            return output
        copy_inputs(ctx, static)
        graph.replay()
        self.replays += 1
        return output

    def _side_stream(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(the caller's stream, the side stream) with the side stream after the caller's work (its input copies)."""
        if self.stream is None:
            self.stream, self.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        return caller, self.stream

    def _probe_ahead(self, ctx) -> torch.Tensor:
        """Inside :meth:`compiling`: a new bucket's probe (every layer without ``probe_layers``) on the side stream,
        nothing recorded; its rows are no answer."""
        start = time.perf_counter()
        caller, stream = self._side_stream()
        with torch.cuda.stream(stream):
            rows = self.text_model(pack=ctx, layers=self.probe_layers)
        caller.wait_stream(stream)
        rows.record_stream(caller)
        self.probed_ahead.add(ctx.graph_key)
        self.probes_ahead += 1
        self.ahead_s += time.perf_counter() - start
        return rows

    def _capture(self, ctx) -> torch.Tensor:
        """The pack's rows from an eager run on the side stream; the same forward recorded into a new graph. A bucket
        in ``probed_ahead`` (a probed capture's) skips the eager run: its first uses are met."""
        start = time.perf_counter()
        if len(self.graphs) >= self.capacity:
            self.graphs.popitem(last=False)
            self.evictions += 1
        caller, _ = self._side_stream()  # the caller's input copies first
        skip_probe = self.probe_layers is not None and ctx.graph_key in self.probed_ahead
        self.probed_ahead.discard(ctx.graph_key)
        answer = None
        if not skip_probe:
            with torch.cuda.stream(self.stream):  # first-use costs stay out of the graph (a whole run: the answer)
                answer = self.text_model(pack=ctx, layers=self.probe_layers)
        recorded_from = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with recording(graph, self.pool, self.stream):
            output = self.text_model(pack=ctx)  # recorded, not run: the graph's static output
        if self.probe_layers is not None:  # the probe's rows are no answer: the new graph's are
            with torch.cuda.stream(self.stream):
                if self.answering:
                    graph.replay()
                else:  # nothing answers: the recorded output is memory the graph has not written yet
                    output.zero_()
            answer = output
        caller.wait_stream(self.stream)  # the caller reads the answer, and later copies into ctx, after the side stream
        answer.record_stream(caller)
        end = time.perf_counter()
        self.phases_s["eager"] += recorded_from - start
        self.phases_s["record"] += end - recorded_from
        self.graphs[ctx.graph_key] = (graph, ctx, output)
        self.captures += 1
        self.capture_s += end - start
        return answer
