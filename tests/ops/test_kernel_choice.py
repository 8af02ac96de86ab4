"""The rule the Pallas-kernel ops share (`lwm_jax.ops.kernel_choice.kernel_chosen`) and the
knob values: the `Runtime` knobs name exactly the values the ops take."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from lwm_jax.ops.kernel_choice import IMPLS, auto_pays_on, kernel_chosen
from lwm_jax.ops.wkv7 import IMPLS as WKV7_IMPLS
from lwm_jax.runtime import KERNEL_IMPLS, WKV_IMPLS


def test_runtime_knobs_take_the_ops_values():
    assert KERNEL_IMPLS == IMPLS
    assert WKV_IMPLS == WKV7_IMPLS


def _chosen(impl, *, per_device=True, platform="gpu", fits=True, pays=True):
    return kernel_chosen("norm_impl", impl, per_device=per_device, platform=platform, fits=fits,
                         kernel="the kernel", needs="a fit", pays=pays)


def test_the_rule():
    assert not _chosen("xla") and not _chosen("xla", fits=False, per_device=False)
    assert _chosen("auto") and _chosen("pallas") and _chosen("interpret", platform="cpu")
    for off in ({"platform": "cpu"}, {"platform": "tpu"}, {"per_device": False},
                {"fits": False}, {"pays": False}):
        assert not _chosen("auto", **off), off
    assert _chosen("pallas", pays=False)                 # "pays" only steers "auto"
    with pytest.raises(ValueError, match="norm_impl='pallas': the kernel runs per device only"):
        _chosen("pallas", per_device=False)
    with pytest.raises(ValueError, match="needs a fit; set runtime.norm_impl=xla"):
        _chosen("interpret", fits=False)
    with pytest.raises(ValueError, match="impl must be one of"):
        _chosen("cudnn")


def test_auto_pays_on_one_device_and_meshes_without_fsdp():
    """Measured: data parallel (the per-device kernels faster); unmeasured: FSDP."""
    mesh = lambda **shape: SimpleNamespace(shape={"data": 1, "fsdp": 1, "tensor": 1,  # noqa
                                                  "sequence": 1, **shape})
    assert auto_pays_on(None) and auto_pays_on(mesh(data=2)) and auto_pays_on(mesh(sequence=4))
    assert not auto_pays_on(mesh(fsdp=2)) and not auto_pays_on(mesh(data=2, fsdp=2))
