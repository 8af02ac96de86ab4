"""Run commands, or (dry run) print them shell-quoted: one `Runner` per invocation, no globals.

Commands are argument lists handed to `subprocess` without a shell. A dry run prints each one
as `shlex.join(argv)` (copy-paste safe) and runs nothing; `probe` then answers None, so a caller
that needs a live answer (babysit's state polls) prints what it would do instead.
"""
from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from typing import Callable, TextIO


class CommandFailed(RuntimeError):
    """A command exited non-zero. `exit_status` 1: the CLI prints the message as one line."""

    exit_status = 1


@dataclasses.dataclass(frozen=True)
class Probe:
    """What a probe command answered: exit status, stdout and stderr (text)."""

    returncode: int
    stdout: str
    stderr: str


def _subprocess_probe(argv: list[str], timeout: float | None) -> Probe:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise CommandFailed(f"{argv[0]}: not found; install the Google Cloud CLI "
                            "(https://cloud.google.com/sdk/docs/install)") from None
    except subprocess.TimeoutExpired:
        return Probe(124, "", f"timed out after {timeout} s")
    return Probe(done.returncode, done.stdout, done.stderr)


def _subprocess_run(argv: list[str]) -> int:
    try:
        return subprocess.run(argv).returncode
    except FileNotFoundError:
        raise CommandFailed(f"{argv[0]}: not found; install the Google Cloud CLI "
                            "(https://cloud.google.com/sdk/docs/install)") from None


@dataclasses.dataclass
class Runner:
    """`dry_run`: print instead of running. `out`: where dry runs and notes are printed.
    `execute` / `capture`: how a command really runs (tests pass fakes)."""

    dry_run: bool = False
    out: TextIO = dataclasses.field(default_factory=lambda: sys.stdout)
    execute: Callable[[list[str]], int] = _subprocess_run
    capture: Callable[[list[str], float | None], Probe] = _subprocess_probe

    def note(self, text: str) -> None:
        """A comment line (`# ...`): in a dry run it explains the commands around it."""
        print(f"# {text}", file=self.out, flush=True)

    def run(self, argv: list[str], *, check: bool = True) -> int:
        """Run `argv` with the terminal attached (output streams through); returns the exit
        status, raising `CommandFailed` on a non-zero one when `check`."""
        if self.dry_run:
            print(shlex.join(argv), file=self.out, flush=True)
            return 0
        status = self.execute(argv)
        if check and status != 0:
            raise CommandFailed(f"exit status {status} from: {shlex.join(argv)[:300]}")
        return status

    def probe(self, argv: list[str], *, timeout: float | None = 300) -> Probe | None:
        """Run `argv` capturing its output (None in a dry run, after printing it)."""
        if self.dry_run:
            print(shlex.join(argv), file=self.out, flush=True)
            return None
        return self.capture(argv, timeout)
