"""One training process per run directory: an exclusive `flock` on `<run_dir>/.lock`, and on
`<checkpoint.dir>/.lock` when the checkpoints live elsewhere on a local disk.

The kernel drops the lock when its holder exits, however it exits (SIGKILL included), so a lock
left by a dead run never blocks the next one; the file itself only records who holds it (pid and
host) for the message. Two trainings on one run dir would interleave `metrics.jsonl` and fight
over checkpoints: the second one is refused with one line instead; so is a second run with its
own run dir whose `checkpoint.dir` is the first run's (it would resume the other run's
checkpoints and write into them).

Nothing a run writes goes through a symbolic link it did not create: `open_no_follow` opens with
`O_NOFOLLOW`, and `refuse_links` names a link planted where the run writes (a link to
`~/.bashrc` named `config.yaml` would otherwise be overwritten with the config).
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket


# Files and folders a run writes in its run dir (`trainer`, `metrics`, `trackers`, `profiling`).
RUN_DIR_ENTRIES = (".lock", "config.yaml", "metrics.jsonl", "loss_curve.png", "tb", "wandb",
                   "profile", "wandb_run_id")


def refuse_links(directory: str, names=RUN_DIR_ENTRIES, key: str = "run_dir") -> None:
    """One-line ValueError when any of `names` in `directory` is a symbolic link."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            raise ValueError(f"{key}: {path} is a symbolic link (to {os.readlink(path)!r}); "
                             "a run writes only files it creates: remove the link")


def open_no_follow(path: str, flags: int, key: str = "run_dir", mode: int = 0o644) -> int:
    """`os.open(path, flags | O_NOFOLLOW)`; a symbolic link at `path` is a one-line
    ValueError naming `key`."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"{key}: {path} is a symbolic link; a run writes only files it "
                             "creates: remove the link") from None
        raise


class RunDirLock:
    """Context manager holding the exclusive lock of `run_dir` (created if missing); `key`
    names the setting in messages (`run_dir`, `checkpoint.dir`)."""

    def __init__(self, run_dir: str, key: str = "run_dir"):
        self.path = os.path.join(run_dir, ".lock")
        self.key = key
        self._fd: int | None = None

    def __enter__(self) -> "RunDirLock":
        try:
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT, self.key)
        except OSError as err:
            raise ValueError(f"{self.key}: cannot create the lock file {self.path} "
                             f"({err.strerror}); choose a writable {self.key}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(f"{self.key}: {os.path.dirname(self.path)} is in use by "
                                 f"{holder}; wait for that run to finish or choose another "
                                 f"{self.key}") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
