"""tpu_scripts' commands (create / setup / launch / status / logs / stop / delete / babysit)
as dry runs: no gcloud call is made; the printed lines are parsed back with shlex and compared
with the exact argument lists expected. `launch --compiled` is checked against hand-written
compiled-step files (nothing is compiled). The libtpu flags file is documented line by line, and
the TPU configs load with lwm_jax's own loader and their meshes fill their slices.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import tomllib

import pytest

from tpu_scripts.cli import main
from tpu_scripts.flags import DEFAULT_FLAGS_FILE, read_flags
from tpu_scripts.slices import parse_accelerator_type
from tpu_scripts.source import tpu_requirements
from tpu_scripts_common import (ENV, GS, REPO, TPU_CONFIGS, V4_CONFIG, WHERE, compiled_step, dry,
                                ssh_command)


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
