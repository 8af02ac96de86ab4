"""Bad input to tpu_scripts is one line on stderr, exit status 2, and prints no command: bad
names, zones, slices, options, configs and compiled-step files; file names a remote shell could
act on; FIFOs given as the flags file or the compiled step; values cut in messages keep their
quotes.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tpu_scripts.cli import main
from tpu_scripts.flags import read_flags
from tpu_scripts_common import ENV, GS, REPO, V4_CONFIG, compiled_step


# --------------------------------------------------------------------------------- bad input
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
