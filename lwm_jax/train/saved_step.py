"""A compiled train step on disk: written by `lwm-jax compile --save`, loaded by
`lwm-jax train --compiled` instead of compiling on the pod.

File format (one file): the line `LWM-JAX-COMPILED-STEP 1\\n`, then one line of JSON (the
header), then the executable as `jax.experimental.serialize_executable.serialize` writes it.
The header records what the step was made for: the config sections that shape the step
(`step_config`: arch, precision, model, runtime, train, mesh and the document-reset switch;
not run_dir, data paths, checkpoint or logging, which a launch may set), the target's platform,
device kind, device count and slice count, the versions of jax, jaxlib and libtpu, the SHA-256
of the lowered program text (the step's exact computation: any change of config, code or
shapes changes it) and of the payload.

Loading (`load_compiled`) checks everything it can before touching the payload and refuses a
mismatch in one line naming what differs: the config, the devices, a version, the lowered
program. The payload holds machine code that will run on your chips, so load only files you
made; it is unpickled with an exact allow-list of the (module, name) globals such files hold
(`_ALLOWED_GLOBALS`), never an arbitrary class or function.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import json
import os
import pickle
import stat
from typing import Any

import jax

MAGIC = b"LWM-JAX-COMPILED-STEP 1\n"
# Exactly the globals that `serialize_executable.serialize` writes into our saved steps (traced
# from real `lwm-jax compile --save` files: CPU, and TPU single- and multi-slice). A global
# outside this set (e.g. an `exec` helper reachable under numpy) is refused, never imported.
_ALLOWED_GLOBALS = frozenset({
    ("jax", "P"),
    ("jax._src.core", "ManualAxisType"),
    ("jax._src.core", "MemorySpace"),
    ("jax._src.core", "ShapedArray"),
    ("jax._src.interpreters.pxla", "AllArgsInfo"),
    ("jax._src.interpreters.pxla", "UnloadedMeshExecutable"),
    ("jax._src.layout", "Layout"),
    ("jax._src.linear_util", "DebugInfo"),
    ("jax._src.mesh", "AbstractDevice"),
    ("jax._src.mesh", "AbstractMesh"),
    ("jax._src.mesh", "AxisType"),
    ("jax._src.mesh", "Mesh"),
    ("jax._src.named_sharding", "_unpickle_named_sharding"),
    ("jax._src.stages", "ArgInfo"),
    ("jaxlib._jax", "DeviceList"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),     # the same function under NumPy 1.x
})


def step_config(cfg) -> str:
    """YAML of the parts of a `RunConfig` that shape the compiled train step."""
    import yaml
    d = cfg.to_dict()
    keep = {k: d[k] for k in ("arch", "precision", "model", "runtime", "train", "mesh")}
    keep["data"] = {"reset_at_document_boundary": d["data"]["reset_at_document_boundary"]}
    return yaml.safe_dump(keep, sort_keys=True)


def versions() -> dict[str, str | None]:
    """jax, jaxlib and libtpu versions of this environment (None when not installed)."""
    out = {}
    for name in ("jax", "jaxlib", "libtpu"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def program_fingerprint(lowered) -> str:
    """SHA-256 of a lowered step's program text (its exact computation and shardings)."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def target_of(devices: list) -> dict[str, Any]:
    """What a step is compiled for: platform, device kind, device and slice counts."""
    from lwm_jax.hardware import platform_of
    from lwm_jax.train.sharding import num_slices
    return {"platform": platform_of(devices), "device_kind": str(devices[0].device_kind),
            "devices": len(devices), "slices": num_slices(devices)}


@dataclasses.dataclass
class Header:
    config_yaml: str
    target: dict[str, Any]
    topology: str
    versions: dict[str, str | None]
    program_sha256: str
    payload_sha256: str

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode() + b"\n"


def save_compiled(path: str, compiled, lowered, cfg, devices: list, topology: str) -> Header:
    """Write `compiled` (a `jax.stages.Compiled` of `lowered`) to `path` with its header.
    ValueError (one line) when the backend cannot serialize it or the file cannot be written."""
    from jax.experimental import serialize_executable
    try:
        payload, _, _ = serialize_executable.serialize(compiled)
    except Exception as err:       # e.g. a backend without executable serialization
        raise ValueError(f"--save: this backend cannot serialize the compiled step "
                         f"({type(err).__name__}: {str(err)[:200]})") from None
    header = Header(step_config(cfg), target_of(devices), topology, versions(),
                    program_fingerprint(lowered), hashlib.sha256(payload).hexdigest())
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + header.to_json() + payload)
        os.replace(tmp, path)
    except OSError as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise ValueError(f"--save: cannot write {path} ({err.strerror}); choose a writable "
                         "path") from None
    return header


def read_header(path: str) -> tuple[Header, bytes]:
    """`(header, payload)` of a saved step; ValueError (one line) for a file that is not one."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is then refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise ValueError(f"--compiled: cannot read {path} ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"--compiled: {path!r} is not a regular file; give the file "
                         "written by `lwm-jax compile --save`")
    with os.fdopen(fd, "rb") as f:
        try:
            os.set_blocking(fd, True)
            data = f.read()
        except OSError as err:
            raise ValueError(f"--compiled: cannot read {path} ({err.strerror})") from None
    bad = (f"--compiled: {path} is not a compiled step written by `lwm-jax compile --save`; "
           "write one with that command")
    if not data.startswith(MAGIC):
        raise ValueError(bad)
    end = data.find(b"\n", len(MAGIC))
    try:
        fields = json.loads(data[len(MAGIC):end])
        header = Header(**fields)
    except (ValueError, TypeError):
        raise ValueError(bad + " (its header is damaged)") from None
    payload = data[end + 1:]
    if hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        raise ValueError(f"--compiled: {path} is damaged (its payload does not match its "
                         "checksum); compile and save it again")
    return header, payload


def config_mismatch(header: Header, path: str, cfg) -> str | None:
    """One line naming the first config keys (at most three) in which the saved step's config
    differs from `cfg`'s (`step_config`), or None when they agree."""
    config_yaml = step_config(cfg)
    if header.config_yaml == config_yaml:
        return None
    old, new = _flat(header.config_yaml), _flat(config_yaml)
    diff = [f"{k}={old.get(k, '(unset)')!s:.30} there, {new.get(k, '(unset)')!s:.30} here"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return (f"--compiled: {path} was compiled for another config ({'; '.join(diff[:3])}); "
            "compile it again with this config")


def check_header(header: Header, path: str, cfg, devices: list) -> None:
    """Refuse (one-line ValueError) a saved step made for another config, other devices or
    other jax / jaxlib / libtpu versions than this run's."""
    where = f"--compiled: {path}"
    mismatch = config_mismatch(header, path, cfg)
    if mismatch is not None:
        raise ValueError(mismatch)
    here = target_of(devices)
    for key in ("platform", "device_kind", "devices", "slices"):
        if header.target.get(key) != here[key]:
            raise ValueError(f"{where} was compiled for {header.topology} "
                             f"({key} {header.target.get(key)!r}) but this run has {key} "
                             f"{here[key]!r}; compile it for this slice")
    now = versions()
    for name, saved in header.versions.items():
        if now.get(name) != saved:
            raise ValueError(f"{where} was compiled with {name} {saved} but {name} "
                             f"{now.get(name)} is installed; install {name}=={saved} or "
                             "compile it again here")


def _flat(config_yaml: str) -> dict[str, Any]:
    """Dotted keys -> values of a `step_config` YAML (empty for one that does not parse)."""
    import yaml
    try:
        doc = yaml.safe_load(config_yaml)
    except yaml.YAMLError:
        return {}
    out: dict[str, Any] = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = node
    walk("", doc if isinstance(doc, dict) else {})
    return out


class _Unpickler:
    """JAX's executable unpickler with `find_class` limited to `_ALLOWED_GLOBALS`."""

    def __new__(cls, file, backend, devices, path: str = "?"):
        from jax.experimental import serialize_executable

        class Restricted(serialize_executable._JaxPjrtUnpickler):
            def find_class(self, module, name):
                if (module, name) not in _ALLOWED_GLOBALS:
                    raise RefusedGlobal(
                        f"--compiled: {path} asks to load {module:.80}.{name:.80}, which a "
                        "compiled step written by `lwm-jax compile --save` never holds; refused "
                        "(load only files you made)")
                return super().find_class(module, name)
        return Restricted(file, backend, devices)


class RefusedGlobal(pickle.UnpicklingError):
    """A saved step's payload names a global outside `_ALLOWED_GLOBALS`."""


def load_compiled(path: str, lowered, cfg, devices: list):
    """The `jax.stages.Compiled` saved at `path`, checked against this run's config, devices,
    versions and lowered step (`lowered`: the same step lowered here, which also gives the
    argument and result trees). One-line ValueError for any mismatch."""
    header, payload = read_header(path)
    check_header(header, path, cfg, devices)
    if program_fingerprint(lowered) != header.program_sha256:
        raise ValueError(f"--compiled: {path} holds another program than this run's train step "
                         "(same config, but the code or a library changed); compile it again")
    backend = devices[0].client
    try:
        unloaded, args_info_flat, no_kwargs = _Unpickler(io.BytesIO(payload), backend,
                                                         devices, path).load()
        loaded = unloaded.load()
    except RefusedGlobal as err:
        raise ValueError(str(err)) from None
    except Exception as err:
        raise ValueError(f"--compiled: {path} could not be loaded on these devices "
                         f"({type(err).__name__}: {str(err)[:200]}); compile it again") from None
    args_info = lowered.in_tree.unflatten(args_info_flat)
    return jax.stages.Compiled(loaded, [], args_info, lowered.out_tree, no_kwargs=no_kwargs)
