"""The libtpu flags file (`libtpu_flags.txt`) -> the value of `LIBTPU_INIT_ARGS`.

One flag per line, `--name=value`; lines starting with `#` and blank lines are skipped. A
malformed line or a flag given twice is a one-line ValueError naming `file:line`.
"""
from __future__ import annotations

import os
import re

DEFAULT_FLAGS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtpu_flags.txt")
_FLAG = re.compile(r"^--([a-z0-9_]+)=([A-Za-z0-9_.:+-]+)$")


def read_flags(path: str = DEFAULT_FLAGS_FILE) -> list[str]:
    """The active flags of `path`, in file order."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        # opening a FIFO would block until a writer comes
        raise ValueError(f"--flags-file: {path} is not a regular file (a FIFO, device or "
                         "socket); give a text file of --name=value lines")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise ValueError(f"--flags-file: cannot read {path} ({err.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--flags-file: {path} is not UTF-8 text") from None
    flags, seen = [], {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _FLAG.match(line)
        if not m:
            raise ValueError(f"{path}:{number}: {line[:60]!r} is not a flag; write one "
                             "--name=value per line (comments start with '#')")
        if m.group(1) in seen:
            raise ValueError(f"{path}:{number}: --{m.group(1)} is already set on line "
                             f"{seen[m.group(1)]}; keep one")
        seen[m.group(1)] = number
        flags.append(line)
    return flags


def libtpu_init_args(flags: list[str]) -> str:
    """The `LIBTPU_INIT_ARGS` value: the flags joined by spaces."""
    return " ".join(flags)
