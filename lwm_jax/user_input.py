"""Checks on user-supplied input, shared by the CLI, the run config and the checkpoint readers.

Everything here is light (PyYAML and the standard library only) so that `lwm-jax --help` and
config validation never pull in JAX-level modules.

- `short(value)`: a bounded repr for error messages; it never builds a large string, however
  large or deeply nested `value` is.
- `one_line(text)`: whitespace collapsed to single spaces, capped in length.
- `load_yaml(source, where)`: `yaml.safe_load` with limits: nesting depth, alias expansion
  ("billion laughs"), recursive aliases and duplicate mapping keys are refused. Every failure is
  a one-line `ValueError` that starts with `where`.
- `check_output_dir` / `check_output_file`: refuse an output path that is the wrong kind of
  thing (a file where a directory is needed and vice versa) or lies in a directory that cannot
  be written, before any work is done.
- `NonFiniteError`: a `ValueError` for NaN/inf results; the CLI exits with its `exit_status` (3).
"""
from __future__ import annotations

import os
import reprlib
import tempfile
from pathlib import Path
from typing import IO, Any

import yaml

MAX_YAML_DEPTH = 64           # nesting levels (after alias expansion)
MAX_YAML_NODES = 100_000      # values (after alias expansion); a run config has ~60
SHORT = 80                    # characters of a quoted value in a message
LINE = 600                    # characters of a whole message line

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxdict, _repr.maxlist, _repr.maxtuple = 2, 4, 4, 4
_repr.maxset, _repr.maxfrozenset, _repr.maxstring, _repr.maxother, _repr.maxlong = 4, 4, 70, 70, 40


class NonFiniteError(ValueError):
    """A computed result (loss, weights) is NaN or infinite; `lwm-jax` exits with status 3."""

    exit_status = 3


def short(value: Any, limit: int = SHORT) -> str:
    """`repr(value)` cut to at most `limit` characters (ending in "..." when cut).

    Accepts any object; containers are abbreviated while being printed (`reprlib`), so a huge
    or alias-expanded structure costs no more than a small one.
    """
    if isinstance(value, str):
        text = repr(value[: limit + 1])
    else:
        text = _repr.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quote_path(path: str | os.PathLike, limit: int = 240) -> str:
    """A path quoted for a message (`short` with room for long temporary paths)."""
    return short(os.fspath(path), limit)


def one_line(text: Any, limit: int = LINE) -> str:
    """`str(text)` with every run of whitespace (newlines included) turned into one space and
    the result cut to `limit` characters ("..." marks a cut)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# --------------------------------------------------------------------------------------- YAML
class _Refused(yaml.YAMLError):
    """A YAML document that parses but is refused (bomb, too deep, duplicate key)."""

    def __init__(self, problem: str, mark=None):
        super().__init__(problem)
        self.problem, self.mark = problem, mark

    def __str__(self) -> str:
        where = f" (line {self.mark.line + 1}, column {self.mark.column + 1})" if self.mark else ""
        return self.problem + where


_MERGE = "tag:yaml.org,2002:merge"


class _LimitedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` (plain data only, no code) that also refuses documents nested deeper
    than `MAX_YAML_DEPTH`, aliases expanding to more than `MAX_YAML_NODES` values or to
    themselves, and duplicate keys in a mapping."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _Refused(f"nested deeper than {MAX_YAML_DEPTH} levels; flatten it",
                               self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        _check_expansion(node)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                try:
                    seen = key in first_line
                except TypeError:          # unhashable: the base constructor reports it
                    continue
                if seen:
                    raise _Refused(f"duplicate key {short(key)} (first given on line "
                                   f"{first_line[key]}); keep only one", key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _check_expansion(root) -> None:
    """Count the values `root` stands for once every alias is expanded (memoised per node, so
    the count costs one visit per distinct node) and the expanded nesting depth."""
    memo: dict[int, tuple[int, int] | None] = {}       # id(node) -> (values, height)

    def visit(node, depth: int) -> tuple[int, int]:
        if depth > MAX_YAML_DEPTH:
            raise _Refused(f"nested deeper than {MAX_YAML_DEPTH} levels once aliases are "
                           "expanded; flatten it", node.start_mark)
        key = id(node)
        if key in memo:
            done = memo[key]
            if done is None:
                raise _Refused("an alias refers to a collection that contains it (a recursive "
                               "structure); write the values out", node.start_mark)
            if depth + done[1] > MAX_YAML_DEPTH:
                raise _Refused(f"nested deeper than {MAX_YAML_DEPTH} levels once aliases are "
                               "expanded; flatten it", node.start_mark)
            return done
        memo[key] = None
        count, height = 1, 0
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            n, h = visit(child, depth + 1)
            count, height = count + n, max(height, h + 1)
            if count > MAX_YAML_NODES:
                raise _Refused(f"aliases expand to more than {MAX_YAML_NODES:,} values (an "
                               "alias bomb?); write the values out instead of nesting aliases",
                               node.start_mark)
        memo[key] = (count, height)
        return count, height

    visit(root, 1)


def load_yaml(source: str | bytes | IO, where: str) -> Any:
    """Parse one YAML document into plain Python data (`yaml.safe_load` semantics).

    `source` is YAML text or an open file; `where` names it in messages (a file name, a config
    key). Raises ValueError (one line, starting with `where`) for a syntax error, a duplicate
    key, nesting deeper than `MAX_YAML_DEPTH` or aliases expanding past `MAX_YAML_NODES` values.
    """
    loader = _LimitedLoader(source)
    loader.name = where                   # marks in syntax errors name the file, not "<string>"
    try:
        return loader.get_single_data()
    except _Refused as err:
        raise ValueError(f"{where}: refused YAML: {one_line(err)}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: not valid YAML: {_describe(err)}; fix the YAML") from None
    except RecursionError:
        raise ValueError(f"{where}: refused YAML: nested too deeply; flatten it") from None
    finally:
        loader.dispose()


def _describe(err: yaml.YAMLError) -> str:
    """`problem at line L, column C (context)` of a PyYAML error, without its source excerpt."""
    problem = getattr(err, "problem", None)
    if not problem:
        return one_line(err, 300)
    mark = getattr(err, "problem_mark", None)
    text = one_line(problem, 200)
    if mark is not None:
        text += f" at line {mark.line + 1}, column {mark.column + 1}"
    context = getattr(err, "context", None)
    return text + (f" ({one_line(context, 120)})" if context else "")


def load_yaml_file(path: str | os.PathLike, where: str | None = None) -> Any:
    """`load_yaml` of a UTF-8 file; `where` defaults to the path. Raises ValueError (one line)
    for unreadable bytes or bad YAML; OSError (missing/unreadable file) passes through."""
    label = where or os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{label}: not UTF-8 text (byte {err.start}); is this the right "
                         "file?") from None
    return load_yaml(text, label)


# ------------------------------------------------------------------------------- output paths
def _existing_ancestor(p: Path) -> Path:
    for q in (p, *p.parents):
        if os.path.lexists(q):
            return q
    return Path(".")


def _is_writable_dir(d: Path) -> bool:
    """True when a file can really be created in directory `d` (a probe file, removed again:
    permission bits alone say nothing for root or on read-only mounts)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".lwm-write-probe-", dir=d)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_output_dir(path: str | os.PathLike, key: str) -> Path:
    """Refuse (ValueError, one line naming `key`) an output directory that exists as a file, sits
    below a file, or would be created in (or is) a directory that cannot be written. Returns the
    path; creates nothing (a probe file in the nearest existing directory is removed again).
    Remote URLs (`gs://...`, handled by orbax/tensorstore) are not checked."""
    if "://" in os.fspath(path):
        return Path(path)
    p = Path(path)
    if os.path.lexists(p) and not p.is_dir():
        raise ValueError(f"{key}: {quote_path(p)} is a file, but a directory is needed here; "
                         "choose another path or remove the file")
    base = _existing_ancestor(p)
    if not base.is_dir():
        raise ValueError(f"{key}: {quote_path(base)} is a file, so the directory {quote_path(p)} "
                         "cannot be created below it; choose another path")
    if not _is_writable_dir(base):
        raise ValueError(f"{key}: {quote_path(base)} is not writable (read-only or no "
                         "permission); choose a writable location or fix its permissions")
    return p


def check_output_file(path: str | os.PathLike, key: str) -> Path:
    """Refuse (ValueError, one line naming `key`) an output file path that is an existing
    directory or lies below a file. Returns the path; creates nothing."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{key}: {quote_path(p)} is a directory, but a file is needed here; "
                         "give a file name")
    base = _existing_ancestor(p.parent) if str(p.parent) else Path(".")
    if not base.is_dir():
        raise ValueError(f"{key}: {quote_path(base)} is a file, so {quote_path(p)} cannot be "
                         "created below it; choose another path")
    return p


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path`; an OSError raised while writing or closing (a full disk
    reports only at flush) is re-raised with the file name attached."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, os.fspath(path)) from None
        raise


def ignore_closed_event_loop_noise() -> None:
    """Drop `RuntimeError('Event loop is closed')` reported through `sys.unraisablehook`.

    When an orbax restore fails, tensorstore callbacks still running on other threads try to
    wake the asyncio loop orbax has already closed; each failure would print a traceback after
    the real (already reported) error. Every other unraisable exception still reaches the hook
    that was installed before. Installing twice is harmless.
    """
    import sys
    previous = sys.unraisablehook
    if getattr(previous, "_lwm_ignores_closed_loop", False):
        return

    def hook(info):
        err = info.exc_value
        if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
            return
        previous(info)

    hook._lwm_ignores_closed_loop = True
    sys.unraisablehook = hook


def check_encodable(text: str, where: str, field: str = "text") -> None:
    """Refuse (one line naming `where`, e.g. file:line) a JSON text holding a lone surrogate
    (an escaped `"\\ud800"` with no pair): it is no Unicode text and cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: field {field!r} holds a lone surrogate "
                         f"({text[e.start]!a} at character {e.start}), which is not valid "
                         "Unicode text; fix or drop that line") from None


def check_config_path(path: str | None) -> None:
    """Refuse (one line) a `--config` that exists but is not a regular file or directory (a
    FIFO would block the read; `load_config` would call it "not found")."""
    if path is not None and os.path.exists(path) and not os.path.isfile(path) \
            and not os.path.isdir(path):
        raise ValueError(f"--config: {quote_path(path)} is not a regular file (a FIFO, device "
                         "or socket); give a YAML file")
