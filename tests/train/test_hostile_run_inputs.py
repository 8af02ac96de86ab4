"""Hostile inputs to a training run are refused in one line naming what to fix, never a
traceback, a hang or code execution: a crafted pickle in a saved step, a FIFO given as
`--compiled` or planted in the run dir, URL run dirs and checkpoint dirs orbax cannot write,
records without a loss in metrics.jsonl, digit-like checkpoint folder names."""
import io
import os
import pickle
import warnings

import jax
import pytest

from lwm_jax.train import saved_step
from lwm_jax.train.config import CheckpointSection, load_config
from lwm_jax.train.metrics import plot_loss_curve, read_metrics
from lwm_jax.train.run_lock import open_no_follow, refuse_links
from lwm_jax.train.trackers import JsonlTracker


class _Exec:
    """Pickles as a call of numpy's `runstring` (an `exec`) that creates `canary`."""

    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        from numpy.testing._private.utils import runstring
        return runstring, (f"open({self.canary!r}, 'w').write('pwned')", {})


def test_a_pickle_calling_an_exec_helper_is_refused_and_does_not_run(tmp_path):
    canary = tmp_path / "canary"
    payload = pickle.dumps(_Exec(str(canary)), protocol=4)
    assert b"runstring" in payload
    devices = jax.devices()
    with pytest.raises(saved_step.RefusedGlobal,
                       match=r"^--compiled: step.bin asks to load numpy\.testing\._private\."
                             r"utils\.runstring, which .* refused"):
        saved_step._Unpickler(io.BytesIO(payload), devices[0].client, devices,
                              "step.bin").load()
    assert not canary.exists()


@pytest.mark.parametrize("module,name", [("builtins", "getattr"), ("builtins", "eval"),
                                         ("numpy", "load"), ("jax", "numpy"),
                                         ("os", "system"), ("collections", "OrderedDict")])
def test_only_the_exact_globals_of_saved_steps_are_allowed(module, name):
    assert (module, name) not in saved_step._ALLOWED_GLOBALS
    payload = b"\x80\x04c" + f"{module}\n{name}\n".encode() + b"."
    devices = jax.devices()
    with pytest.raises(saved_step.RefusedGlobal, match=f"{module}.{name}"):
        saved_step._Unpickler(io.BytesIO(payload), devices[0].client, devices, "f").load()


def test_compiled_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "step.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"^--compiled: '.*step.fifo' is not a regular file"):
        saved_step.read_header(str(fifo))
    with pytest.raises(ValueError, match=r"^--compiled: '.*' is not a regular file"):
        saved_step.read_header(str(tmp_path))


@pytest.mark.parametrize("override,match", [
    ("checkpoint.dir=foo://bucket/ckpt",
     r"^checkpoint.dir: 'foo://bucket/ckpt': only gs:// URLs are supported \(unsupported URL "
     r"scheme 'foo'\); use a local path or gs://BUCKET/PATH$"),
    ("checkpoint.dir=s3://b/c", r"^checkpoint.dir: 's3://b/c': only gs:// URLs are supported"),
    ("run_dir=gs://bucket/run",
     r"^run_dir: 'gs://bucket/run' is a URL, but lwm-jax train writes the run dir with local "
     r"file calls; keep run_dir local and set checkpoint.dir=gs://"),
    ("run_dir=file:///tmp/run", r"^run_dir: 'file:///tmp/run' is a URL"),
])
def test_url_locations_orbax_or_the_run_cannot_write_are_refused(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [override], data_files=False)


def test_local_and_gs_locations_are_accepted():
    cfg = load_config(None, ["checkpoint.dir=gs://bucket/ckpt", "run_dir=runs/x"],
                      data_files=False)
    assert cfg.checkpoint_dir == "gs://bucket/ckpt"


def test_records_without_a_loss_are_damaged_lines_and_the_plot_does_not_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 5.0, "loss_mean": 5.1}\n{"step": 1}\n'
                    '{"step": 2, "loss": "x"}\n{"step": 3, "loss": 1e999}\n'
                    '{"step": 4, "loss": null}\n{"step": 5, "loss": 4.0, "loss_mean": []}\n'
                    '{"step": 6, "val_loss": null}\n{"step": 7, "val_loss": {}}\n'
                    + "[" * 100000 + "\n")
    with pytest.warns(RuntimeWarning, match="6 damaged line"):
        train, evals = read_metrics(str(path))
    assert [r["step"] for r in train] == [0, 4] and [r["step"] for r in evals] == [6]
    with warnings.catch_warnings(record=True):
        plot_loss_curve(str(path), str(tmp_path / "loss_curve.png"))
    assert (tmp_path / "loss_curve.png").stat().st_size > 0


def test_an_empty_plot_has_no_legend_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_loss_curve(str(path), str(tmp_path / "loss_curve.png"))


def test_a_fifo_in_the_run_dir_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    msg = rf"^run_dir: '{tmp_path}/metrics.jsonl' is not a regular file \(a FIFO\); remove it$"
    with pytest.raises(ValueError, match=msg):
        JsonlTracker(str(tmp_path))
    with pytest.raises(ValueError, match=msg):
        read_metrics(str(fifo))
    with pytest.raises(ValueError, match=msg):
        refuse_links(str(tmp_path))
    for flags in (os.O_WRONLY | os.O_CREAT, os.O_RDONLY):
        with pytest.raises(ValueError, match=msg):
            open_no_follow(str(fifo), flags)
    os.mkdir(tmp_path / "config.yaml")
    with pytest.raises(ValueError, match=r"config.yaml' is not a regular file \(a directory\)"):
        open_no_follow(str(tmp_path / "config.yaml"), os.O_WRONLY | os.O_CREAT)


def test_digit_like_checkpoint_folders_are_ignored(tmp_path):
    from lwm_jax.train.checkpoint import Checkpointer
    for name in ("²", "٣", "７"):     # str.isdigit() is True, int() fails on the first
        os.mkdir(tmp_path / name)
    ckpt = Checkpointer(str(tmp_path), CheckpointSection(async_=False))
    assert ckpt._step_dirs() == []
