"""Benchmark driver: the 231-request JevBench workload on a random Open-Jev model shape (docs/performance.md).

One process, one set of weights, three arms:

  A  stock Transformers, torch fallbacks (fla unbound), right-padded batches of up to 32 candidates
  B  stock Transformers with fla-core bound (what a user gets by installing it)
  C  hf_openjev's fast path (packed candidates + shared prefixes + final-row last layer); with --cuda-graphs
     its packs replay CUDA graphs
  E  (optional) the same fast path eager, beside graph-replayed C, to separate graph replay from the rest
  A1 (optional) arm A with one candidate per batch: the stock model against itself, a floor for parity
  B1 (optional) arm B with one candidate per batch: the reference path against itself (fla bound), the same
     floor for parity against B

With ``--oracle oracle_<shape>.json`` (recipes/oracle.py) every arm and --sweep entry is also compared with the
fp32 oracle and judged by the fidelity gate against B (hf_openjev.fidelity): fidelity_<shape>.json/.md/.png
beside the bench's files. The run refuses to start when its bf16 weights' sha256 differs from the oracle's.

Per arm: warm-up pass, then measured passes in request order; each request timed with a device synchronize at
both ends, from token ids in to the response dict out. Reports mean / p50 / p95 (sorted[int(0.95 N) - 1]), the
kind x longest-candidate bucket table, peak memory, warm-up time, parity of C against A, and the
throughput with 1, 8 and 16 closed-loop clients in flight through the server's batcher.

  python recipes/bench_jevbench.py --shape 27b --arms A,B,C --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES_FILE = ROOT / "recipes" / "data" / "jevbench231-shapes.json"  # the workload (docs/performance.md "Workload")
T27 = 2.5343690298472983
# each member's calibration temperature; the tiny and mid shapes use the 27B's
TEMPERATURES = {"9b": 1.8969118766347646, "2b": 1.518796342858676}
VOCAB = 248320  # the Qwen3.5 vocabulary: every shape's embedding, and the range of the workload's random ids
BUCKETS = [(1, 128), (129, 512), (513, 2048), (2049, 4096), (4097, 16384)]

SHAPES = {
    # Open-Jev-27B text shape (docs/checkpoints.md)
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128),
    # a tiny shape, for smoke runs of this driver on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
    # Open-Jev-9B text shape (docs/checkpoints.md)
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128),
    # Open-Jev-2B text shape (docs/checkpoints.md; tied embeddings, which a text backbone without an LM head
    # does not see)
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
               num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
               linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True),
    # a mid-size shape with the real head dims and GVA (for parity runs)
    "mid": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=128, linear_value_head_dim=128),
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")


def build_model(shape: str, *, seed: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """Random bf16 weights from Transformers' own init (seeded), a random fp32 head, T of the 27B model."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from hf_openjev.checkpoint.manifest import ExportManifest
    from hf_openjev.model import JevModel
    from hf_openjev.checkpoint.backbone import make_head

    config = Qwen3_5TextConfig(vocab_size=VOCAB, max_position_embeddings=32768, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                "mrope_interleaved": True},
                               **SHAPES[shape])
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            backbone = Qwen3_5TextModel(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():  # the zero-initialised (1 + w) norms get small random weights, as trained ones have
        for name, p in backbone.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    generator = torch.Generator().manual_seed(seed + 1)
    weight = torch.randn(1, config.hidden_size, generator=generator) / config.hidden_size**0.5 * 4
    manifest = ExportManifest(model_id=f"random-{shape}", base_revision="random", checkpoint_revision="random",
                              temperature=TEMPERATURES.get(shape, T27), max_length=16384, chat_prefix="", chat_suffix="",
                              head_weight=tuple(weight.flatten().tolist()), head_bias=0.1)
    head = make_head(manifest.head_weight, manifest.head_bias, device)
    return JevModel(backbone, head, None, manifest, method="random")


def add_model_arguments(parser: argparse.ArgumentParser, *, shape: str) -> None:
    """The options every model-building recipe shares: --shape, --dtype, --seed, --out."""
    parser.add_argument("--shape", default=shape, choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)


def prepare_recipe(args: argparse.Namespace) -> tuple[Path, str, object]:
    """(output folder, created; the device: CUDA when there is one; the seeded random model of ``args``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return out, device, build_model(args.shape, seed=args.seed, device=device, dtype=getattr(torch, args.dtype))


def build_workload(path: Path, *, vocab: int, seed: int, limit: int | None = None, max_length: int | None = None):
    """PreparedRequests with random token ids, identical within each request's shared prefix (optionally only
    those whose longest sequence is at most ``max_length`` tokens; the ids do not depend on the filter)."""
    from hf_openjev.contract import parse_request
    from hf_openjev.scoring import PreparedRequest

    data = json.loads(path.read_text())
    rng = random.Random(seed)
    work = []
    for item in data["requests"][:limit]:
        n = len(item["suffix_tokens"])
        kind = item["kind"]
        criteria = {"choice": {f"o{i}": None for i in range(n)}, "score": [f"level {i}" for i in range(n)],
                    "noul": None}[kind]
        question = {"type": kind, "instructions": "x"}
        if criteria is not None:
            question["criteria"] = criteria
        parsed = parse_request({"state": "x", "questions": {"q": question}})
        prefix = [rng.randrange(1000, vocab) for _ in range(item["prefix_tokens"])]
        tokens = [[prefix + [rng.randrange(1000, vocab) for _ in range(s)] for s in item["suffix_tokens"]]]
        if max_length is None or item["prefix_tokens"] + max(item["suffix_tokens"]) <= max_length:
            work.append((item, PreparedRequest(parsed, tokens)))
    return work


def run_pass(model, work, *, fast: bool, batch_size: int = 32):
    """Time every request (sync at both ends); returns per-request (seconds, response). ``batch_size``: the
    reference path's right-padded batch (fast=False); the fast path runs with the options the model is patched
    with (``apply_patches``)."""
    from hf_openjev.scoring import build_answer, score_prepared

    out = []
    for _, prepared in work:
        sync()
        start = time.perf_counter()
        result = score_prepared(model, [prepared], fast=fast, batch_size=batch_size)
        response = build_answer(model, prepared, result.scores[0], seconds=result.seconds,
                                prefix_cache=result.prefix_cache[0], method=result.path)
        sync()
        out.append((time.perf_counter() - start, response))
    return out


def closed_loop(model, work, in_flight: int, *, max_wait_ms: float = 2.0, replicas=None) -> dict:
    """``in_flight`` closed-loop clients over the workload through the server's batcher (fast path); ``replicas``:
    copies of ``model`` on other GPUs (each patched), the batcher's workers, as ``serve --devices`` runs them.

    Each client sends its next request as soon as its previous answer is back; the batcher groups whatever is
    waiting under its token budget into one forward. Decisions = answered questions. One unmeasured run over the
    workload first (groups of new shapes autotune / capture there), then the measured run.
    """
    import asyncio

    from hf_openjev.serve.batcher import Batcher
    from hf_openjev.scoring import build_answer

    async def run():
        batcher = Batcher(model, max_queue=4 * max(in_flight, 1), max_wait_ms=max_wait_ms, fast=True,
                          replicas=replicas)
        batcher.start()
        pending = iter(range(len(work)))
        latencies, decisions = [], 0

        async def client():
            nonlocal decisions
            for i in pending:
                prepared = work[i][1]
                start = time.perf_counter()
                outcome = await batcher.submit(prepared)
                build_answer(model, prepared, outcome.scores, seconds=outcome.seconds,
                             prefix_cache=outcome.prefix_cache, method=outcome.method)
                latencies.append((time.perf_counter() - start) * 1000)
                decisions += len(prepared.parsed.questions)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(in_flight)))
        total = time.perf_counter() - start
        await batcher.aclose()
        return {"in_flight": in_flight, "decisions_per_s": decisions / total, "groups": batcher.groups,
                "replica_groups": [r["groups"] for r in batcher.stats()["replicas"]], **summarize(latencies)}

    warm = asyncio.run(run())  # warm-up: batches of new shapes compile / capture here
    before = [graph_stats(m) for m in replicas or [model]]
    result = asyncio.run(run())
    result["warmup_groups"] = warm["groups"]
    after = [graph_stats(m) for m in replicas or [model]]
    if after[0]:
        result["captures_while_measured"] = sum(a["captures"] - b["captures"] for a, b in zip(after, before))
    return result


def graph_stats(model) -> dict | None:
    from hf_openjev.patches import read_graph_stats

    return read_graph_stats(model)


def single_candidate_request(tokens: int):
    """One noul question with one candidate of ``tokens`` random ids (seeded by the length)."""
    from hf_openjev.contract import parse_request
    from hf_openjev.scoring import PreparedRequest

    parsed = parse_request({"state": "x", "questions": {"q": {"type": "noul", "instructions": "x"}}})
    rng = random.Random(tokens)
    return PreparedRequest(parsed, [[[rng.randrange(1000, VOCAB) for _ in range(tokens)]]])


def time_fast_calls(model, request, *, calls: int, options=None) -> list[float]:
    """ms of ``calls`` fast-path calls on ``request``, each timed like run_pass (a device sync at both ends), with
    ``options`` (a FastPathOptions; default: the ones the model is patched with)."""
    from hf_openjev.scoring import score_prepared

    times = []
    for _ in range(calls):
        sync()
        t = time.perf_counter()
        score_prepared(model, [request], fast=True, options=options)
        sync()
        times.append((time.perf_counter() - t) * 1000)
    return times


def time_single(model, tokens: int, *, repeats: int) -> dict:
    """One candidate of ``tokens`` tokens on the fast path: the first call (may autotune / capture) and the median
    of the next ``repeats``, peak memory."""
    reset_peak()
    times = time_fast_calls(model, single_candidate_request(tokens), calls=1 + repeats)
    out = {"tokens": tokens, "first_ms": times[0], "peak_memory_gb": peak_gb()}
    if repeats:
        out["median_ms"] = statistics.median(times[1:])
    return out


def summarize(times_ms: list[float]) -> dict:
    s = sorted(times_ms)
    n = len(s)
    return {"n": n, "mean_ms": statistics.fmean(s), "p50_ms": s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2,
            "p95_ms": s[max(0, int(0.95 * n) - 1)], "max_ms": s[-1]}


def bucket_of(n_tokens: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= n_tokens <= hi:
            return f"{lo}-{hi}"
    return ">16384"


def table(work, times_ms):
    groups: dict[tuple[str, str], list[float]] = {}
    for (item, _), t in zip(work, times_ms):
        longest = item["prefix_tokens"] + max(item["suffix_tokens"])
        groups.setdefault((item["kind"], bucket_of(longest)), []).append(t)
    return {f"{k}|{b}": {"n": len(v), "mean_ms": statistics.fmean(v)} for (k, b), v in sorted(groups.items())}


def probabilities(response) -> list[float]:
    answer = response["answers"]["q"]
    if answer["type"] == "noul":
        return [1 - answer["noul"], answer["noul"]]
    return list(answer["probabilities"].values())


def parity(ref_responses, fast_responses) -> dict:
    max_dp, flips, near_tie_flips = 0.0, 0, 0
    for a, b in zip(ref_responses, fast_responses):
        pa, pb = probabilities(a), probabilities(b)
        max_dp = max(max_dp, max(abs(x - y) for x, y in zip(pa, pb)))
        ia, ib = pa.index(max(pa)), pb.index(max(pb))
        if ia != ib:
            top = sorted(pa, reverse=True)
            if len(top) > 1 and top[0] - top[1] < 0.01:
                near_tie_flips += 1
            else:
                flips += 1
    return {"max_abs_dp": max_dp, "decision_flips": flips, "near_tie_flips": near_tie_flips, "n": len(ref_responses)}


def bind_fla(enabled: bool) -> None:
    """Arm A unbinds fla from the stock module (torch fallback); arm B restores what Transformers bound."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        current = getattr(qwen, name)
        original = getattr(qwen, f"_hf_openjev_bound_{name}", None)
        if original is None:
            setattr(qwen, f"_hf_openjev_bound_{name}", current)
            original = current
        setattr(qwen, name, original if enabled else getattr(original, "__wrapped__", original))


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` when tracked files changed), or None outside a git checkout.

    ``$HF_OPENJEV_COMMIT`` wins: a device run from an exported snapshot of a commit names that commit."""
    import subprocess

    if os.environ.get("HF_OPENJEV_COMMIT"):
        return os.environ["HF_OPENJEV_COMMIT"]

    try:
        def git(*cmd):
            return subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def open_oracle(args, parser):
    """--oracle: the oracle file, read and checked against --shape and --seed before any work (None without it)."""
    if not args.oracle:
        return None
    from hf_openjev.fidelity import load_oracle, verify_oracle_identity

    try:
        oracle = load_oracle(args.oracle)
        verify_oracle_identity(oracle, shape=args.shape, seed=args.seed)
    except (OSError, ValueError) as error:
        parser.error(f"--oracle {args.oracle}: {error}")
    return oracle


def start_fidelity(oracle, model, work, *, args, out: Path, results: dict) -> dict | None:
    """Hash this run's weights (as built, before any patch) and refuse (None, a message) unless they are the
    oracle's; else the context add_fidelity fills: the oracle's entries for this run's requests, token hashes."""
    from hf_openjev.fidelity import hash_tokens, hash_weights, select_requests, verify_oracle_identity

    t0 = time.perf_counter()
    sha = results["weights_sha256"] = hash_weights(model)
    try:
        verify_oracle_identity(oracle, shape=args.shape, seed=args.seed, weights_sha256=sha)
        oracle_requests = select_requests(oracle["requests"], [item["id"] for item, _ in work])
    except ValueError as error:
        print(f"--oracle {args.oracle}: {error}", file=sys.stderr)
        return None
    print(f"weights sha256 {sha} = the oracle's ({time.perf_counter() - t0:.1f} s)", flush=True)
    meta = {"command": results["command"], "versions": results["versions"], "device": results["versions"]["device"],
            "git_commit": git_commit(), "shape": args.shape, "seed": args.seed, "dtype": args.dtype, "fp8": args.fp8,
            "oracle": {"path": str(args.oracle), "complete": oracle.get("complete"), "n_done": len(oracle["requests"]),
                       "git_commit": oracle.get("git_commit"), "device": oracle.get("device")},
            "oracle_sha256_check": {"oracle": oracle["weights_sha256"], "run": sha, "match": True},
            "requests_compared": len(work)}
    return {"oracle_requests": oracle_requests, "tokens_sha256": [hash_tokens(p.tokens) for _, p in work],
            "stats": {}, "out": out, "meta": meta}


def add_fidelity(fidelity: dict, name: str, work, responses) -> None:
    """One configuration's answers against the oracle; rewrites fidelity_<shape>.json/.md/.png with every
    configuration so far, each judged by the gate against B when the run has B."""
    from hf_openjev.fidelity import build_fidelity_report, compare_with_oracle, describe_request, write_fidelity_report

    entries = [describe_request(item["id"], item["kind"], response, tokens_sha256=tokens)
               for (item, _), response, tokens in zip(work, responses, fidelity["tokens_sha256"])]
    stats = fidelity["stats"][name] = compare_with_oracle(fidelity["oracle_requests"], entries)
    report = build_fidelity_report(fidelity["stats"], **fidelity["meta"])
    write_fidelity_report(fidelity["out"], f"fidelity_{fidelity['meta']['shape']}", report)
    print(f"fidelity {name} vs oracle: max {stats.max_abs_dp:.4g}, p99 {stats.p99_abs_dp:.4g}, mean "
          f"{stats.mean_abs_dp:.4g}, {stats.flips} flips (+{stats.near_tie_flips} near-tie); passes "
          f"{report['configurations'][name]['passes']}", flush=True)


def versions() -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"}
    for name in ("triton", "fla"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            info[name] = None
    return info


def add_fp8_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8", default=None, choices=["all", "no-gdn"],
                        help="FP8 projections for the fast path (C, E, sweep, closed loop): the reference arms run "
                             "first on the bf16 weights (and --oracle hashes them), then the model is quantized in "
                             "place (hf_openjev.fp8.swap.quantize_model_fp8); writes bench_<shape>_fp8-<mode>")
    parser.add_argument("--memory-cap-gb", type=float, default=None, metavar="GB",
                        help="with --fp8, on CUDA: torch.cuda.set_per_process_memory_fraction(GB / total) right "
                             "after quantizing, so every fast-path pass runs under it (GB = 1e9 bytes)")


def check_fp8_arguments(parser, args, arms: list[str], c_options, sweep_entries):
    """--fp8: (arms with the reference ones first, C's options with ``fp8``); a sweep entry may not set fp8 (it
    would quantize the model for good in the middle of the run) and --memory-cap-gb needs --fp8."""
    if any("fp8" in entry for entry in sweep_entries):
        parser.error("--sweep: fp8 cannot be swept (quantizing is for good: the next entries would all be FP8); "
                     "use --fp8 MODE, one run per mode")
    if args.memory_cap_gb is not None and (args.fp8 is None or not args.memory_cap_gb > 0):
        parser.error("--memory-cap-gb needs --fp8 and a positive size")
    if args.fp8 is None:
        return arms, c_options
    reference_first = [a for a in arms if a not in ("C", "E")] + [a for a in arms if a in ("C", "E")]
    return reference_first, c_options.replace(fp8=args.fp8)


def bench_stem(args) -> str:
    """``bench_<shape>_<dtype>``, or ``bench_<shape>_fp8-<mode>`` with --fp8."""
    return f"bench_{args.shape}_fp8-{args.fp8}" if args.fp8 else f"bench_{args.shape}_{args.dtype}"


def configuration_name(name: str, args) -> str:
    """The name of an arm or sweep entry in fidelity_<shape>.json: with --fp8 the fast path's are ``fp8-<mode>``
    (C), ``fp8-<mode>-eager`` (E) and ``fp8-<mode> <sweep entry>``; the reference arms keep theirs (bf16)."""
    if not args.fp8 or name in ("A", "B", "A1", "B1"):
        return name
    return {"C": f"fp8-{args.fp8}", "E": f"fp8-{args.fp8}-eager"}.get(name, f"fp8-{args.fp8} {name}")


def weights_gb(model) -> float:
    """GB (1e9) of the model's parameters and buffers, each storage counted once (stacked views share one)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()) / 1e9


def quantize_for_fast_path(model, args, results: dict) -> None:
    """--fp8: quantize the model in place, once (later calls return at once), and record results["fp8"]: mode,
    modules, weights GB before and after, seconds; then --memory-cap-gb caps this process's CUDA memory."""
    if not args.fp8 or "fp8" in results:
        return
    from hf_openjev.fp8.swap import fp8_modules, quantize_model_fp8

    sync()
    start = time.perf_counter()
    count = quantize_model_fp8(model, args.fp8)
    sync()
    info = results["fp8"] = {"mode": args.fp8, "modules": list(fp8_modules(model)), "swapped": count,
                             "seconds": time.perf_counter() - start, "weights_gb_bf16": results["weights_gb"],
                             "weights_gb": weights_gb(model), "memory_cap_gb": None}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 weights' blocks, cached by the allocator
        if args.memory_cap_gb is not None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gb * 1e9 / total))
            info["memory_cap_gb"] = args.memory_cap_gb
    elif args.memory_cap_gb is not None:
        info["memory_cap_note"] = "no CUDA device: the cap was not applied"
    print(f"fp8 {args.fp8}: {count} projections swapped in {info['seconds']:.1f} s; weights "
          f"{info['weights_gb_bf16']:.2f} -> {info['weights_gb']:.2f} GB; memory cap {info['memory_cap_gb']}",
          flush=True)


def parse_arguments(argv):
    """(args, arms, parity_only, sweep entries, --fast-options, --patch-options, C's FastPathOptions, parser),
    everything checked before any work (a bad value: the parser's usage error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="27b")
    parser.add_argument("--arms", default="A,B,C")
    parser.add_argument("--passes", type=int, default=2, help="measured passes for C (A runs one)")
    parser.add_argument("--b-passes", type=int, default=2, help="measured passes for B")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only (smoke runs)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="only requests whose longest candidate sequence has at most this many tokens")
    parser.add_argument("--long-candidate", type=int, default=16384, help="also run one candidate this long on C")
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--single", default="107,3400", help="also time one candidate of each length on C")
    parser.add_argument("--fast-options", default="{}", help="JSON of FastPathOptions (e.g. min_shared_tokens)")
    parser.add_argument("--patch-options", default="{}",
                        help='JSON of FastPathOptions for C and E too, reported apart, e.g. {"compile_elementwise": true}')
    parser.add_argument("--parity-only", default="",
                        help="arms run for parity alone: no warm-up pass, so their times include autotuning and "
                             "are reported as such, never as a measurement (e.g. B, whose speed is measured elsewhere)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="arm C replays CUDA graphs per shape bucket (the library's default on CUDA); "
                             "--no-cuda-graphs measures the eager fast path")
    parser.add_argument("--sweep", default="[]",
                        help='JSON list of score_fast option overrides, e.g. \'[{"min_shared_tokens": 256}, '
                             '{"share_tails": false}]\': after the arms, one warm-up and one measured pass of C per '
                             "entry, over --fast-options (the break-even measurements behind the planner defaults)")
    parser.add_argument("--oracle", default=None,
                        help="an oracle_<shape>.json (recipes/oracle.py): compare every arm and sweep entry with it "
                             "and judge the fidelity gate against B; refused unless the weights are the oracle's")
    add_fp8_arguments(parser)
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    parity_only = {a.strip() for a in args.parity_only.split(",") if a.strip()}
    if not set(arms) <= {"A", "B", "C", "E", "A1", "B1"}:
        parser.error(f"--arms {args.arms!r}: choose among A, B, C, E, A1, B1")
    if not parity_only <= set(arms) or "C" in parity_only:
        parser.error(f"--parity-only {args.parity_only!r}: name arms of --arms other than C (C is what is measured)")
    try:
        sweep_entries = json.loads(args.sweep)
        base_fast_options = json.loads(args.fast_options)
        patch_options = json.loads(args.patch_options)
    except json.JSONDecodeError as error:
        parser.error(f"--sweep / --fast-options / --patch-options must be JSON: {error}")
    if not (isinstance(sweep_entries, list) and all(isinstance(e, dict) for e in sweep_entries)):
        parser.error(f"--sweep {args.sweep!r}: give a JSON list of objects, e.g. '[{{\"min_shared_tokens\": 256}}]'")
    from hf_openjev.fast_options import FastPathOptions

    try:  # C's options, checked (unknown names, bad values) before any work; --cuda-graphs decides cuda_graphs
        c_options = FastPathOptions.from_mapping(base_fast_options, base=FastPathOptions.from_mapping(patch_options))
        c_options = c_options.replace(cuda_graphs=args.cuda_graphs)
        for overrides in sweep_entries:
            c_options.replace(**overrides)
    except ValueError as error:
        parser.error(f"--patch-options / --fast-options / --sweep: {error}")
    arms, c_options = check_fp8_arguments(parser, args, arms, c_options, sweep_entries)
    return args, arms, parity_only, sweep_entries, base_fast_options, patch_options, c_options, parser


def run_sweep(model, work, sweep_entries, c_options, base_fast_options, *, args, arms, results: dict,
              responses: dict, fidelity, save) -> None:
    """--sweep: one warm-up and one measured pass of C per entry (its options over C's), compared with the
    reference arms and the oracle; then C's options again."""
    from hf_openjev.patches import apply_patches

    quantize_for_fast_path(model, args, results)
    sweep = results["sweep"] = {}
    for overrides in sweep_entries:
        apply_patches(model, c_options.replace(**overrides))  # the entry's options, for its passes and singles
        label = json.dumps(overrides, sort_keys=True)
        run_pass(model, work, fast=True)  # warm: new shapes autotune and capture here
        measured = run_pass(model, work, fast=True)
        times = [t * 1000 for t, _ in measured]
        sweep[label] = {**summarize(times), "table": table(work, times), "fast_options": {**base_fast_options, **overrides}}
        if fidelity:
            add_fidelity(fidelity, configuration_name(label, args), work, [r for _, r in measured])
        for ref in ("A", "B"):  # the entry's answers against the reference arms this run has
            if ref in responses:
                sweep[label][f"parity_vs_{ref}"] = parity(responses[ref], [r for _, r in measured])
        if "C" in arms and args.single:  # the singles again on the entry's options, on the same machine
            sweep[label]["single_candidate"] = {n: time_single(model, int(n), repeats=5)
                                                for n in args.single.split(",") if n}
        save()  # after every entry, so a run cut short keeps the entries it finished
        print(f"sweep {label}: mean {sweep[label]['mean_ms']:.1f} ms"
              + "".join(f", parity vs {ref} {sweep[label][f'parity_vs_{ref}']}" for ref in ("A", "B")
                        if f"parity_vs_{ref}" in sweep[label]), flush=True)
    apply_patches(model, c_options)  # back to the options C ran with


def main(argv=None) -> int:
    args, arms, parity_only, sweep_entries, base_fast_options, patch_options, c_options, parser = \
        parse_arguments(argv)
    oracle = open_oracle(args, parser)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes_file = SHAPES_FILE
    results = {"command": " ".join([sys.executable, *sys.argv]), "versions": versions(), "shape": args.shape,
               "arms": {}, "seed": args.seed}

    def save():
        (out / f"{bench_stem(args)}.json").write_text(json.dumps(results, indent=1))

    t0 = time.perf_counter()
    model = build_model(args.shape, seed=args.seed, device="cuda" if torch.cuda.is_available() else "cpu",
                        dtype=getattr(torch, args.dtype))
    results["dtype"] = args.dtype
    results["model_build_s"] = time.perf_counter() - t0
    results["weights_gb"] = weights_gb(model)
    work = build_workload(shapes_file, vocab=VOCAB, seed=args.seed, limit=args.limit, max_length=args.max_length)
    print(f"model {args.shape} built in {results['model_build_s']:.1f}s, {results['weights_gb']:.1f} GB; "
          f"{len(work)} requests", flush=True)
    fidelity = start_fidelity(oracle, model, work, args=args, out=out, results=results) if oracle else None
    if oracle and fidelity is None:
        return 2
    from hf_openjev.patches import apply_patches

    results["cuda_graphs"] = args.cuda_graphs
    results["patch_options"] = patch_options
    results["fast_options"] = base_fast_options
    if "E" in arms and not args.cuda_graphs:
        parser.error("arm E (fast path, eager) is only meaningful beside graph-replayed C (drop --no-cuda-graphs)")
    responses = {}
    for arm in arms:
        fast = arm in ("C", "E")
        if fast:
            quantize_for_fast_path(model, args, results)  # --fp8: once, after the reference arms (bf16)
            record = apply_patches(model, c_options.replace(cuda_graphs=args.cuda_graphs and arm == "C"))
            results.setdefault("effective_patch_options", {})[arm] = record.options.to_dict()  # defaults included
        bind_fla(arm in ("B", "B1"))
        reset_peak()
        start = time.perf_counter()
        passes = []
        batch_size = 1 if arm in ("A1", "B1") else 32
        timed = arm not in parity_only
        if arm not in ("A", "A1", "B1") and timed:
            run_pass(model, work, fast=fast)  # warm-up: autotuning, compilation
        warmup_s = time.perf_counter() - start
        before = graph_stats(model) if arm == "C" else None
        for _ in range({"A": 1, "A1": 1, "B": args.b_passes, "B1": 1, "E": 1}.get(arm, args.passes)):
            passes.append(run_pass(model, work, fast=fast, batch_size=batch_size))
        times = [t * 1000 for p in passes for t, _ in p]
        per_request = [statistics.fmean(p[i][0] * 1000 for p in passes) for i in range(len(work))]
        responses[arm] = [r for _, r in passes[-1]]
        if fidelity:
            add_fidelity(fidelity, configuration_name(arm, args), work, responses[arm])
        results["arms"][arm] = {**summarize(times), "warmup_s": warmup_s, "passes": len(passes),
                                "peak_memory_gb": peak_gb(),
                                "table": table(work, per_request),
                                "per_request_ms": per_request, "parity_only": not timed}
        print(f"arm {arm}{'' if timed else ' (parity only, times include autotuning)'}: "
              + ", ".join(f"{k}={v:.1f}" for k, v in results["arms"][arm].items()
                                         if isinstance(v, float)), flush=True)
        if before is not None:
            stats = graph_stats(model)
            stats["captures_while_measured"] = stats["captures"] - before["captures"]
            results["arms"][arm]["graphs"] = stats
            print(f"graphs: {stats}", flush=True)
        if arm == "C" and args.single:  # right after C's passes, on C's patches, before any other arm runs
            results["single_candidate"] = {}
            for n in [int(x) for x in args.single.split(",") if x]:
                results["single_candidate"][str(n)] = time_single(model, n, repeats=5)
                print(f"single {n}-token candidate: {results['single_candidate'][str(n)]}", flush=True)
        # parity as soon as both sides exist, so a cut-short run keeps it
        for ref, other in (("A", "B"), ("A", "C"), ("B", "C"), ("A", "E"), ("E", "C"), ("A", "A1"), ("B", "B1")):
            key = f"parity_{other}_vs_{ref}"
            if ref in responses and other in responses and key not in results:
                results[key] = parity(responses[ref], responses[other])
                print(f"parity {other} vs {ref}: {results[key]}", flush=True)
        save()
    bind_fla(True)
    for arm in ("A", "B"):
        if "C" in results["arms"] and arm in results["arms"] and not results["arms"][arm]["parity_only"]:
            results[f"speedup_C_over_{arm}"] = results["arms"][arm]["mean_ms"] / results["arms"]["C"]["mean_ms"]
    if "C" in arms:  # the sweep and the closed loop run arm C as measured (graphs on with --cuda-graphs)
        apply_patches(model, c_options)
    if sweep_entries:
        run_sweep(model, work, sweep_entries, c_options, base_fast_options, args=args, arms=arms, results=results,
                  responses=responses, fidelity=fidelity, save=save)
    if "C" in arms:
        concurrency = results["closed_loop"] = {}
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            concurrency[str(c)] = closed_loop(model, work, c)
            save()  # after every level, so a run cut short keeps the levels it finished
            print(f"closed loop, {c} in flight: {concurrency[str(c)]['decisions_per_s']:.1f} decisions/s, "
                  f"p50 {concurrency[str(c)]['p50_ms']:.1f} ms, p95 {concurrency[str(c)]['p95_ms']:.1f} ms", flush=True)
        save()
        if args.long_candidate:
            results["long_candidate"] = time_single(model, args.long_candidate, repeats=1)
            print(f"long candidate: {results['long_candidate']}", flush=True)
    save()
    write_markdown(results, out / f"{bench_stem(args)}.md")
    return 0


def save_table(out: Path, name: str, result: dict, title: str, columns: list[str], rows: list[list]) -> str:
    """Write ``<name>.json`` (the result) and ``<name>.md`` (title, command, versions, one table); return the md."""
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# {title}", "", f"Command: `{result['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(text)
    return text


def fp8_lines(results: dict) -> list[str]:
    """The markdown's FP8 paragraph (nothing without --fp8): mode, weights before/after, the cap, the largest peak
    of the fast path (arms C/E, singles, long candidate)."""
    info = results.get("fp8")
    if not info:
        return []
    peaks = [r["peak_memory_gb"] for arm, r in results["arms"].items() if arm in ("C", "E")]
    peaks += [v["peak_memory_gb"] for v in results.get("single_candidate", {}).values()]
    peaks += [results["long_candidate"]["peak_memory_gb"]] if "long_candidate" in results else []
    peak = max(peaks, default=float("nan"))
    return ["", f"FP8 {info['mode']} (arms C/E, sweep, closed loop; A/B ran first on the bf16 weights): "
                f"{info['swapped']} projections, weights {info['weights_gb_bf16']:.2f} -> {info['weights_gb']:.2f} GB, "
                f"memory cap {info['memory_cap_gb']} GB, fast-path peak {peak:.2f} GB"]


def write_markdown(results: dict, path: Path) -> None:
    lines = [f"# JevBench-231 benchmark, {results['shape']} shape, {results['dtype']}, random weights", "",
             f"Command: `{results['command']}`", "", "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
             "", f"CUDA graphs: {results.get('cuda_graphs')}; patch options: {results.get('patch_options', {})}",
             "", f"Effective patch options (defaults included): {results.get('effective_patch_options', {})}",
             *fp8_lines(results),
             "", "| arm | n | mean ms | p50 ms | p95 ms | warm-up s | passes | peak GB |", "|---|---|---|---|---|---|---|---|"]
    for arm, r in results["arms"].items():
        if r.get("parity_only"):
            lines.append(f"| {arm} | {r['n']} | parity only: no warm-up, times include autotuning | | | | "
                         f"{r['passes']} | {r['peak_memory_gb']:.1f} |")
            continue
        lines.append(f"| {arm} | {r['n']} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | "
                     f"{r['warmup_s']:.1f} | {r['passes']} | {r['peak_memory_gb']:.1f} |")
    for key in ("speedup_C_over_A", "speedup_C_over_B"):
        if key in results:
            lines.append(f"\n{key}: {results[key]:.2f}x")
    for key in ("parity_C_vs_A", "parity_B_vs_A", "parity_C_vs_B", "parity_E_vs_A", "parity_C_vs_E", "parity_A1_vs_A",
                "parity_B1_vs_B"):
        if key in results:
            lines.append(f"\n{key}: {results[key]}")
    for arm, r in results["arms"].items():
        if "graphs" in r:
            lines.append(f"\narm {arm} CUDA graphs: {r['graphs']}")
    for arm, r in results["arms"].items():
        if r.get("parity_only"):
            continue
        lines += ["", f"## arm {arm}: mean ms by kind x longest candidate", "", "| kind / bucket | n | mean ms |",
                  "|---|---|---|"]
        lines += [f"| {k} | {v['n']} | {v['mean_ms']:.1f} |" for k, v in r["table"].items()]
    if results.get("closed_loop"):
        lines += ["", "## closed-loop clients through the server's batcher (arm C)", "",
                  "| in flight | decisions/s | p50 ms | p95 ms | forwards | graph captures while measured |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c} | {v['decisions_per_s']:.1f} | {v['p50_ms']:.1f} | {v['p95_ms']:.1f} | {v['groups']} | "
                  f"{v.get('captures_while_measured', '-')} |" for c, v in results["closed_loop"].items()]
    if "sweep" in results:
        lines += ["", "## sweep of score_fast options (arm C; one warm-up and one measured pass each)", "",
                  "| options (over --fast-options) | mean ms | p50 ms | p95 ms | parity vs A | parity vs B | "
                  "singles, median ms |",
                  "|---|---|---|---|---|---|---|"]

        def parity_cell(p):
            return "-" if p is None else f"{p['max_abs_dp']:.4g}, {p['decision_flips']} flips"

        def singles_cell(singles):
            return " / ".join(f"{n}: {v['median_ms']:.1f}" for n, v in singles.items()) if singles else "-"
        lines += [f"| `{k}` | {v['mean_ms']:.1f} | {v['p50_ms']:.1f} | {v['p95_ms']:.1f} | "
                  f"{parity_cell(v.get('parity_vs_A'))} | {parity_cell(v.get('parity_vs_B'))} | "
                  f"{singles_cell(v.get('single_candidate'))} |"
                  for k, v in results["sweep"].items()]
    for n, v in results.get("single_candidate", {}).items():
        lines.append(f"\nsingle {n}-token candidate (C): median {v['median_ms']:.1f} ms of 5 (first call "
                     f"{v['first_ms']:.1f} ms), peak {v['peak_memory_gb']:.1f} GB")
    if "long_candidate" in results:
        lines.append(f"\nlong candidate: {results['long_candidate']}")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
