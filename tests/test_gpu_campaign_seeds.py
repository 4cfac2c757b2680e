"""recipes/gpu_campaign.sh's gate-seeds stage run on the CPU with a stand-in python3 (a PATH shim that records
its arguments): per seed the oracle, the export and ``hf-openjev fidelity`` get that seed, and bad calls are
refused before setup; a cut run's oracle carried back into data/bench/ is resumed whether gzipped or not; every
committed oracle a stage names (data/bench/oracle_<shape>.json.gz) is in the checkout; gate-probe judges options
files against a seed's committed oracle (gate-probes: several such runs side by side) and puts carried answers where the command reuses them; server-time runs
the stand-in, then the shape's real forward, and refuses an unknown shape before setup; divergence runs the layer
comparison against fp32 per request; family runs the 9B's and 2B's benches alone, B warmed on every request; warm-ab alternates answered and unanswered warm-ups;
graph-cut alternates the default graph_tokens with each cut; compile-ab runs warm-ups with and without a
compile-ahead pass, each cold on an emptied cache of its own and then warm on it;
warmup re-runs the 2B on the configurations it tuned only when it tuned the 2B's."""

import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COPIED = ["recipes/gpu_campaign.sh", "recipes/device_setup.sh", "recipes/gpu_parts.txt", "recipes/pytest_counts.sh"]

# the stand-in: one line of arguments per call in $CALLS; oracle.py writes <out>/oracle_<shape>.json and reports
# it complete unless its seed is in $INCOMPLETE
SHIM = r"""#!/usr/bin/env bash
echo "$*" >>"$CALLS"
echo "${TRITON_CACHE_DIR:-unset}" >>"$CALLS.triton"
case "$*" in
  *"hf_openjev fidelity"*)  # a report that records the command, machine paths and all, as the command does
    while [ $# -gt 0 ]; do case "$1" in --out) dir=$2 ;; --name) name=$2 ;; esac; shift; done
    mkdir -p "$dir"; echo "{\"command\": \"$(tail -n 1 "$CALLS")\"}" >"$dir/fidelity_$name.json"
    tail -n 1 "$CALLS" >"$dir/fidelity_$name.md"; exit 0 ;;
  *oracle.py*) ;;
  *"--dump-fla-configs "*)  # warmup_breakdown.py writes the tuned configurations under a folder per GPU
    while [ $# -gt 0 ]; do case "$1" in --dump-fla-configs) mkdir -p "$2/NVIDIA_H100_80GB_HBM3" ;; esac; shift; done
    exit 0 ;;
  *) exit 0 ;;
esac
while [ $# -gt 0 ]; do
  case "$1" in --out) dir=$2 ;; --shape) shape=$2 ;; --seed) seed=$2 ;; esac
  shift
done
mkdir -p "$dir"; echo '{}' >"$dir/oracle_$shape.json"
case " $INCOMPLETE " in *" $seed "*) echo "$dir/oracle_$shape.json: 3/9 requests, stopped: --max-seconds" ;;
  *) echo "$dir/oracle_$shape.json: 9/9 requests, complete" ;; esac
"""


def run_stage(tmp_path: Path, *args: str, incomplete: str = "", carried: tuple[str, ...] = (), **env_extra: str):
    """Run ``gpu_campaign.sh args`` in a copy of the recipes under tmp_path/repo; (result, the calls (list of
    argument strings), the out folder)."""
    repo = tmp_path / "repo"
    for rel in COPIED:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, repo / rel)
    for name in carried:
        (repo / "data" / "bench").mkdir(parents=True, exist_ok=True)
        (repo / "data" / "bench" / name).write_text("{}")
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(SHIM)
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    calls, out = tmp_path / "calls.txt", tmp_path / "out"
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "CALLS": str(calls), "OUT": str(out),
           "INCOMPLETE": incomplete, **env_extra}
    result = subprocess.run(["bash", "recipes/gpu_campaign.sh", *args], cwd=repo, env=env, capture_output=True,
                            text=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return result, lines, out


def script_calls(lines: list[str], script: str) -> list[str]:
    return [line for line in lines if script in line]


@pytest.mark.parametrize("carried", [("oracle_2b_seed2.json",), ("oracle_2b_seed2.json.gz",),
                                     ("oracle_2b_seed2.json.gz", "oracle_2b_seed2.json")])
def test_each_seed_gets_its_oracle_export_and_fidelity(tmp_path, carried):
    result, lines, out = run_stage(tmp_path, "gate-seeds", "2b", "1", "2", incomplete="2", carried=carried)
    assert result.returncode == 0, result.stdout + result.stderr
    oracles = script_calls(lines, "recipes/oracle.py")
    assert len(oracles) == 2
    assert "--shape 2b --seed 1 --max-seconds" in oracles[0] and f"--out {out}/gate-seeds/seed1" in oracles[0]
    assert "--resume" not in oracles[0]
    resumed = re.findall(r"--resume (\S+)", oracles[1])
    assert "--seed 2 --resume" in oracles[1] and len(resumed) == len(carried), oracles[1]
    assert sorted(resumed) == sorted(f"{tmp_path}/repo/data/bench/{name}" for name in carried), resumed
    exports = script_calls(lines, "random_export.py")
    assert len(exports) == 1 and "--shape 2b --seed 1 " in exports[0]  # seed 2's oracle was cut: no fidelity
    fidelity = script_calls(lines, "-m hf_openjev fidelity")
    assert len(fidelity) == 1
    for part in ("--seed 1 ", f"--oracle {out}/gate-seeds/oracle_2b_seed1.json", "--name 2b_seed1",
                 f"--out {out}/gate-seeds/fidelity2b_seed1"):
        assert part in fidelity[0], (part, fidelity[0])
    assert "oracle 2b_seed2: incomplete, no fidelity" in result.stdout
    with tarfile.open(out / "gate-seeds.tgz") as tar:
        names = set(tar.getnames())
    assert {"./oracle_2b_seed1.json", "./oracle_2b_seed2.json", "./oracle_2b_seed1.log"} <= names, names


@pytest.mark.parametrize("shape", ["9b", "27b"])
def test_family_fidelity_keeps_seed_zero_and_its_names(tmp_path, shape):
    result, lines, out = run_stage(tmp_path, "family-fidelity", shape)
    assert result.returncode == 0, result.stdout + result.stderr
    (export,) = script_calls(lines, "random_export.py")
    (fidelity,) = script_calls(lines, "-m hf_openjev fidelity")
    assert f"--shape {shape} --seed 0 " in export
    assert "--seed 0 " in fidelity and f"--name {shape} " in fidelity
    assert f"data/bench/oracle_{shape}.json.gz " in fidelity
    assert f"--out {out}/family-fidelity/fidelity{shape}" in fidelity


@pytest.mark.parametrize("args", [("family-fidelity",), ("family-fidelity", "mid"), ("family-fidelity", "4b")])
def test_family_fidelity_refuses_an_unknown_shape_before_setup(tmp_path, args):
    result, lines, _ = run_stage(tmp_path, *args)
    assert result.returncode == 2 and "family-fidelity SHAPE: 2b, 9b or 27b" in result.stdout, result.stdout
    assert lines == []  # no pip, no python: setup never ran


def test_family_fidelity_keeps_within_the_calls_limit(tmp_path):
    """family-fidelity runs under the call's remaining time (a 27B export and two passes may not fit): past it, nothing
    starts, and the tarball is still written."""
    result, lines, out = run_stage(tmp_path, "family-fidelity", "27b", CAMPAIGN_ELAPSED_S="570")
    assert result.returncode == 0 and "family-fidelity 27b: no time left" in result.stdout, result.stdout
    assert lines == [] or not script_calls(lines, "random_export.py")
    result, lines, out = run_stage(tmp_path, "family-fidelity", "27b")
    assert "family-fidelity 27b rc=0" in result.stdout and (out / "family-fidelity.tgz").is_file()


def test_kernel_cache_empty_gives_the_stage_a_fresh_triton_cache(tmp_path):
    """KERNEL_CACHE=empty: the stage's processes get a Triton cache folder of their own, emptied first (a cold
    warm-up after a gate run warmed the machine); another value is refused before setup."""
    tmpdir = tmp_path / "tmpd"
    stale = tmpdir / "triton_cache_empty_family" / "stale.cubin"
    stale.parent.mkdir(parents=True)
    stale.write_text("x")
    result, lines, _ = run_stage(tmp_path, "family", "2b", KERNEL_CACHE="empty", TMPDIR=str(tmpdir))
    assert result.returncode == 0, result.stdout + result.stderr
    benches = [i for i, line in enumerate(lines) if "bench_jevbench.py" in line]
    caches = (tmp_path / "calls.txt.triton").read_text().splitlines()
    assert len(benches) == 1 and caches[benches[0]] == str(stale.parent)
    assert not stale.exists()  # Triton makes the folder again on its first compile
    result, lines, _ = run_stage(tmp_path, "family", "2b")
    caches = (tmp_path / "calls.txt.triton").read_text().splitlines()
    assert caches[-1] == "/tmp/triton_cache"  # device_setup.sh's, kept between calls on a warm machine
    (tmp_path / "calls.txt").unlink()
    result, lines, _ = run_stage(tmp_path, "family", "2b", KERNEL_CACHE="cold")
    assert result.returncode == 2 and "KERNEL_CACHE=cold" in result.stdout and lines == []


def test_a_stage_after_others_in_one_call_counts_their_seconds(tmp_path):
    """CAMPAIGN_ELAPSED_S: a stage run after others in one call keeps within the call's limit, not its own."""
    result, lines, _ = run_stage(tmp_path, "gate-seeds", "2b", "1", CAMPAIGN_ELAPSED_S="560")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "oracle 2b_seed1: no time left" in result.stdout
    assert script_calls(lines, "recipes/oracle.py") == []
    result, lines, _ = run_stage(tmp_path, "gate-seeds", "2b", "1", CAMPAIGN_ELAPSED_S="0")
    assert len(script_calls(lines, "recipes/oracle.py")) == 1


def test_a_bad_shape_or_no_seed_is_refused_before_setup(tmp_path):
    for args in (["gate-seeds"], ["gate-seeds", "27b", "1"], ["gate-seeds", "2b"], ["gate-seeds", "9b", "1", "x"]):
        result, lines, _ = run_stage(tmp_path, *args)
        assert result.returncode == 2 and "gate-seeds SHAPE SEED..." in result.stdout, (args, result.stdout)
        assert lines == [], (args, lines)  # no pip, no python: setup never ran


@pytest.mark.parametrize("args", [("fidelity", "mid"), ("fidelity", "27b"), ("family-fidelity", "2b"),
                                  ("fingerprints", "2b", "9b", "27b")])
def test_every_committed_oracle_a_stage_names_is_in_the_checkout(tmp_path, args):
    result, lines, _ = run_stage(tmp_path, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    named = re.findall(r"/data/bench/(oracle_\S+)", "\n".join(lines))
    assert len(named) == len(args) - 1, (named, lines)  # one committed oracle per shape
    missing = [name for name in named if not (REPO / "data" / "bench" / name).is_file()]
    assert not missing, missing


def test_gate_probe_judges_each_options_file_against_the_seeds_committed_oracle(tmp_path):
    """gate-probe 2b 1 NAME=JSON...: the default and one FastPathOptions file per NAME, the seed's committed oracle,
    files named 2b_seed1_probe; answers carried back in .answers/ are put where the command reuses them."""
    carried = tmp_path / "repo" / ".answers" / "answers_2b_seed1_probe.json"
    carried.parent.mkdir(parents=True)
    carried.write_text('{"carried": true}')
    result, lines, out = run_stage(tmp_path, "gate-probe", "2b", "1", 'noshare={"shared_prefix": false}', "B1",
                                   'fp32gdn={"gdn_fp32": true}', carried=("oracle_2b_seed1.json.gz",))
    assert result.returncode == 0, result.stdout + result.stderr
    (export,) = script_calls(lines, "random_export.py")
    (fidelity,) = script_calls(lines, "-m hf_openjev fidelity")
    assert "--shape 2b --seed 1 " in export
    configs = re.search(r"--configs (\S+)", fidelity).group(1).split(",")
    assert configs[:3:2] == ["default", "B1"] and [Path(configs[i]).name for i in (1, 3)] == ["noshare.json",
                                                                                                 "fp32gdn.json"]
    assert [json.loads(Path(configs[i]).read_text()) for i in (1, 3)] == [{"shared_prefix": False},
                                                                          {"gdn_fp32": True}]
    assert f"--oracle {tmp_path}/repo/data/bench/oracle_2b_seed1.json.gz " in fidelity
    assert "--name 2b_seed1_probe " in fidelity and "--seed 1 " in fidelity
    with tarfile.open(out / "gate-probe.tgz") as tar:
        answers = tar.extractfile("./fidelity2b_seed1_probe/answers_2b_seed1_probe.json").read()
    assert answers == b'{"carried": true}'
    with tarfile.open(out / "gate-probe.tgz") as tar:  # committed as they come back: no machine path in them
        reports = [tar.extractfile(f"./fidelity2b_seed1_probe/fidelity_2b_seed1_probe.{ext}").read().decode()
                   for ext in ("json", "md")]
    for report in reports:
        assert "--workload data/bench/jevbench231-shapes-estimated.json " in report
        assert "--oracle data/bench/oracle_2b_seed1.json.gz " in report and "--out $OUT/gate-probe/" in report
        assert str(tmp_path) not in report and "/tmp/" not in report, report
    assert json.loads(reports[0])["command"].startswith("-m hf_openjev fidelity --model random-2b_seed1_probe ")


@pytest.mark.parametrize("args, message", [
    (("gate-probe", "27b", "1"), "gate-probe SHAPE SEED"),
    (("gate-probe", "2b", "x"), "gate-probe SHAPE SEED"),
    (("gate-probe", "2b", "7"), "no committed oracle"),  # no data/bench/oracle_2b_seed7.json.gz
    (("gate-probe", "2b", "0", "noshare"), "configuration noshare: gate-probe SHAPE SEED"),
    (("gate-probe", "2b", "0", "a b={}"), "configuration a b={}"),
])
def test_gate_probe_refuses_bad_calls_before_setup(tmp_path, args, message):
    result, lines, _ = run_stage(tmp_path, *args, carried=("oracle_2b.json.gz",))
    assert result.returncode == 2 and message in result.stdout, (args, result.stdout)
    assert lines == [], (args, lines)


def test_gate_probes_run_side_by_side_each_against_its_seeds_oracle(tmp_path):
    """gate-probes 2b:1:B1 2b:2 9b:0:aligned,B1: one export and one ``hf-openjev fidelity`` per spec (the default
    always, then the named configurations), each against its seed's committed oracle, files named SHAPE_seedN_probe,
    all in one tarball; each run's answers carried back in .answers/ are put where its command reuses them."""
    carried = tmp_path / "repo" / ".answers" / "answers_2b_seed2_probe.json"
    carried.parent.mkdir(parents=True)
    carried.write_text('{"carried": true}')
    result, lines, out = run_stage(tmp_path, "gate-probes", "2b:1:B1", "2b:2", "9b:0:aligned,B1",
                                   carried=("oracle_2b_seed1.json.gz", "oracle_2b_seed2.json.gz", "oracle_9b.json.gz"))
    assert result.returncode == 0, result.stdout + result.stderr
    exports = sorted(script_calls(lines, "random_export.py"))
    assert [re.search(r"--shape (\S+) --seed (\d+)", e).groups() for e in exports] == [("2b", "1"), ("2b", "2"),
                                                                                      ("9b", "0")]
    runs = {re.search(r"--name (\S+)", f).group(1): f for f in script_calls(lines, "-m hf_openjev fidelity")}
    assert set(runs) == {"2b_seed1_probe", "2b_seed2_probe", "9b_seed0_probe"}
    assert "--configs default,B1 " in runs["2b_seed1_probe"] and "--configs default " in runs["2b_seed2_probe"]
    assert "--configs default,aligned,B1 " in runs["9b_seed0_probe"]
    assert f"--oracle {tmp_path}/repo/data/bench/oracle_2b_seed2.json.gz " in runs["2b_seed2_probe"]
    assert f"--oracle {tmp_path}/repo/data/bench/oracle_9b.json.gz " in runs["9b_seed0_probe"]
    done = [line.split(" at ")[0] for line in result.stdout.splitlines() if line.startswith("gate-probe ")]
    assert done == ["gate-probe 2b seed 1 rc=0", "gate-probe 2b seed 2 rc=0", "gate-probe 9b seed 0 rc=0"]
    with tarfile.open(out / "gate-probes.tgz") as tar:
        names = tar.getnames()
        assert tar.extractfile("./fidelity2b_seed2_probe/answers_2b_seed2_probe.json").read() == b'{"carried": true}'
    for name in ("2b_seed1_probe", "2b_seed2_probe", "9b_seed0_probe"):
        assert f"./fidelity{name}/fidelity_{name}.json" in names


def test_gate_probes_name_one_option_over_the_defaults(tmp_path):
    """gate-probes 2b:0:B1,nostack,gdn32 9b:1:nofused: hf-openjev fidelity's own names as they are, the others as
    an options file each (one option over the model's defaults), per spec."""
    result, lines, _ = run_stage(tmp_path, "gate-probes", "2b:0:B1,nostack,gdn32,res32,res32gdn32", "9b:1:nofused",
                                 carried=("oracle_2b.json.gz", "oracle_9b_seed1.json.gz"))
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {re.search(r"--name (\S+)", f).group(1): f for f in script_calls(lines, "-m hf_openjev fidelity")}
    configs = {name: re.search(r"--configs (\S+)", run).group(1).split(",") for name, run in runs.items()}
    two, nine = configs["2b_seed0_probe"], configs["9b_seed1_probe"]
    assert two[:2] == ["default", "B1"] and [Path(c).name for c in two[2:]] == ["nostack.json", "gdn32.json",
                                                                               "res32.json", "res32gdn32.json"]
    assert [json.loads(Path(c).read_text()) for c in two[2:]] == [{"stacked_projections": False}, {"gdn_fp32": True},
                                                                      {"residual_fp32": True},
                                                                      {"residual_fp32": True, "gdn_fp32": True}]
    assert nine[0] == "default" and json.loads(Path(nine[1]).read_text()) == {"fused_elementwise": False}
    assert Path(nine[1]).parent != Path(two[2]).parent  # a folder per spec


@pytest.mark.parametrize("args, message", [
    (("gate-probes",), "gate-probes SPEC..."),
    (("gate-probes", "27b:1"), "27b:1: gate-probes SPEC"),
    (("gate-probes", "2b:x"), "2b:x: gate-probes SPEC"),
    (("gate-probes", "2b:0:noshare"), "2b:0:noshare: gate-probes SPEC"),
    (("gate-probes", "2b:0:B1,nostack,x"), "2b:0:B1,nostack,x: gate-probes SPEC"),
    (("gate-probes", "2b:0:B1:x"), "2b:0:B1:x: gate-probes SPEC"),
    (("gate-probes", "2b:0", "2b:7"), "no committed oracle"),
])
def test_gate_probes_refuse_bad_calls_before_setup(tmp_path, args, message):
    result, lines, _ = run_stage(tmp_path, *args, carried=("oracle_2b.json.gz",))
    assert result.returncode == 2 and message in result.stdout, (args, result.stdout)
    assert lines == [], (args, lines)


def test_server_time_runs_the_stand_in_then_the_shapes_forward(tmp_path):
    result, lines, out = run_stage(tmp_path, "server-time", "9b")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = script_calls(lines, "server_time.py")
    assert len(runs) == 2 and "--shape" not in runs[0] and f"--out {out}/server-time/stand-in" in runs[0]
    assert f"--shape 9b --repeats 3 --out {out}/server-time/9b" in runs[1]
    assert (out / "server-time.tgz").is_file()


def test_server_time_defaults_to_27b_and_refuses_another_shape_before_setup(tmp_path):
    _, lines, _ = run_stage(tmp_path / "default", "server-time")
    assert "--shape 27b" in script_calls(lines, "server_time.py")[1]
    result, lines, _ = run_stage(tmp_path / "bad", "server-time", "70b")
    assert result.returncode == 2 and "server-time [SHAPE]" in result.stdout and lines == []


def test_divergence_compares_each_request_with_fp32_on_the_seeds_weights(tmp_path):
    result, lines, out = run_stage(tmp_path, "divergence", "2b", "1", "req-a", "req-b")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = script_calls(lines, "layer_divergence.py")
    assert [r.split("--request ")[1].split()[0] for r in runs] == ["req-a", "req-b"]
    assert all("--shape 2b --seed 1 " in r and " --fp32 " in r and "--patch-options {}" in r for r in runs)
    assert (out / "divergence.tgz").is_file()


def test_divergence_takes_fast_path_options_before_the_requests(tmp_path):
    options = '{"dense_attention_tokens": 1}'
    result, lines, _ = run_stage(tmp_path, "divergence", "9b", "0", options, "req-a")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = script_calls(lines, "layer_divergence.py")
    assert len(runs) == 1 and "--request req-a " in runs[0] and f"--patch-options {options}" in runs[0]


@pytest.mark.parametrize("args", [("divergence", "70b", "1", "r"), ("divergence", "2b", "x", "r"),
                                  ("divergence", "2b", "1"), ("divergence", "2b", "1", "{}")])
def test_divergence_refuses_bad_calls_before_setup(tmp_path, args):
    result, lines, _ = run_stage(tmp_path, *args)
    assert result.returncode == 2 and "divergence SHAPE SEED [OPTIONS] REQUEST" in result.stdout and lines == []


def test_sweep_times_the_default_and_each_configuration_in_one_bench_process(tmp_path):
    configs = '[{"dense_attention_tokens": 1, "packed_candidates": false}]'
    result, lines, out = run_stage(tmp_path, "sweep", "2b", configs)
    assert result.returncode == 0, result.stdout + result.stderr
    (bench,) = script_calls(lines, "bench_jevbench.py")
    assert "--shape 2b --arms C --passes 1 " in bench and f"--sweep {configs} " in bench
    assert f"--out {out}/sweep/2b" in bench and (out / "sweep.tgz").is_file()


def test_compile_threads_reach_the_bench_and_a_bad_count_is_refused_before_setup(tmp_path):
    result, lines, _ = run_stage(tmp_path, "sweep", "27b", "[]", COMPILE_THREADS="16")
    assert result.returncode == 0 and "--compile-threads 16 " in script_calls(lines, "bench_jevbench.py")[0]
    result, lines, _ = run_stage(tmp_path / "plain", "sweep", "27b", "[]")
    assert "--compile-threads" not in script_calls(lines, "bench_jevbench.py")[0]  # unset: the package's default
    result, lines, _ = run_stage(tmp_path / "bad", "sweep", "27b", "[]", COMPILE_THREADS="many")
    assert result.returncode == 2 and "COMPILE_THREADS=many" in result.stdout and lines == []


@pytest.mark.parametrize("args", [("sweep", "70b", "[{}]"), ("sweep", "2b", '{"cuda_graphs": false}'),
                                  ("sweep", "2b"), ("sweep", "2b", "[{}]", "extra")])
def test_sweep_refuses_bad_calls_before_setup(tmp_path, args):
    result, lines, _ = run_stage(tmp_path, *args)
    assert result.returncode == 2 and "sweep SHAPE JSON" in result.stdout and lines == []


def test_warmup_starts_from_empty_kernel_caches_on_a_machine_left_warm(tmp_path, monkeypatch):
    """An earlier warmup call on the same machine leaves its kernel caches behind; this one removes them first, so
    its "empty cache" figures are cold ones (s19's second call was not)."""
    caches = tmp_path / "tmp"
    for name in ("tc_empty", "tc_carried"):
        (caches / name).mkdir(parents=True)
        (caches / name / "stale").write_text("compiled before")
    monkeypatch.setenv("TMPDIR", str(caches))
    result, lines, _ = run_stage(tmp_path, "warmup", "9b")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (caches / "tc_empty" / "stale").exists() and not (caches / "tc_carried" / "stale").exists()
    assert "--shape 9b " in script_calls(lines, "warmup_breakdown.py")[0]


@pytest.mark.parametrize("args, carried_runs", [((), 3), (("2b", "9b"), 3), (("27b", "9b"), 0)])
def test_warmup_reruns_the_2b_on_the_configurations_just_tuned_only_when_the_2b_was_tuned(tmp_path, args,
                                                                                        carried_runs):
    """After the shapes on an empty cache, the 2B runs again on the configurations they dumped (an empty cache, a
    warm one, the op profile): only when 2b was among them. Without it those configurations lack the 2B's keys and
    its "carried" runs measured fla autotuning them (s28: 42 s of a 66 s run)."""
    result, lines, _ = run_stage(tmp_path, "warmup", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = script_calls(lines, "warmup_breakdown.py")
    shapes = list(args) or ["2b", "9b", "27b"]
    assert [re.search(r"--shape (\S+) ", run).group(1) for run in runs[:len(shapes)]] == shapes
    carried = runs[len(shapes):]
    assert len(carried) == carried_runs and all("--shape 2b " in run for run in carried)
    assert ("not among the shapes" in result.stdout) == (carried_runs == 0)


@pytest.mark.parametrize("args, shapes", [((), ["2b", "27b"]), (("9b",), ["9b"])])
def test_warm_ab_runs_the_tests_then_alternates_answered_and_unanswered_warm_ups_then_the_record_ops(tmp_path, args,
                                                                                                   shapes):
    """warm-ab: the capture and warm-up GPU tests first, then per shape C's warm-up and a measured pass, answered and
    not, alternated on one kernel cache (answered first: it warms the cache), one run with --record-ops between the
    two pairs, each in a folder of its own."""
    result, lines, out = run_stage(tmp_path, "warm-ab", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    (tests,) = script_calls(lines, "-m pytest")
    assert "tests/test_cuda_graphs.py" in tests and "unanswered or warm_up_captures" in tests
    runs = script_calls(lines, "warmup_breakdown.py")
    found = [re.search(r"--shape (\S+) (.*) --out (\S+)", run).groups() for run in runs]
    expected = ["--measured-pass --answered", "--measured-pass", "--record-ops", "--measured-pass --answered",
                "--measured-pass"]
    assert [(shape, flags) for shape, flags, _ in found] == [(shape, flags) for shape in shapes for flags in expected]
    assert len({folder for _, _, folder in found}) == len(found)
    assert lines.index(tests) < lines.index(runs[0]) and (out / "warm-ab.tgz").is_file()


def test_warm_ab_refuses_another_shape_before_setup(tmp_path):
    result, lines, _ = run_stage(tmp_path, "warm-ab", "2b", "70b")
    assert result.returncode == 2 and "got 70b" in result.stdout and lines == []


@pytest.mark.parametrize("args, cuts", [(("27b",), ["2560", "2048"]), (("2b", "3000"), ["3000"])])
def test_graph_cut_alternates_the_default_with_each_cut(tmp_path, args, cuts):
    """graph-cut SHAPE [CUT...]: C's warm-up and a measured pass per run with packs over CUT tokens eager, the default
    4096 first (it warms the kernel cache), then each cut, the default, each cut again, each in a folder of its own."""
    result, lines, out = run_stage(tmp_path, "graph-cut", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = script_calls(lines, "warmup_breakdown.py")
    found = [re.search(r'--shape (\S+) --measured-pass --fast-options \{"graph_tokens": (\d+)\} --out (\S+)',
                       run).groups() for run in runs]
    assert [(shape, cut) for shape, cut, _ in found] == [(args[0], cut) for cut in ["4096", *cuts, "4096", *cuts]]
    assert len({folder for _, _, folder in found}) == len(found) and (out / "graph-cut.tgz").is_file()


@pytest.mark.parametrize("args, message", [(("graph-cut",), "graph-cut SHAPE [CUT...]"),
                                           (("graph-cut", "70b"), "graph-cut SHAPE [CUT...]"),
                                           (("graph-cut", "27b", "0"), "got 0"),
                                           (("graph-cut", "27b", "2k"), "got 2k")])
def test_graph_cut_refuses_bad_calls_before_setup(tmp_path, args, message):
    result, lines, _ = run_stage(tmp_path, *args)
    assert result.returncode == 2 and message in result.stdout and lines == [], (args, result.stdout)


@pytest.mark.parametrize("args, shapes", [((), ["9b", "2b"]), (("2b",), ["2b"])])
def test_family_warms_b_on_every_request_and_runs_only_the_benches(tmp_path, args, shapes):
    """family: per shape B and C in one process, B's warm-up on the whole workload (no --b-warmup-requests, so no
    cold B), and nothing else in the call (the gate and the GPU suite have stages of their own)."""
    result, lines, out = run_stage(tmp_path, "family", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    benches = script_calls(lines, "bench_jevbench.py")
    assert [re.search(r"--shape (\S+)", b).group(1) for b in benches] == shapes
    for bench in benches:
        assert "--arms B,C " in bench and "--b-warmup-requests" not in bench
    assert not script_calls(lines, "-m pytest") and not script_calls(lines, "hf_openjev fidelity")
    assert not script_calls(lines, "random_export.py")


@pytest.mark.parametrize("shape", ["27b", "mid"])
def test_family_refuses_another_shape_before_setup(tmp_path, shape):
    result, lines, _ = run_stage(tmp_path, "family", "9b", shape)
    assert result.returncode == 2 and f"got {shape}" in result.stdout, result.stdout
    assert lines == []


def test_compile_ab_runs_each_arm_cold_on_an_emptied_cache_of_its_own_then_warm_on_it(tmp_path, monkeypatch):
    """compile-ab: the warm-up with a compile-ahead pass (16 threads) and without (0), each first on its own emptied
    kernel cache, then again on that cache; a stale cache is emptied first."""
    caches = tmp_path / "tmp"
    (caches / "tc_compile_ahead").mkdir(parents=True)
    (caches / "tc_compile_ahead" / "stale").write_text("compiled before")
    monkeypatch.setenv("TMPDIR", str(caches))
    result, lines, out = run_stage(tmp_path, "compile-ab")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = script_calls(lines, "warmup_breakdown.py")
    assert len(runs) == 4 and all("--shape 27b " in run for run in runs)
    threads = [re.search(r"--compile-threads (\d+) ", run).group(1) for run in runs]
    folders = [re.search(r"--out (\S+)", run).group(1).rsplit("/", 1)[-1] for run in runs]
    assert threads == ["16", "0", "16", "0"]
    assert folders == ["ahead_cold", "plain_cold", "ahead_warm", "plain_warm"]
    triton = (tmp_path / "calls.txt.triton").read_text().splitlines()[-4:]
    assert triton == [f"{caches}/tc_compile_{arm}" for arm in ("ahead", "plain", "ahead", "plain")]
    assert not (caches / "tc_compile_ahead" / "stale").exists() and (out / "compile-ab.tgz").is_file()


@pytest.mark.parametrize("args", [("mid",), ("27b", "9b")])
def test_compile_ab_refuses_a_bad_shape_before_setup(tmp_path, args):
    result, lines, _ = run_stage(tmp_path, "compile-ab", *args)
    assert result.returncode == 2 and "compile-ab [SHAPE]" in result.stdout, result.stdout
    assert lines == []


