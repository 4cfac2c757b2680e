#!/usr/bin/env bash
# GPU runs on an H200 machine without network access, one stage per call, each inside a 10-minute limit.
#
# On a machine with pip and network, once: `bash recipes/device_wheels.sh` downloads the fla-core wheel the GPU
# machine lacks into .whl/ (git-ignored). Then, on the GPU machine, from a copy of the checkout (the tests and the
# benchmarks read only the repository's own data/) with .whl/ beside it:
#
#   bash recipes/gpu_campaign.sh pytest-part NAME...  # e.g. pytest-part quick, or pytest-part 1 2 (two parts of
#                                        # at most 300 s each fit one call): the -m gpu suite's parts listed in
#                                        # recipes/gpu_parts.txt, one pytest process and log (pytest_part_NAME.log)
#                                        # each, with every test's time (--durations=0) and pytest's own counts
#   bash recipes/gpu_campaign.sh pytest-parts  # lists the parts (no setup, no GPU)
#   bash recipes/gpu_campaign.sh pytest [EXPR [TEST FILES...]]   # e.g. pytest "warm_up" tests/test_cuda_graphs.py
#                                        # the -m gpu tests (all of tests/ by default; -k EXPR selects); 560 s at most;
#                                        # prints pytest's own counts (recipes/pytest_counts.sh). The whole suite no
#                                        # longer fits: 538 s of 560 at 6510109; run it in parts
#   bash recipes/gpu_campaign.sh bench   # 27B alone: the default (warm-up + one measured pass), singles of 107 and
#                                        # 3,400 tokens, aligned sharing (the default until s11) as a sweep entry,
#                                        # closed loop at 1 and 8 in flight, the 16,384-token candidate
#   bash recipes/gpu_campaign.sh fidelity SHAPE [--fp8 MODE]  # mid or 27b: B (one pass, for the gate), the
#                                        # default and aligned sharing (with --fp8: the FP8 mode, no sweep) against
#                                        # data/bench/oracle_SHAPE.json.gz: fidelity_SHAPE.{json,md,png}; join the runs
#                                        # of one shape with recipes/merge_fidelity.py
#   bash recipes/gpu_campaign.sh session SHAPE [BENCH OPTIONS]  # 27b, 9b or 2b on the exact workload: B and C
#                                        # in one process (B warmed on every request, so on every shape, before it
#                                        # is timed), singles of 107 and 3,400 tokens, then the same model over
#                                        # HTTP, C then B (recipes/bench_e2e.py; B's 8 warm-up requests suffice
#                                        # there: the in-process B ran every shape; the real tokenizer: .tokcache/
#                                        # carried, or converted there)
#   bash recipes/gpu_campaign.sh family-fidelity SHAPE  # 2b, 9b or 27b: the bench's random weights written as an export
#                                        # (recipes/random_export.py), then `hf-openjev fidelity` on it against
#                                        # data/bench/oracle_SHAPE.json.gz (the estimated workload): B and the default
#   bash recipes/gpu_campaign.sh gate-seeds SHAPE SEED...  # e.g. gate-seeds 2b 1 2: per seed, the fp32 oracle of
#                                        # the bench's random weights and workload of that seed (recipes/oracle.py
#                                        # --seed, --max-seconds: oracle_SHAPE_seedN.json), then family-fidelity
#                                        # with that seed against it (fidelity_SHAPE_seedN.*); an oracle cut by the
#                                        # time limit gets no fidelity: copy the returned oracle_SHAPE_seedN.json to
#                                        # data/bench/ (as it is, or `gzip -9 -n` to .json.gz) and call again (it
#                                        # resumes from data/bench/oracle_SHAPE_seedN.json.gz and .json, each there)
#   bash recipes/gpu_campaign.sh gate-probe SHAPE SEED [NAME=OPTIONS...]  # e.g. gate-probe 2b 1
#                                        # noshare='{"shared_prefix": false}': family-fidelity with that seed against
#                                        # its committed oracle, B, the default and each FastPathOptions JSON, or
#                                        # B1 (the reference path one candidate per forward: the flips rounding alone
#                                        # moves) or aligned (fidelity_SHAPE_seedN_probe.*); a cut run's answers_SHAPE_seedN_probe.json,
#                                        # copied back into .answers/ (git-ignored; carry it), are reused, not answered
#                                        # again. B alone takes ~140 s on a fresh kernel cache (fla autotunes)
#   bash recipes/gpu_campaign.sh gate-probes SPEC...  # e.g. gate-probes 2b:1:B1 2b:2:B1 9b:1:aligned,B1: gate-probe's
#                                        # runs (SHAPE:SEED[:B1,aligned,...], the default always; also one option
#                                        # over the model's defaults by name: nostack, nofused, nofinal, nographs,
#                                        # gdn32, res32, res32gdn32 (both), e.g. 2b:0:B1,nostack,res32) side by side in one call,
#                                        # one process each: the gate times nothing (fla's keys that the carried
#                                        # configurations lack, stock B's among them, are tuned under the others'
#                                        # load and may pick another configuration, as a fresh machine may)
#                                        # (fidelity_SHAPE_seedN_probe.*)
#   bash recipes/gpu_campaign.sh family [SHAPE...]  # 9b and 2b by default: per shape, B and C in one process on the
#                                        # exact workload (no HTTP), B warmed on every request (so on every shape)
#                                        # before it is timed, C's singles; the gate (family-fidelity) and the -m gpu
#                                        # suite (pytest-part) take calls of their own (beside the benches they did not fit)
#   bash recipes/gpu_campaign.sh fingerprints SHAPES...  # e.g. 2b 9b 27b: the weights-hash probe at mid
#                                        # (recipes/weights_hash_probe.py), each committed oracle given the stored
#                                        # weights' fingerprint too (recipes/oracle.py --resume: nothing re-scored;
#                                        # $OUT/fingerprints/oracles/); the first shape, if 2b or 9b,
#                                        # then family-fidelity against its new oracle
#   bash recipes/gpu_campaign.sh divergence SHAPE SEED [OPTIONS] REQUEST...  # e.g. divergence 2b 1 hard-sol-c-judge_hard-08
#                                        # or divergence 9b 0 '{"dense_attention_tokens": 1}' hard-sol-a-trap-06
#                                        # (OPTIONS: FastPathOptions JSON over the shape's defaults):
#                                        # per request of the gate's workload, each layer's error of stock bf16 and of
#                                        # the fast path against stock fp32 (recipes/layer_divergence.py --fp32) on the
#                                        # seed's weights: where a flip comes from
#   bash recipes/gpu_campaign.sh server-time [SHAPE]  # the tokenizer's shortcuts timed on this host
#                                        # (recipes/tokenize_pieces.py: tokenize_pieces.json), then the server's own
#                                        # time per request by phase on this host
#                                        # (recipes/server_time.py, 3 timed passes): the stand-in scorer, then the
#                                        # SHAPE's (default 27b) real forward on the GPU (--shape); server_time.{json,md}
#                                        # under stand-in/ and SHAPE/
#   bash recipes/gpu_campaign.sh sweep SHAPE JSON  # e.g. sweep 2b '[{"packed_candidates": false}]': C (the default)
#                                        # and each FastPathOptions object of the list, one warm-up and one measured
#                                        # pass each, on the exact workload in one process: what a configuration costs
#   bash recipes/gpu_campaign.sh profile # 27B kernel profiles with graphs: a 107- and a 3,400-token candidate and
#                                        # JevBench requests 0, 129, 204, the default and with aligned sharing
#   bash recipes/gpu_campaign.sh varlen-attention [SHAPES...]  # 2b by default: which packed attention kernel
#                                        # rounds as one dense call per sequence does (recipes/varlen_attention_probe.py:
#                                        # FA2 and mem-efficient varlen, stock's padded batch; bit-equal share,
#                                        # differences, graph-replayed time)
#   bash recipes/gpu_campaign.sh warm-ab [SHAPES...]  # the warm-up without answers (patches.warming_up, s26)
#                                        # against the answered one: the capture and warm-up GPU tests, then per shape
#                                        # (2b 27b by default) C's warm-up pass and a measured pass after it
#                                        # (recipes/warmup_breakdown.py --measured-pass), alternated on one kernel
#                                        # cache: answered, unanswered (the first warms the cache), one unanswered
#                                        # run with --record-ops (the recordings' host time per op), answered,
#                                        # unanswered; a 27B run is started only with 120 s left
#   bash recipes/gpu_campaign.sh graph-cut SHAPE [CUT...]  # e.g. graph-cut 27b 2560 2048: C's warm-up pass and a
#                                        # measured pass after it (recipes/warmup_breakdown.py --measured-pass) with
#                                        # packs over CUT tokens eager (FastPathOptions.graph_tokens; default cuts
#                                        # 2560 2048), alternated with the default 4096 on one kernel cache: 4096
#                                        # (warms the cache), each CUT, 4096, each CUT; a run starts only with 120 s left
#   bash recipes/gpu_campaign.sh warmup [SHAPES...]  # C's warm-up split (recipes/warmup_breakdown.py) at 2b 9b 27b
#                                        # (default) on an empty kernel cache, fla's tuned configurations merged into
#                                        # $OUT/warmup/fla_configs/<GPU>/ (copy them to ops/fla_configs/); then the 2B
#                                        # again on an empty cache with those configurations (fla's strict mode),
#                                        # once more on that warm cache, and once with torch.profiler (host time per op):
#                                        # those three only when 2b is among the shapes (they need its keys tuned)
#   bash recipes/gpu_campaign.sh compile-ab [SHAPE]  # 27b by default: C's warm-up with a compile-ahead pass (16
#                                        # threads; recipes/warmup_breakdown.py --compile-threads 16) and without, each
#                                        # first on an emptied kernel cache of its own, then again on that cache (warm):
#                                        # what compiling side by side saves, and what the extra pass costs when there
#                                        # is nothing to compile; a run starts only with 100 s left
#
# How the parts were sized: no earlier log holds per-test times (they ran -v without --durations), so the parts in
# recipes/gpu_parts.txt come from the logs' totals on one H200: the whole suite, 194 tests, 538 s (`git show
# 7c18395:recipes/results/logs/pytest_gpu_6510109.log`; files in order cuda_graphs, fp8_loading, fp8_runtime, the
# ops); test_cuda_graphs.py's six GPU tests alone 126 s (s10, in 2df2afa's tree), one of them alone 93-114 s (s8
# graphs8 in fa774b8, s9 flat9 and profile9 in e40412a and 0db55cc: most of it compiling and autotuning,
# recipes/device_setup.sh); packed attention's 21 tests with five of those 147 s (s9 verify9, 20bf304); the first 150
# tests (cuda_graphs to fp8_linear) within 250 s while sharing the GPU (s11 call5_mid, a447b3e), which leaves
# 250-300 s of the 538 for the chunked GDN op and packed attention, so the GDN op's file is split over parts 1 and 2.
# Estimates, not measurements: the first committed parts log (the lead's; every test's time, --durations=0) confirms
# or moves them, and any part over 300 s is split there.
#
# An empty kernel cache for one stage, whatever ran before it on the machine: KERNEL_CACHE=empty (a fresh Triton cache
# folder; fla's carried configurations still apply, as on a user's fresh machine), e.g.
# `KERNEL_CACHE=empty bash recipes/gpu_campaign.sh family` after a gate run warmed the machine's own cache.
# C's warm-ups with a compile-ahead pass (the bench's --compile-threads N) in the stages that run the bench:
# COMPILE_THREADS=N, e.g. `KERNEL_CACHE=empty COMPILE_THREADS=16 bash recipes/gpu_campaign.sh sweep 27b '[]'`.
#
# Several stages in one call: set CAMPAIGN_ELAPSED_S to the seconds the call has spent before a stage, and its
# limits count from the call's start, not its own (e.g. CAMPAIGN_ELAPSED_S=$SECONDS bash recipes/gpu_campaign.sh ...).
#
# Each stage leaves its files under $OUT/<stage>/ plus a tarball, $OUT/<stage>.tgz (for runners that return few files).
# Put the figures that matter into recipes/RESULTS.md with the command, commit and device; raw output does not stay
# in the tree (RESULTS.md names the commits that hold earlier campaigns' files). Stages run back to back on a warm
# machine reuse its Triton cache (fla's compiled kernels and autotuning results); a fresh machine recompiles.
set -uo pipefail
stages="pytest-part | pytest-parts | pytest | bench | fidelity | session | family-fidelity | gate-probe | gate-probes | gate-seeds | family | fingerprints | divergence | server-time | sweep | profile | warmup | compile-ab | warm-ab | graph-cut | varlen-attention"
stage=${1:?stage: $stages}
shift
case "$stage" in pytest-part|pytest-parts|pytest|bench|fidelity|session|family-fidelity|gate-probe|gate-probes|gate-seeds|family|fingerprints|divergence|server-time|sweep|profile|warmup|compile-ab|warm-ab|graph-cut|varlen-attention) ;; *) echo "unknown stage $stage ($stages)"; exit 2 ;; esac

setup() {  # the carried wheel and this package into /tmp/site (recipes/device_setup.sh); $out; cwd /tmp
  source recipes/device_setup.sh
  export FLA_FLASH_QLA=0
  [ -d "$REPO/.tokcache" ] && export HF_OPENJEV_CACHE="$REPO/.tokcache"  # the converted tokenizer, if carried
  out=${OUT:-/tmp/out}/$stage
  mkdir -p "$out"
  cd /tmp || exit 1
  start=$((SECONDS - ${CAMPAIGN_ELAPSED_S:-0}))  # several stages in one call: the seconds spent before this one
  if [ "${KERNEL_CACHE:-}" = empty ]; then  # this stage on an empty Triton cache, whatever ran before on the machine
    export TRITON_CACHE_DIR=${TMPDIR:-/tmp}/triton_cache_empty_$stage
    rm -rf "$TRITON_CACHE_DIR"
    echo "KERNEL_CACHE=empty: Triton cache $TRITON_CACHE_DIR (fla's carried configurations still apply)"
  fi
}

quiet() { grep --line-buffered -v "Loading\|falling back"; }

gpu_pytest() {  # $1 = time limit (s), $2 = log file under $out, $3 = -k expression ("" = all), then the test files
  local limit=$1 log="$out/$2" expr=$3
  shift 3
  # the device lacks compressed-tensors and starlette: the test files that import them hold no GPU test, so their
  # collection errors are listed (rc 1) without stopping the GPU tests
  timeout "$limit" python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" "$@" -m gpu -k "$expr" -v -s \
    --durations=0 --continue-on-collection-errors -p no:cacheprovider >"$log" 2>&1
  echo "pytest rc=$?" | tee -a "$log"
  bash "$REPO/recipes/pytest_counts.sh" "$log"  # the counts of pytest's own summary line
  grep -E "FAILED|ERROR" "$log" | tail -n 12
}

family_fidelity() {  # $1 = 2b, 9b or 27b (a 51 GB export): the bench's random weights (seed $3, default 0) as an export, then
  # hf-openjev fidelity on it (the workload's ids drawn with that seed) against $2 (default: the committed
  # data/bench/oracle_$1.json.gz); with a seed, the files are named $1_seed$3 (fidelity_2b_seed1.json); $4: the
  # configurations (default: default); $5: a name suffix. Answers carried back in .answers/ are reused
  local shape=$1 oracle=${2:-$REPO/data/bench/oracle_$1.json.gz} seed=${3:-} configs=${4:-default}
  local name=$shape${3:+_seed$3}${5:-}
  local export_dir=/tmp/random-$name
  rm -rf "$export_dir"
  mkdir -p "$out/fidelity$name"
  [ -f "$REPO/.answers/answers_$name.json" ] && cp "$REPO/.answers/answers_$name.json" "$out/fidelity$name/"
  python3 "$REPO/recipes/random_export.py" --shape "$shape" --seed "${seed:-0}" --device cuda --out "$export_dir" 2>&1 \
    | quiet | tail -n 2
  python3 -m hf_openjev fidelity --model "$export_dir" --workload "$REPO/data/bench/jevbench231-shapes-estimated.json" \
    --seed "${seed:-0}" --oracle "$oracle" --configs "$configs" --name "$name" --no-progress \
    --out "$out/fidelity$name" 2>&1 | quiet | tail -n 12
  rm -rf "$export_dir"
  local report  # committed as they are: the recorded command's machine paths cut (the repository's relative ones)
  for report in "$out/fidelity$name"/fidelity_*.json "$out/fidelity$name"/fidelity_*.md; do
    [ -f "$report" ] && sed -i -e "s#$REPO/##g" -e "s#${OUT:-/tmp/out}/#\$OUT/#g" -e "s#/tmp/##g" "$report"
  done
}

family_fidelity_within() {  # $1 = seconds at most, then family_fidelity's arguments: a child shell under timeout,
  # so the stage goes on (its tarball: a cut run's answers) when the limit cuts it
  local limit=$1
  shift
  timeout "$limit" bash -c "$(declare -f family_fidelity quiet); out=$(printf %q "$out") REPO=$(printf %q "$REPO") \
    family_fidelity $(printf '%q ' "$@")"
}

seed_oracle() {  # $1 = shape, $2 = seed: the seed's committed fp32 oracle (seed 0's carries no seed in its name)
  if [ "$2" = 0 ]; then echo "$PWD/data/bench/oracle_$1.json.gz"; else echo "$PWD/data/bench/oracle_${1}_seed$2.json.gz"; fi
}

case "${KERNEL_CACHE:-}" in ""|empty) ;; *) echo "KERNEL_CACHE=$KERNEL_CACHE: unset or empty (an empty Triton cache for this stage)"; exit 2 ;; esac
[[ "${COMPILE_THREADS:-0}" =~ ^[0-9]+$ ]] || { echo "COMPILE_THREADS=$COMPILE_THREADS: a whole number (0: no compile-ahead pass; unset: the package's default)"; exit 2; }
parts_file=$PWD/recipes/gpu_parts.txt  # the one list of the GPU suite's parts (cwd: the repository)
part_entries() {  # $1 = part name: its entries in recipes/gpu_parts.txt, one a line
  awk -v part="$1" '$1 == part { print $2 }' "$parts_file"
}
if [ "$stage" = pytest-parts ]; then  # before setup: no install, no GPU
  for part in $(awk '!/^#/ && NF && !seen[$1]++ { print $1 }' "$parts_file"); do
    echo "$part: $(part_entries "$part" | tr '\n' ' ')"
  done
  exit 0
fi
if [ "$stage" = pytest-part ]; then  # every named part known, before setup
  names=$(awk '!/^#/ && NF && !seen[$1]++ { print $1 }' "$parts_file" | tr '\n' ' ')
  [ $# -gt 0 ] || { echo "pytest-part NAME...: one or more of $names"; exit 2; }
  for part in "$@"; do
    [ -n "$(part_entries "$part")" ] || { echo "unknown part $part (the parts: $names)"; exit 2; }
  done
  parts=("$@")
fi
if [ "$stage" = gate-probe ]; then  # a known shape, a seed with a committed oracle, NAME=JSON options, before setup
  usage="gate-probe SHAPE SEED [NAME=OPTIONS...]: SHAPE 2b or 9b, a seed whose oracle is in data/bench, then configurations: B1, aligned, or NAME='{\"shared_prefix\": false}' (FastPathOptions JSON)"
  case "${1:-}" in 2b|9b) ;; *) echo "$usage"; exit 2 ;; esac
  [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "$usage"; exit 2; }
  probe_shape=$1 probe_seed=$2
  probe_oracle=$(seed_oracle "$1" "$2")
  [ -f "$probe_oracle" ] || { echo "no committed oracle $probe_oracle: run gate-seeds $1 $2 first"; exit 2; }
  shift 2
  probe_dir=${TMPDIR:-/tmp}/gate-probe-configs
  rm -rf "$probe_dir"; mkdir -p "$probe_dir"
  probe_configs=default
  for spec in "$@"; do
    case "$spec" in B1|aligned) probe_configs+=",$spec"; continue ;; esac  # named (hf-openjev fidelity --configs)
    [[ "$spec" =~ ^[A-Za-z0-9_-]+=\{.*\}$ ]] || { echo "configuration $spec: $usage"; exit 2; }
    printf '%s\n' "${spec#*=}" >"$probe_dir/${spec%%=*}.json"
    probe_configs+=",$probe_dir/${spec%%=*}.json"
  done
fi
if [ "$stage" = gate-probes ]; then  # SHAPE:SEED[:NAMED,...] each, with a committed oracle, before setup
  # one option off (or on) over the model's defaults, by name: where a default departs from B (issue 39's 2B)
  declare -A probe_options=([nostack]='{"stacked_projections": false}' [nofused]='{"fused_elementwise": false}'
    [nofinal]='{"final_row_mlp": false}' [nographs]='{"cuda_graphs": false}' [gdn32]='{"gdn_fp32": true}'
    [res32]='{"residual_fp32": true}' [res32gdn32]='{"residual_fp32": true, "gdn_fp32": true}')
  names="B1|aligned|$(printf '%s\n' "${!probe_options[@]}" | sort | paste -sd'|')"
  usage="gate-probes SPEC...: SHAPE:SEED[:CONFIGS], SHAPE 2b or 9b, a seed whose oracle is in data/bench, CONFIGS comma-separated of ${names//|/, }; e.g. 2b:1:B1 9b:1:aligned,B1 2b:0:nostack,nofused"
  [ $# -gt 0 ] || { echo "$usage"; exit 2; }
  probe_dir=${TMPDIR:-/tmp}/gate-probes-configs
  rm -rf "$probe_dir"
  probe_specs=()
  for spec in "$@"; do
    IFS=: read -r p_shape p_seed p_named extra <<<"$spec"
    case "$p_shape" in 2b|9b) ;; *) echo "$spec: $usage"; exit 2 ;; esac
    [[ "$p_seed" =~ ^[0-9]+$ ]] && [ -z "$extra" ] || { echo "$spec: $usage"; exit 2; }
    [[ -z "$p_named" || "$p_named" =~ ^($names)(,($names))*$ ]] || { echo "$spec: $usage"; exit 2; }
    p_oracle=$(seed_oracle "$p_shape" "$p_seed")
    [ -f "$p_oracle" ] || { echo "no committed oracle $p_oracle: run gate-seeds $p_shape $p_seed first"; exit 2; }
    p_configs=default
    for name in ${p_named//,/ }; do  # B1, aligned: hf-openjev fidelity's own names; the others: options files
      if [ -n "${probe_options[$name]:-}" ]; then
        mkdir -p "$probe_dir/${p_shape}_seed$p_seed"
        printf '%s\n' "${probe_options[$name]}" >"$probe_dir/${p_shape}_seed$p_seed/$name.json"
        p_configs+=",$probe_dir/${p_shape}_seed$p_seed/$name.json"
      else
        p_configs+=",$name"
      fi
    done
    probe_specs+=("$p_shape $p_seed $p_oracle $p_configs")
  done
fi
if [ "$stage" = gate-seeds ]; then  # a known shape and one or more seeds, before setup
  usage="gate-seeds SHAPE SEED...: SHAPE 2b or 9b, then one or more seeds (non-negative integers), e.g. 2b 1 2"
  case "${1:-}" in 2b|9b) ;; *) echo "$usage"; exit 2 ;; esac
  gate_shape=$1
  shift
  [ $# -gt 0 ] || { echo "$usage"; exit 2; }
  for seed in "$@"; do [[ "$seed" =~ ^[0-9]+$ ]] || { echo "seed $seed: $usage"; exit 2; }; done
  seeds=("$@")
fi
if [ "$stage" = divergence ]; then  # a shape, a seed and request ids, before setup
  usage="divergence SHAPE SEED [OPTIONS] REQUEST...: SHAPE 2b, 9b or 27b, a seed, FastPathOptions JSON if any, then request ids of the gate's workload"
  case "${1:-}" in 2b|9b|27b) ;; *) echo "$usage"; exit 2 ;; esac
  [[ "${2:-}" =~ ^[0-9]+$ ]] && [ $# -gt 2 ] || { echo "$usage"; exit 2; }
  divergence_options='{}' divergence_shift=0
  case "$3" in
    \{*) divergence_options=$3 divergence_shift=1  # checked by layer_divergence.py before it builds a model
      [ $# -gt 3 ] || { echo "$usage"; exit 2; } ;;
  esac
fi
if [ "$stage" = family ]; then  # known shapes, before setup
  family_shapes=("$@")
  [ $# -eq 0 ] && family_shapes=(9b 2b)
  for shape in "${family_shapes[@]}"; do
    case "$shape" in 2b|9b) ;; *) echo "family [SHAPE...]: 9b and 2b (default: both), got $shape"; exit 2 ;; esac
  done
fi
if [ "$stage" = family-fidelity ]; then  # a known shape, before setup
  case "${1:-}" in 2b|9b|27b) ;; *) echo "family-fidelity SHAPE: 2b, 9b or 27b (27b: a 51 GB export on this disk)"; exit 2 ;; esac
fi
if [ "$stage" = warm-ab ]; then  # known shapes, before setup
  ab_shapes=("$@")
  [ $# -eq 0 ] && ab_shapes=(2b 27b)
  for shape in "${ab_shapes[@]}"; do
    case "$shape" in 2b|9b|27b) ;; *) echo "warm-ab [SHAPE...]: 2b, 9b or 27b (default: 2b 27b), got $shape"; exit 2 ;; esac
  done
fi
if [ "$stage" = compile-ab ]; then  # a known shape, before setup
  compile_shape=${1:-27b}
  case "$compile_shape" in 2b|9b|27b) ;; *) echo "compile-ab [SHAPE]: SHAPE 2b, 9b or 27b (default 27b)"; exit 2 ;; esac
  [ $# -le 1 ] || { echo "compile-ab [SHAPE]: one shape at most"; exit 2; }
fi
if [ "$stage" = graph-cut ]; then  # a known shape and whole numbers, before setup
  cut_shape=${1:-}
  case "$cut_shape" in 2b|9b|27b) ;; *) echo "graph-cut SHAPE [CUT...]: SHAPE 2b, 9b or 27b, then token cuts (default 2560 2048)"; exit 2 ;; esac
  shift
  cuts=("$@")
  [ $# -eq 0 ] && cuts=(2560 2048)
  for cut in "${cuts[@]}"; do
    [[ "$cut" =~ ^[1-9][0-9]*$ ]] || { echo "graph-cut: a cut is a positive whole number of tokens, got $cut"; exit 2; }
  done
fi
if [ "$stage" = server-time ]; then  # a known shape, before setup
  case "${1:-27b}" in 2b|9b|27b) ;; *) echo "server-time [SHAPE]: SHAPE 2b, 9b or 27b (default 27b)"; exit 2 ;; esac
fi
if [ "$stage" = sweep ]; then  # a shape and a JSON list of option objects, before setup
  usage="sweep SHAPE JSON: SHAPE 2b, 9b or 27b, then a JSON list of FastPathOptions objects, e.g. '[{\"cuda_graphs\": false}]'"
  case "${1:-}" in 2b|9b|27b) ;; *) echo "$usage"; exit 2 ;; esac
  [[ "${2:-}" =~ ^\[.*\]$ ]] && [ $# -eq 2 ] || { echo "$usage"; exit 2; }
fi

setup
bench="python3 $REPO/recipes/bench_jevbench.py${COMPILE_THREADS:+ --compile-threads $COMPILE_THREADS}"  # for timeout
case "$stage" in
  pytest)
    expr=${1:-}
    [ $# -gt 0 ] && shift
    files=()
    for f in "$@"; do case "$f" in /*) files+=("$f") ;; *) files+=("$REPO/$f") ;; esac; done  # cwd is /tmp
    [ ${#files[@]} -eq 0 ] && files=("$REPO/tests")
    gpu_pytest 560 pytest_gpu.log "$expr" "${files[@]}" ;;
  pytest-part)
    for part in "${parts[@]}"; do
      entries=()
      while read -r entry; do entries+=("$REPO/$entry"); done < <(part_entries "$part")  # cwd is /tmp
      left=$((585 - (SECONDS - start)))
      [ "$left" -gt 30 ] || { echo "part $part: no time left"; continue; }
      echo "part $part: ${#entries[@]} entries, at $((SECONDS - start)) s"
      gpu_pytest "$left" "pytest_part_$part.log" "" "${entries[@]}"
    done ;;
  bench)
    timeout 570 $bench --shape 27b --arms C --passes 1 --concurrency 1,8 --single 107,3400 --long-candidate 16384 \
      --sweep '[{"share_tails": false, "min_shared_tokens": 64}]' \
      --out "$out/bench27" 2>&1 | quiet | tail -n 16 ;;
  fidelity)
    shape=${1:?fidelity SHAPE: mid or 27b}
    shift
    sweep='[{"share_tails": false, "min_shared_tokens": 64}]'
    [ $# -gt 0 ] && sweep='[]'  # --fp8 MODE: quantizing is for good, so no sweep after it
    timeout 570 $bench --shape "$shape" --arms B,C --parity-only B --passes 1 --b-passes 1 --concurrency "" \
      --single "" --long-candidate 0 --sweep "$sweep" "$@" \
      --oracle "$REPO/data/bench/oracle_$shape.json.gz" --out "$out/$shape" 2>&1 | quiet | grep -E "^arm|fidelity|rror" ;;
  session)
    shape=${1:?session SHAPE: 27b, 9b or 2b}
    shift
    timeout $((590 - (SECONDS - start))) $bench --shape "$shape" --arms B,C --passes 1 --b-passes 1 \
      --concurrency "" --single 107,3400 --long-candidate 0 --e2e C,B \
      --e2e-warmup-requests 8 "$@" --out "$out/$shape" 2>&1 | quiet | grep -vE "^\s*$" | tail -n 40 ;;
  family-fidelity)  # within the call's limit, so the tarball (the answers of a cut run: carry them back in .answers/)
    left=$((585 - (SECONDS - start)))
    [ "$left" -gt 30 ] || { echo "family-fidelity $1: no time left"; exit 0; }
    family_fidelity_within "$left" "$1"
    echo "family-fidelity $1 rc=$? at $((SECONDS - start)) s" ;;
  gate-probe)
    family_fidelity_within $((585 - (SECONDS - start))) "$probe_shape" "$probe_oracle" "$probe_seed" "$probe_configs" \
      _probe
    echo "gate-probe rc=$? at $((SECONDS - start)) s" ;;
  gate-probes)
    pids=()
    for spec in "${probe_specs[@]}"; do
      read -r p_shape p_seed p_oracle p_configs <<<"$spec"
      family_fidelity_within $((585 - (SECONDS - start))) "$p_shape" "$p_oracle" "$p_seed" "$p_configs" _probe \
        >"$out/${p_shape}_seed${p_seed}.log" 2>&1 &
      pids+=($!)
    done
    for i in "${!pids[@]}"; do  # our own children, in order
      wait "${pids[$i]}"
      rc=$?
      read -r p_shape p_seed _ <<<"${probe_specs[$i]}"
      echo "gate-probe $p_shape seed $p_seed rc=$rc at $((SECONDS - start)) s"
      tail -n 12 "$out/${p_shape}_seed${p_seed}.log"
    done ;;
  gate-seeds)
    for seed in "${seeds[@]}"; do  # per seed: its fp32 oracle (resumed from a carried one), then B and the default
      name=${gate_shape}_seed$seed
      left=$((580 - (SECONDS - start)))
      [ "$left" -gt 30 ] || { echo "oracle $name: no time left"; continue; }
      resume=()
      for carried in "$REPO/data/bench/oracle_$name.json.gz" "$REPO/data/bench/oracle_$name.json"; do
        [ -f "$carried" ] && resume+=(--resume "$carried")  # a cut run's file, copied back (gzipped or not)
      done
      timeout "$left" python3 "$REPO/recipes/oracle.py" --shape "$gate_shape" --seed "$seed" "${resume[@]}" \
        --max-seconds $((left - 20)) --out "$out/seed$seed" 2>&1 | quiet >"$out/oracle_$name.log"
      echo "oracle $name rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
      grep -v "^oracle:" "$out/oracle_$name.log" | tail -n 3
      [ -f "$out/seed$seed/oracle_$gate_shape.json" ] && mv "$out/seed$seed/oracle_$gate_shape.json" "$out/oracle_$name.json"
      grep -q "requests, complete$" "$out/oracle_$name.log" || { echo "oracle $name: incomplete, no fidelity"; continue; }
      left=$((580 - (SECONDS - start)))
      [ "$left" -gt 30 ] || { echo "fidelity $name: no time left"; continue; }
      family_fidelity_within "$left" "$gate_shape" "$out/oracle_$name.json" "$seed"
      echo "fidelity $name rc=$? at $((SECONDS - start)) s"
    done ;;
  family)
    for shape in "${family_shapes[@]}"; do  # B warms on all 231 requests: 6510109's H200 took 204 s at 9B, 54 s at 2B
      limit=$([ "$shape" = 9b ] && echo 330 || echo 230)
      left=$((580 - (SECONDS - start)))
      [ "$left" -lt "$limit" ] && limit=$left
      [ "$limit" -gt 30 ] || { echo "bench $shape: no time left"; continue; }
      timeout "$limit" $bench --shape "$shape" --arms B,C --passes 1 --b-passes 1 \
        --concurrency "" --single 107,3400 --long-candidate 0 --out "$out/bench$shape" >"$out/bench$shape.log" 2>&1
      echo "bench $shape rc=$? at $((SECONDS - start)) s"; grep -E "^arm|^single|^parity" "$out/bench$shape.log"
    done ;;
  fingerprints)
    [ $# -gt 0 ] || { echo "fingerprints SHAPES...: e.g. 2b 9b 27b"; exit 2; }
    timeout 120 python3 "$REPO/recipes/weights_hash_probe.py" --shape mid --device cuda --out /tmp/hash-probe 2>&1 \
      | quiet | tail -n 20
    first=$1
    for shape in "$@"; do
      left=$((580 - (SECONDS - start)))
      [ "$left" -gt 30 ] || { echo "oracle $shape: no time left"; continue; }
      timeout "$left" python3 "$REPO/recipes/oracle.py" --shape "$shape" --resume "$REPO/data/bench/oracle_$shape.json.gz" \
        --out "$out/oracles" 2>&1 | quiet | grep -v "^oracle:" | tail -n 3
      echo "oracle $shape rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
      if [ "$shape" = "$first" ] && { [ "$shape" = 2b ] || [ "$shape" = 9b ]; }; then  # the new oracle, at once
        family_fidelity_within $((580 - (SECONDS - start))) "$shape" "$out/oracles/oracle_$shape.json"
        echo "family-fidelity $shape rc=$? at $((SECONDS - start)) s"
      fi
    done ;;
  divergence)
    shape=$1 seed=$2
    shift 2
    shift "$divergence_shift"  # the options, given before the requests
    for request in "$@"; do
      left=$((580 - (SECONDS - start)))
      [ "$left" -gt 30 ] || { echo "$request: no time left"; continue; }
      timeout "$left" python3 "$REPO/recipes/layer_divergence.py" --shape "$shape" --seed "$seed" --request "$request" \
        --patch-options "$divergence_options" --fp32 --out "$out" 2>&1 | quiet | tail -n 80
      echo "$request rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
    done ;;
  server-time)
    shape=${1:-27b}
    timeout 120 python3 "$REPO/recipes/tokenize_pieces.py" --rounds 6 2>&1 | grep "^{" >"$out/tokenize_pieces.json"
    echo "tokenize_pieces rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"  # the tokenizer's shortcuts on this host
    timeout 150 python3 "$REPO/recipes/server_time.py" --repeats 3 --out "$out/stand-in" 2>&1 | quiet | tail -n 18
    echo "stand-in rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
    timeout $((585 - (SECONDS - start))) python3 "$REPO/recipes/server_time.py" --shape "$shape" --repeats 3 \
      --out "$out/$shape" 2>&1 | quiet | tail -n 18
    echo "$shape rc=${PIPESTATUS[0]} at $((SECONDS - start)) s" ;;
  sweep)
    timeout $((585 - (SECONDS - start))) $bench --shape "$1" --arms C --passes 1 --concurrency "" --single "" \
      --long-candidate 0 --sweep "$2" --out "$out/$1" 2>&1 | quiet | grep -E "^arm|^sweep|rror" ;;
  profile)
    timeout $((575 - (SECONDS - start))) python3 "$REPO/recipes/profile_forward.py" --shape 27b --tokens 107,3400 \
      --requests 0,129,204 --fast-options '{}' '{"share_tails": false, "min_shared_tokens": 64}' \
      --out "$out/profile" 2>&1 | quiet | tail -n 12 ;;
  varlen-attention)
    for shape in ${*:-2b}; do
      timeout $((580 - (SECONDS - start))) python3 "$REPO/recipes/varlen_attention_probe.py" --shape "$shape" \
        --out "$out" 2>&1 | quiet | tail -n 40
    done ;;
  compile-ab)
    breakdown="python3 $REPO/recipes/warmup_breakdown.py"
    caches=${TMPDIR:-/tmp}
    rm -rf "$caches/tc_compile_ahead" "$caches/tc_compile_plain"  # both arms start cold, on caches of their own
    for run in ahead:cold plain:cold ahead:warm plain:warm; do
      arm=${run%%:*}
      left=$((580 - (SECONDS - start)))
      [ "$left" -gt 100 ] || { echo "compile-ab $run: no time left"; continue; }
      threads=0
      [ "$arm" = ahead ] && threads=16
      TRITON_CACHE_DIR="$caches/tc_compile_$arm" timeout "$left" $breakdown --shape "$compile_shape" \
        --compile-threads "$threads" --out "$out/${arm}_${run#*:}" 2>&1 | quiet \
        | grep -E "whole pass|capture|compiles|loads|Compile-ahead|^- " | head -n 20
      echo "compile-ab $run rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
    done ;;
  warm-ab)
    gpu_pytest 170 pytest_capture.log "probe or graph_replay_matches_eager or unanswered or warm_up_captures" \
      "$REPO/tests/test_cuda_graphs.py"
    n=0
    for shape in "${ab_shapes[@]}"; do
      need=$([ "$shape" = 27b ] && echo 120 || echo 50)
      for run in answered unanswered record-ops answered unanswered; do  # the op split before the second pair
        n=$((n + 1))
        left=$((585 - (SECONDS - start)))
        [ "$left" -gt "$need" ] || { echo "$shape $run: no time left"; continue; }
        flags=(--measured-pass)
        [ "$run" = answered ] && flags+=(--answered)
        [ "$run" = record-ops ] && flags=(--record-ops)
        timeout "$left" python3 "$REPO/recipes/warmup_breakdown.py" --shape "$shape" "${flags[@]}" \
          --out "$out/$n-$shape-$run" 2>&1 | quiet | grep -E "^\| (whole|captures|- capture|other)|^Measured" | tr '\n' ' '
        echo "<- $n $shape $run rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
      done
    done ;;
  graph-cut)
    n=0
    for cut in 4096 "${cuts[@]}" 4096 "${cuts[@]}"; do  # the first run warms the kernel cache
      n=$((n + 1))
      left=$((585 - (SECONDS - start)))
      [ "$left" -gt 120 ] || { echo "$cut_shape graph_tokens $cut: no time left"; continue; }
      timeout "$left" python3 "$REPO/recipes/warmup_breakdown.py" --shape "$cut_shape" --measured-pass \
        --fast-options "{\"graph_tokens\": $cut}" --out "$out/$n-$cut_shape-$cut" 2>&1 | quiet \
        | grep -E "^\| (whole|captures|- capture|other)|^Measured" | tr '\n' ' '
      echo "<- $n $cut_shape graph_tokens $cut rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
    done ;;
  warmup)
    breakdown="python3 $REPO/recipes/warmup_breakdown.py"
    caches=${TMPDIR:-/tmp}
    rm -rf "$caches/tc_empty" "$caches/tc_carried"  # empty even on a machine an earlier call of this stage left warm
    warm_shapes=(${*:-2b 9b 27b})
    for shape in "${warm_shapes[@]}"; do  # one process a shape, one kernel cache for all (fla tunes per head shape)
      TRITON_CACHE_DIR="$caches/tc_empty" timeout $((540 - (SECONDS - start))) $breakdown --shape "$shape" \
        --out "$out/$shape" --dump-fla-configs "$out/fla_configs" 2>&1 | quiet | tail -n 12
    done
    gpu=$(ls "$out/fla_configs" 2>/dev/null | head -n 1)
    case " ${warm_shapes[*]} " in  # the configurations just tuned hold the 2B's keys only when the 2B ran (s28:
      *" 2b "*) ;;                  # after 27b 9b alone, its "carried" run autotuned 6 keys for 42 s)
      *) [ -n "$gpu" ] && echo "no 2B runs with the configurations just tuned: 2b is not among the shapes"; gpu="" ;;
    esac
    for cache in empty warm; do  # the 2B with the configurations just tuned: an empty kernel cache, then that one warm
      [ -n "$gpu" ] && [ $((SECONDS - start)) -lt 480 ] || break
      FLA_CONFIG_DIR="$out/fla_configs/$gpu" FLA_CACHE_MODE=strict TRITON_CACHE_DIR="$caches/tc_carried" \
        timeout $((570 - (SECONDS - start))) $breakdown --shape 2b --out "$out/2b-carried-$cache" 2>&1 | quiet | tail -n 12
    done
    if [ -n "$gpu" ] && [ $((SECONDS - start)) -lt 500 ]; then  # where a warm warm-up's host time goes, per op
      FLA_CONFIG_DIR="$out/fla_configs/$gpu" FLA_CACHE_MODE=strict TRITON_CACHE_DIR="$caches/tc_carried" \
        timeout $((580 - (SECONDS - start))) $breakdown --shape 2b --op-profile --out "$out/2b-carried-warm-ops" \
        2>&1 | quiet | tail -n 50  # (the profiler slows the host: its whole-pass time is not a warm-up figure)
    fi ;;
esac
tar czf "${OUT:-/tmp/out}/$stage.tgz" -C "$out" .
case "$stage" in family|session|fingerprints|gate-seeds|gate-probe|gate-probes) rm -rf "$out" ;; esac  # many files: the tarball alone comes back
ls -la "${OUT:-/tmp/out}"
