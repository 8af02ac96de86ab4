"""Orbax checkpoint directories on disk: telling a damaged one from an intact one by its
metadata files, and reaching one whose path is not valid UTF-8.

Damage. Orbax reads these files before (or while) it restores; given a damaged one it raises
whatever its parser hits (`JSONDecodeError`, `AttributeError: 'list' object has no attribute
'get'`, tensorstore's `DATA_LOSS`) or, for `_CHECKPOINT_METADATA`, logs an error and goes on.
They are checked here first, so that a damaged file is named in one line. A checkpoint with any
one of them damaged counts as damaged, even where orbax could do without that file: the fault
that spoiled one file may have spoiled more, and every reader (convert, generate, eval, the
resume of a training run) then applies the same rule:
  `<step>/_CHECKPOINT_METADATA`  (also in an item directory saved on its own, optional) a JSON
                                 object: `item_handlers` a string, an object of strings or null;
                                 `metrics`, `performance_metrics`, `custom_metadata` objects or
                                 null; `*_timestamp_nsecs` integers or null;
  `<item>/_METADATA`             (required) a JSON object whose `tree_metadata` maps each leaf to
                                 `key_metadata` (a list of `{key: string, key_type: 1 | 2}`) and
                                 `value_metadata` (`value_type` string, `skip_deserialize`
                                 boolean, `write_shape` a list of integers when present);
                                 `use_ocdbt`, `use_zarr3`, `store_array_data_equal_to_fill_value`
                                 booleans and `custom_metadata` an object or null when present;
  `<item>/_sharding`             (optional) a JSON object of strings, each a JSON object;
  `<item>/array_metadatas/*`     (optional) JSON objects with an `array_metadatas` list of
                                 objects, each with an `array_metadata` object;
  `<item>/manifest.ocdbt`        (required when `_METADATA` says `use_ocdbt`) the OCDBT database
                                 root: tensorstore must list the database's keys from it (a few
                                 small reads, not the arrays). The per-process manifests
                                 `ocdbt.process_N/manifest.ocdbt` are not checked: orbax merges
                                 them into this one when it finishes a save and never reads them
                                 again;
  `<step>/data/metadata`         (training checkpoints, required) a JSON object.
What these checks cannot see (a damaged array chunk) still fails the restore itself, which the
callers report in one line too: `corrupt_data` tells such a failure (tensorstore's DATA_LOSS, a
decoding error, a short file) from any other, and `restore_detail` digs the message out of the
cause chain orbax wraps it in. A file that cannot be read at all (permission denied) is not
called damaged: its OSError passes through.

Paths that are not UTF-8. Python carries the bytes of such a name in a str (surrogateescape),
but tensorstore, under orbax, accepts only UTF-8 strings (pybind11 refuses the str).
`utf8_path` gives orbax a UTF-8 alias instead: a symbolic link in a new temporary directory
that points at the real directory (made from the original bytes), removed afterwards. Where no
such link can be made (no symlinks, a temporary directory that is not UTF-8 itself) the result
is a one-line ValueError asking for a UTF-8 name. Remote URLs (`gs://...`) are left as they are.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from lwm_jax.user_input import ignore_closed_event_loop_noise, one_line

STEP_METADATA = "_CHECKPOINT_METADATA"
TREE_METADATA = "_METADATA"
SHARDING = "_sharding"
ARRAY_METADATAS = "array_metadatas"
MANIFEST = "manifest.ocdbt"
DATA_METADATA = "metadata"
# Markers of tensorstore errors that mean the bytes on disk are wrong (not a transient failure).
_CORRUPT_MARKERS = ("DATA_LOSS", "Error decoding", "OUT_OF_RANGE")


class _Damaged(Exception):
    """One damaged file, described relative to the checked directory."""


_ABSENT = object()      # an optional file that is not there


# ------------------------------------------------------------------------------ UTF-8 paths
def is_utf8(path: str | os.PathLike) -> bool:
    """Whether `path` is valid UTF-8 text (no undecodable bytes carried as surrogates)."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(path: str | os.PathLike) -> str:
    """`path` for printing: as it is, with each byte that is not UTF-8 written `\\xNN` (as the
    shell's `$'...'` takes it), so that printing it can never raise UnicodeEncodeError."""
    return os.fsencode(os.fspath(path)).decode("utf-8", "backslashreplace")


@contextlib.contextmanager
def utf8_path(path: str | os.PathLike, key: str) -> Iterator[Path]:
    """A UTF-8 path naming the existing directory `path` for as long as the block runs: `path`
    itself when it is UTF-8 (or a URL), else a symbolic link to it (see the module docstring).
    `key` names the argument in the one-line ValueError raised when no link can be made."""
    if "://" in os.fspath(path) or is_utf8(path):
        yield Path(path)
        return
    fix = (f"{key}: '{shown(path)}' is not valid UTF-8, and orbax (tensorstore) opens only "
           "UTF-8 paths; rename the directory to UTF-8")
    try:
        holder = tempfile.mkdtemp(prefix="lwm-utf8-")
    except OSError as err:
        raise ValueError(f"{fix} (no temporary directory for a UTF-8 link: "
                         f"{err.strerror})") from None
    alias = os.path.join(holder, "dir")
    try:
        if not is_utf8(alias):
            raise ValueError(f"{fix} (the temporary directory is not UTF-8 either)")
        try:
            os.symlink(os.path.abspath(path), alias)
        except OSError as err:
            raise ValueError(f"{fix} (a UTF-8 link to it cannot be made: {err.strerror})") \
                from None
        yield Path(alias)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(alias)
        with contextlib.suppress(OSError):
            os.rmdir(holder)


# ---------------------------------------------------------------------------------- damage
def restore_detail(err: Exception) -> str:
    """What an orbax restore that raised `err` says, in at most 240 characters of one line:
    the first message along the exception's cause chain that says something (orbax wraps a
    tensorstore failure in "Encountered error while reading array index ... See full
    TensorStore details: <bound method ...>", the cause holding the status), without the long
    JSON spec tensorstore appends. Also silences the noise orbax leaves after such a failure
    ('Event loop is closed' from its threads, `ignore_failed_read_noise`)."""
    ignore_closed_event_loop_noise()
    ignore_failed_read_noise()
    for node in _chain(err):
        text = str(node)
        cut = text.find("[tensorstore_spec=")
        text = text[:cut] if cut > 0 else text
        if text.strip() and "Event loop is closed" not in text \
                and "See full TensorStore details" not in text:
            return one_line(text, 240)
    return f"{type(err).__name__} while reading it"


_ORBAX_READ_FAILURE = "Encountered error while reading array index"


class _DropFailedReads(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" records for orbax's failed reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        texts = [record.getMessage()]
        if record.exc_info and record.exc_info[1] is not None:
            texts.append(str(record.exc_info[1]))
        return not any(_ORBAX_READ_FAILURE in t for t in texts)


def ignore_failed_read_noise() -> None:
    """Drop the leftovers of an orbax restore that already failed (and was reported).

    When one array of a restore cannot be read, orbax raises at once; its reads of the other
    arrays are left unfinished, and when they are finalised later each prints a page of
    tensorstore spec, through `sys.unraisablehook` ("Exception ignored in: <coroutine ...>")
    or asyncio's logger ("Task exception was never retrieved"): long after the failure was
    reported in one line, or, in a resume that fell back to an older checkpoint, in the middle
    of training. Only exceptions and records carrying orbax's read-failure text are dropped;
    everything else still reaches the hook and handlers installed before. Installing twice is
    harmless."""
    previous = sys.unraisablehook
    if getattr(previous, "_lwm_ignores_failed_reads", False):
        return

    def hook(info):
        if _ORBAX_READ_FAILURE in str(info.exc_value):
            return
        previous(info)

    hook._lwm_ignores_failed_reads = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_DropFailedReads())


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and its causes (`__cause__`, else `__context__`), outermost first."""
    chain, seen = [], set()
    node: BaseException | None = err
    while node is not None and id(node) not in seen and len(chain) < 16:
        seen.add(id(node))
        chain.append(node)
        node = node.__cause__ or node.__context__
    return chain


def corrupt_data(err: Exception) -> str | None:
    """A few words on the damaged data an orbax restore that raised `err` ran into, when its
    cause chain holds a tensorstore status that means the bytes on disk are wrong (DATA_LOSS,
    a decoding error, a file shorter than its index says: OUT_OF_RANGE); None for any other
    failure. Also installs `ignore_failed_read_noise`."""
    ignore_failed_read_noise()
    for node in _chain(err):
        text = str(node)
        if any(marker in text for marker in _CORRUPT_MARKERS):
            return f"an array cannot be read: {one_line(text, 200)}"
    return None


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _json(file: Path, name: str, required: bool = True) -> Any:
    """The parsed JSON of `file` (`_ABSENT` when it is absent and not `required`); `_Damaged`
    for a missing, non-regular, non-UTF-8 or non-JSON file. OSError (unreadable) passes
    through."""
    if not os.path.lexists(file):
        if required:
            raise _Damaged(f"{name} is missing")
        return _ABSENT
    if not file.is_file():          # a FIFO would block the read
        raise _Damaged(f"{name} is not a regular file")
    data = file.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise _Damaged(f"{name} is not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise _Damaged(f"{name} is not valid JSON ({err.msg}: line {err.lineno}, column "
                       f"{err.colno}; truncated or overwritten?)") from None
    except RecursionError:
        raise _Damaged(f"{name} is JSON nested too deeply") from None


def _want(ok: bool, name: str, field: str, value: Any, expected: str) -> None:
    if not ok:
        where = f"{name} {field}" if field else name
        raise _Damaged(f"{where} is {_kind(value)}, expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object_or_null(doc: dict, name: str, *fields: str) -> None:
    for field in fields:
        value = doc.get(field)
        _want(value is None or isinstance(value, dict), name, field, value, "an object or null")


def _check_step_metadata(file: Path, name: str) -> None:
    doc = _json(file, name, required=False)
    if doc is _ABSENT:
        return
    _want(isinstance(doc, dict), name, "", doc, "a JSON object")
    handlers = doc.get("item_handlers")
    _want(handlers is None or isinstance(handlers, str) or (
        isinstance(handlers, dict) and all(isinstance(v, str) for v in handlers.values())),
        name, "item_handlers", handlers, "a string, an object of strings or null")
    _object_or_null(doc, name, "metrics", "performance_metrics", "custom_metadata")
    for field in ("init_timestamp_nsecs", "commit_timestamp_nsecs"):
        value = doc.get(field)
        _want(value is None or _is_int(value), name, field, value, "an integer or null")


def _check_tree_metadata(file: Path, name: str) -> bool:
    """Checks `_METADATA`; returns whether the item is an OCDBT database."""
    doc = _json(file, name)
    _want(isinstance(doc, dict), name, "", doc, "a JSON object")
    tree = doc.get("tree_metadata")
    _want(isinstance(tree, dict), name, "tree_metadata", tree, "an object")
    for leaf, entry in tree.items():
        field = f"tree_metadata[{leaf!r}]"
        _want(isinstance(entry, dict), name, field, entry, "an object")
        keys, value = entry.get("key_metadata"), entry.get("value_metadata")
        _want(isinstance(keys, list) and all(
            isinstance(k, dict) and isinstance(k.get("key"), str) and k.get("key_type") in (1, 2)
            and _is_int(k.get("key_type")) for k in keys),
            name, field + ".key_metadata", keys, "a list of {key: string, key_type: 1 or 2}")
        _want(isinstance(value, dict) and isinstance(value.get("value_type"), str)
              and isinstance(value.get("skip_deserialize"), bool),
              name, field + ".value_metadata", value,
              "an object with value_type (a string) and skip_deserialize (a boolean)")
        shape = value.get("write_shape")
        _want(shape is None or (isinstance(shape, list) and all(_is_int(n) for n in shape)),
              name, field + ".value_metadata.write_shape", shape, "a list of integers")
    for field in ("use_ocdbt", "use_zarr3", "store_array_data_equal_to_fill_value"):
        value = doc.get(field)
        _want(value is None or isinstance(value, bool), name, field, value, "true or false")
    _object_or_null(doc, name, "custom_metadata")
    return doc.get("use_ocdbt") is not False


def _check_sharding(file: Path, name: str) -> None:
    doc = _json(file, name, required=False)
    if doc is _ABSENT:
        return
    _want(isinstance(doc, dict), name, "", doc, "a JSON object")
    for key, text in doc.items():
        _want(isinstance(text, str), name, f"[{key!r}]", text, "a string")
        try:
            spec = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            raise _Damaged(f"{name} [{key!r}] is not a JSON sharding description") from None
        _want(isinstance(spec, dict), name, f"[{key!r}]", spec, "a JSON object")


def _check_array_metadatas(folder: Path, prefix: str) -> None:
    if not folder.is_dir():
        return
    for file in sorted(folder.iterdir()):
        name = f"{prefix}{ARRAY_METADATAS}/{file.name}"
        doc = _json(file, name)
        _want(isinstance(doc, dict), name, "", doc, "a JSON object")
        entries = doc.get("array_metadatas")
        _want(isinstance(entries, list) and all(
            isinstance(e, dict) and isinstance(e.get("array_metadata"), dict) for e in entries),
            name, "array_metadatas", entries, "a list of {array_metadata: {...}}")


def _check_manifest(item: Path, name: str) -> None:
    """tensorstore lists the OCDBT database's keys (reads its manifest and b-tree nodes)."""
    import tensorstore as ts
    if not os.path.lexists(item / MANIFEST):
        raise _Damaged(f"{name} is missing")
    if not (item / MANIFEST).is_file():
        raise _Damaged(f"{name} is not a regular file")
    with utf8_path(item, "checkpoint") as view:
        base = {"driver": "file", "path": os.path.abspath(view) + "/"}
        try:
            ts.KvStore.open({"driver": "ocdbt", "base": base}).result().list().result()
        except Exception as err:    # tensorstore raises ValueError (and others) with a status
            text = str(err)
            if not any(marker in text for marker in _CORRUPT_MARKERS):
                raise
            text = re.sub(r'(local )?file "[^"]*"', "the file", text)   # named already
            raise _Damaged(f"{name} cannot be decoded ({one_line(text, 160)})") from None


def _check_pytree(item: Path, prefix: str) -> None:
    _check_step_metadata(item / STEP_METADATA, prefix + STEP_METADATA)
    ocdbt = _check_tree_metadata(item / TREE_METADATA, prefix + TREE_METADATA)
    _check_sharding(item / SHARDING, prefix + SHARDING)
    _check_array_metadatas(item / ARRAY_METADATAS, prefix)
    if ocdbt:
        _check_manifest(item, prefix + MANIFEST)


def pytree_damage(item_dir: str | os.PathLike) -> str | None:
    """The first damaged metadata file of an orbax PyTree item directory (`params/` of our
    own format, a step's `state/`), described in a few words naming the file; None when every
    one is intact. Remote URLs are not inspected (None)."""
    if "://" in os.fspath(item_dir):
        return None
    try:
        _check_pytree(Path(item_dir), "")
    except _Damaged as err:
        return str(err)
    return None


def step_damage(step_dir: str | os.PathLike, pytree_items=("state",),
                json_items=("data",)) -> str | None:
    """The first damaged metadata file of a training checkpoint's step directory
    (`lwm_jax.train.checkpoint`: the PyTree item `state`, the JSON item `data`), named relative
    to the step directory (e.g. "state/_METADATA is not valid JSON (...)"); None when every
    one is intact. Remote URLs are not inspected (None)."""
    if "://" in os.fspath(step_dir):
        return None
    step = Path(step_dir)
    try:
        _check_step_metadata(step / STEP_METADATA, STEP_METADATA)
        for item in pytree_items:
            _check_pytree(step / item, f"{item}/")
        for item in json_items:
            name = f"{item}/{DATA_METADATA}"
            doc = _json(step / item / DATA_METADATA, name)
            _want(isinstance(doc, dict), name, "", doc, "a JSON object")
    except _Damaged as err:
        return str(err)
    return None
