"""`lwm-jax` command line.

    lwm-jax train                                   # tiny byte-level model on the built-in corpus
    lwm-jax train --config configs/rwkv7-0.1b.yaml train.lr=3e-4 precision=bf16-mixed
    lwm-jax prepare --input docs/ --output data/mydata --tokenizer world
    lwm-jax convert --input RWKV-x070-World-0.1B.pth --output ckpt/0.1b
    lwm-jax export --input ckpt/0.1b --output out.pth --format rwkv-pth
    lwm-jax generate --checkpoint ckpt/0.1b --prompt "The capital of France is"
    lwm-jax eval --checkpoint ckpt/0.1b --data book.txt --lambada lambada.jsonl
    lwm-jax precision-report --policy bf16-mixed model.n_layer=2    # where precision is lost

`train` takes dotted `key=value` overrides after the options (values are parsed as YAML).
Arguments are defined in `lwm_jax.cli.args` (light); only the chosen subcommand's module is
imported. Every problem is reported as ONE line on stderr:

  status 0  success
  status 1  internal error (a bug): one line plus the path of a crash log holding the traceback
  status 2  bad input or environment, e.g. `lwm-jax train: error: train.lrr: unknown key; ...`
            (also argparse usage errors): a wrong value, a damaged file, a path that cannot be
            written, a full disk, a missing optional dependency, a model too large for memory
  status 3  non-finite result: training stopped on NaN/inf, or `eval` computed a NaN/inf loss
  status 130 interrupted (Ctrl-C outside training; `train` handles signals itself)

Set LWM_DEBUG=1 (or LWM_JAX_DEBUG=1) to get the Python traceback instead of the one line.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys

from lwm_jax.cli.args import COMMANDS, DESCRIPTIONS, HelpFormatter
from lwm_jax.user_input import ignore_closed_event_loop_noise, one_line, quote_path

DEBUG_VARS = ("LWM_DEBUG", "LWM_JAX_DEBUG")


# ----------------------------------------------------------------------------------- parser
class Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (`lwm-jax generate: error: ...; see --help`)
    instead of the usage block plus the error; exit status 2 as usual."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


class _Entry:
    """Imports `module` and calls `function(args)` only when the subcommand runs; an int result
    is the exit status, anything else (None, ids, a results dict) means 0."""

    def __init__(self, module: str, function: str):
        self.module, self.function = module, function

    def __call__(self, args: argparse.Namespace) -> int:
        status = getattr(importlib.import_module(self.module), self.function)(args)
        return status if isinstance(status, int) and not isinstance(status, bool) else 0


def build_parser() -> argparse.ArgumentParser:
    """The `lwm-jax` parser with every subcommand; imports no subcommand implementation."""
    parser = Parser(
        prog="lwm-jax", formatter_class=HelpFormatter,
        description="Long-context language models in JAX (RWKV-7, LLaMA-style, hybrids): "
                    "train, prepare, convert, export, generate, eval, compile",
        epilog="Errors are one line on stderr: exit status 2 bad input, 3 non-finite result,\n"
               "1 internal error (with a crash log). LWM_DEBUG=1 shows tracebacks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, module, function, add_args in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=DESCRIPTIONS.get(name, help_text),
                           formatter_class=HelpFormatter)
        add_args(p)
        p.set_defaults(func=_Entry(module, function))
    return parser


# ----------------------------------------------------------------------------------- errors
_OS_HINTS = {
    errno.ENOSPC: "no space left on device; free some space or write somewhere else",
    errno.EDQUOT: "disk quota exceeded; free some space or write somewhere else",
    errno.EACCES: "permission denied; choose a location you may use or fix its permissions",
    errno.EPERM: "operation not permitted; choose a location you may use or fix its "
                 "permissions",
    errno.EROFS: "read-only file system; choose a writable location",
    errno.EISDIR: "is a directory, but a file is needed here; give a file name",
    errno.ENOTDIR: "a part of this path is a file, not a directory; choose another path",
    errno.EEXIST: "already exists; choose another path or remove it",
    errno.ENOENT: "no such file or directory; check the path",
    errno.ENAMETOOLONG: "file name too long; choose a shorter path",
}


def _clean(text: str) -> str:
    """One line; drops the long JSON spec tensorstore appends to its messages."""
    text = str(text)
    cut = text.find("[tensorstore_spec=")
    return one_line(text[:cut] if cut > 0 else text)


def _os_message(err: OSError) -> str:
    hint = _OS_HINTS.get(err.errno) or one_line(err.strerror or err, 200)
    name = err.filename if err.filename is not None else None
    return f"{quote_path(name)}: {hint}" if name is not None else hint


def classify(err: BaseException) -> tuple[int, str] | None:
    """`(exit status, one-line message)` for an error caused by the input or the environment;
    None for an unexpected one (a bug: the caller writes a crash log)."""
    text = str(err)
    status = getattr(err, "exit_status", None)
    if isinstance(status, int):
        return status, _clean(text or type(err).__name__)
    if isinstance(err, OSError):
        return 2, _os_message(err)
    if "No space left on device" in text:
        return 2, f"{_clean(text)}; free some space or write somewhere else"
    if "RESOURCE_EXHAUSTED" in text or isinstance(err, MemoryError):
        return 2, (f"out of memory ({_clean(text or type(err).__name__)[:200]}); use a smaller "
                   "model, batch_size or ctx_len")
    if "Event loop is closed" in text:       # orbax's error path after a failed read/write
        return 2, ("an orbax checkpoint could not be read or written (its directory may be "
                   "damaged or incomplete); remove the damaged step directory or use another "
                   "run_dir / checkpoint")
    if isinstance(err, RecursionError):
        return 2, "input nested too deeply for Python's recursion limit; flatten it"
    if isinstance(err, ImportError):
        return 2, _clean(text)
    if isinstance(err, (ValueError, TypeError)) or type(err).__module__.startswith("yaml"):
        return 2, _clean(text or type(err).__name__)
    return None


def write_crash_log(command: str, argv: list[str] | None, err: BaseException) -> str | None:
    """Write the full traceback of `err` to a new file under the system temp dir (or the
    working directory when that fails); returns its path, or None when nothing could be
    written."""
    import tempfile
    import time
    import traceback
    stamp = time.strftime("%Y%m%d-%H%M%S")
    head = (f"lwm-jax {command} crashed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            f"argv: {sys.argv[:1] + list(argv if argv is not None else sys.argv[1:])}\n"
            f"python {sys.version.split()[0]}\n\n")
    body = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    for folder in (tempfile.gettempdir(), os.getcwd()):
        try:
            fd, path = tempfile.mkstemp(prefix=f"lwm-jax-crash-{stamp}-", suffix=".log",
                                        dir=folder)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(head + body)
            return path
        except OSError:
            continue
    return None


def _debug() -> bool:
    return any(os.environ.get(v, "") not in ("", "0") for v in DEBUG_VARS)


class Terminated(BaseException):
    """SIGTERM outside `train`'s own handler (while JAX imports, a config loads, a file
    converts): exit 143 with one line, not a silent death by the signal. Raised from the
    handler, so `with` blocks and `finally` clauses (temporary files) still run."""


def _terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run `lwm-jax` with `argv` (default: `sys.argv[1:]`); returns the exit status (see the
    module docstring). Usage errors raise SystemExit(2) from argparse."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "stop_after", None) is not None and args.stop_after < 1:
        parser.error(f"--stop-after: must be >= 1, got {args.stop_after}")
    ignore_closed_event_loop_noise()
    name = f"lwm-jax {args.command}"
    previous = signal.signal(signal.SIGTERM, _terminated)   # until `train` installs its own
    try:
        from lwm_jax.hardware import skip_absent_tpu
        skip_absent_tpu()           # libtpu on a CPU host: no failed TPU start-up on stderr
        return args.func(args)
    except KeyboardInterrupt:
        if _debug():
            raise
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{name}: stopped by SIGTERM", file=sys.stderr)
        return 143
    except Exception as err:        # noqa: BLE001 -- every error becomes one line
        if _debug():
            raise
        known = classify(err)
        if known is not None:
            status, message = known
            print(f"{name}: error: {message}  (LWM_DEBUG=1 shows the traceback)",
                  file=sys.stderr)
            return status
        log = write_crash_log(args.command, argv, err)
        where = (f"full traceback in {log}" if log else "no crash log could be written")
        print(f"{name}: internal error: {type(err).__name__}: {_clean(err)[:300]} ({where}; "
              "LWM_DEBUG=1 prints it; please report this)", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)

