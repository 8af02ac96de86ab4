"""A disk that fills up during a training run's checkpoint save: one line naming the directory
and the newest complete checkpoint, the metrics of the steps trained so far kept, and after
space is freed the same command resumes from that checkpoint and finishes.

Uses a small tmpfs (needs root and `mount`; skipped where that is not allowed)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from lwm_jax.cli import main as cli_main

RUN = ["--no-progress", "model.n_layer=2", "model.n_embd=64", "train.ctx_len=32",
       "train.batch_size=4", "train.eval_every=0", "train.steps=4", "train.warmup_steps=1",
       "train.log_every=10", "checkpoint.every=1"]


def _mount(path, size_k, remount=False):
    opts = f"{'remount,' if remount else ''}size={size_k}k"
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True, text=True)


def _used_k(path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0 or _mount(mnt, 65536).returncode:
        pytest.skip("needs root and mount to make a small tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_full_disk_during_a_save_is_one_line_and_the_run_resumes(small_disk, capsys):
    run = [*RUN, f"run_dir={small_disk / 'run'}"]
    assert cli_main(["train", *run, "--stop-after", "1"]) == 0      # checkpoint of step 1
    capsys.readouterr()
    # room for the files so far plus a quarter MiB: the step-2 checkpoint (~1.5 MiB) cannot fit
    assert _mount(small_disk, _used_k(small_disk) + 256, remount=True).returncode == 0
    status = cli_main(["train", *run])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "no space left on device" in err[0] and "no checkpoint after step 1" in err[0]
    assert "Traceback" not in err[0]
    steps = [json.loads(x)["step"] for x in
             open(small_disk / "run" / "metrics.jsonl", encoding="utf-8") if '"loss"' in x]
    assert steps and steps[-1] >= 2, steps        # the step that found the disk full is logged
    # space freed: the same command resumes from step 1 and finishes
    assert _mount(small_disk, 65536, remount=True).returncode == 0
    assert cli_main(["train", *run]) == 0
    captured = capsys.readouterr()
    assert "resumed at step 1" in captured.out + captured.err
    ckpts = sorted(os.listdir(small_disk / "run" / "checkpoints"))
    assert "4" in ckpts and not any("tmp" in c for c in ckpts), ckpts
