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
import stat


# Files and folders a run writes in its run dir (`trainer`, `metrics`, `trackers`, `profiling`).
RUN_DIR_ENTRIES = (".lock", "config.yaml", "metrics.jsonl", "loss_curve.png", "tb", "wandb",
                   "profile", "wandb_run_id")


# Entries of RUN_DIR_ENTRIES that are plain files (the others are folders).
RUN_DIR_FILES = (".lock", "config.yaml", "metrics.jsonl", "loss_curve.png", "wandb_run_id")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def _not_regular(key: str, path: str, mode: int) -> ValueError:
    return ValueError(f"{key}: {path!r} is not a regular file ({_kind(mode)}); remove it")


def refuse_links(directory: str, names=RUN_DIR_ENTRIES, key: str = "run_dir") -> None:
    """One-line ValueError when any of `names` in `directory` is a symbolic link, or one of the
    run's files (`RUN_DIR_FILES`) exists and is not a regular file (a FIFO would block the
    run when it writes or reads it)."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            raise ValueError(f"{key}: {path} is a symbolic link (to {os.readlink(path)!r}); "
                             "a run writes only files it creates: remove the link")
        if name in RUN_DIR_FILES:
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if not stat.S_ISREG(mode):
                raise _not_regular(key, path, mode)


def open_no_follow(path: str, flags: int, key: str = "run_dir", mode: int = 0o644) -> int:
    """`os.open(path, flags | O_NOFOLLOW)`; a symbolic link at `path`, or anything there but a
    regular file (a FIFO would block), is a one-line ValueError naming `key`."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for its other end; refused below
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"{key}: {path} is a symbolic link; a run writes only files it "
                             "creates: remove the link") from None
        if err.errno in (errno.ENXIO, errno.EISDIR):   # a FIFO without a reader, a folder
            try:
                st_mode = os.lstat(path).st_mode
            except OSError:
                raise err from None
            raise _not_regular(key, path, st_mode) from None
        raise
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise _not_regular(key, path, st_mode)
    if not flags & os.O_NONBLOCK:
        os.set_blocking(fd, True)
    return fd


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
