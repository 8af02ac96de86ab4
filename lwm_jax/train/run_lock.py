"""One training process per run directory: an exclusive `flock` on `<run_dir>/.lock`.

The kernel drops the lock when its holder exits, however it exits (SIGKILL included), so a lock
left by a dead run never blocks the next one; the file itself only records who holds it (pid and
host) for the message. Two trainings on one run dir would interleave `metrics.jsonl` and fight
over checkpoints: the second one is refused with one line instead.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket


class RunDirLock:
    """Context manager holding the exclusive lock of `run_dir` (created if missing)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, ".lock")
        self._fd: int | None = None

    def __enter__(self) -> "RunDirLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ValueError(f"run_dir: cannot create the lock file {self.path} "
                             f"({err.strerror}); choose a writable run_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(f"run_dir: {os.path.dirname(self.path)} is in use by {holder}; "
                                 "wait for that run to finish or choose another run_dir") from None
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
