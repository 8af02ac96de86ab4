"""Seeded permutation, window sampler (determinism, coverage, checkpoint, hosts) and the val split."""
import json

import numpy as np
import pytest

from lwm_jax.data.binidx import write_binidx
from lwm_jax.data.permutation import derive_key, permute
from lwm_jax.data.sampler import WindowSampler, split_train_val


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_permute_is_a_bijection(n):
    for key in (0, 12345, derive_key(7, 3)):
        out = permute(np.arange(n), n, key)
        assert out.dtype == np.int64
        np.testing.assert_array_equal(np.sort(out), np.arange(n))
        assert int(permute(n - 1, n, key)) == out[-1]  # scalar and array forms agree


def test_permute_depends_on_key_and_is_not_identity():
    n = 1000
    a, b = permute(np.arange(n), n, 1), permute(np.arange(n), n, 2)
    assert np.mean(a == b) < 0.05 and np.mean(a == np.arange(n)) < 0.05
    np.testing.assert_array_equal(a, permute(np.arange(n), n, 1))
    # fixed values pin the arithmetic: a change here silently changes every run's data order
    np.testing.assert_array_equal(permute(np.arange(8), 10, 0), [8, 3, 6, 0, 7, 2, 4, 5])
    with pytest.raises(ValueError, match=r"index must lie in \[0, 10\)"):
        permute([10], 10, 0)


def _sampler(tokens, **kw):
    args = dict(ctx_len=8, global_batch_size=4, seed=3)
    args.update(kw)
    return WindowSampler(tokens, **args)


def test_windows_are_slices_and_epoch_covers_each_window_once():
    tokens = np.arange(1003, dtype=np.int64)
    s = _sampler(tokens)
    assert s.num_windows == (1003 - 1 - 7) // 8 and s.steps_per_epoch == s.num_windows // 4
    for epoch in range(3):
        starts = []
        for step in range(epoch * s.steps_per_epoch, (epoch + 1) * s.steps_per_epoch):
            batch = s.batch_at(step)
            assert batch.shape == (4, 9) and batch.dtype == np.int32
            np.testing.assert_array_equal(batch, batch[:, :1] + np.arange(9))  # contiguous windows
            starts.extend(batch[:, 0].tolist())
        offset = starts[0] % 8
        assert 0 <= offset < 8 and all(x % 8 == offset for x in starts)
        assert len(set(starts)) == len(starts) == s.steps_per_epoch * 4
        assert max(starts) + 9 <= len(tokens)
    offsets = {s.epoch_offset(e) for e in range(20)}
    assert len(offsets) > 3  # boundaries move between epochs


def test_no_shuffle_no_offset_is_sequential():
    s = _sampler(np.arange(200), shuffle=False, random_offset=False)
    np.testing.assert_array_equal(s.batch_at(0)[:, 0], [0, 8, 16, 24])
    np.testing.assert_array_equal(s.batch_at(1)[:, 0], [32, 40, 48, 56])
    assert s.num_windows == (200 - 1) // 8


def test_determinism_and_seed_dependence():
    tokens = np.random.default_rng(0).integers(0, 50000, 5000).astype(np.uint16)
    a, b, c = _sampler(tokens), _sampler(tokens), _sampler(tokens, seed=4)
    for step in (0, 1, 57, 300):
        np.testing.assert_array_equal(a.batch_at(step), b.batch_at(step))
    assert not np.array_equal(a.batch_at(0), c.batch_at(0))


def test_checkpoint_resume_reproduces_stream(tmp_path):
    tokens = write_binidx(tmp_path / "t", [np.arange(1, 3000) % 65000], np.uint16).tokens
    ref = _sampler(tokens)
    expected = [next(ref) for _ in range(12)]
    run = _sampler(tokens)
    for _ in range(5):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON round trip
    assert state["step"] == 5 and state["epoch"] == 5 // run.steps_per_epoch
    resumed = _sampler(tokens)
    resumed.load_state_dict(state)
    for i in range(5, 12):
        np.testing.assert_array_equal(next(resumed), expected[i])
    with pytest.raises(ValueError, match="sampler state has seed=3 but this sampler has seed=9"):
        _sampler(tokens, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size=4 but this sampler has global_batch_size=8"):
        _sampler(tokens, global_batch_size=8).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks key"):
        resumed.load_state_dict({"epoch": 0})


def test_hosts_read_disjoint_slices_of_the_global_batch():
    tokens = np.arange(10_000)
    whole = _sampler(tokens, global_batch_size=8)
    hosts = [_sampler(tokens, global_batch_size=8, host_index=h, host_count=4) for h in range(4)]
    for step in (0, 3, whole.steps_per_epoch + 1):
        parts = [h.batch_at(step) for h in hosts]
        assert all(p.shape == (2, 9) for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), whole.batch_at(step))


@pytest.mark.parametrize("kw, message", [
    (dict(ctx_len=0), "ctx_len must be positive"),
    (dict(global_batch_size=6, host_count=4), "must be divisible by host_count=4"),
    (dict(host_index=2, host_count=2), r"host_index must lie in \[0, host_count=2\)"),
    (dict(ctx_len=100, global_batch_size=4), "fewer than global_batch_size=4"),
])
def test_bad_arguments(kw, message):
    with pytest.raises(ValueError, match=message):
        _sampler(np.arange(300), **kw)
    with pytest.raises(TypeError, match="integers"):
        _sampler(np.zeros(300, np.float32))


def test_split_train_val_by_tokens_and_documents(tmp_path):
    docs = [np.full(n, i + 1) for i, n in enumerate([30, 25, 20, 15, 10])]
    ds = write_binidx(tmp_path / "d", docs, np.uint16, append_eod=True)  # 105 tokens
    train, val = split_train_val(ds.tokens, 0.1)
    assert len(val) == round(105 * 0.1) and len(train) + len(val) == 105
    assert isinstance(train, np.memmap) and isinstance(val, np.memmap)
    train, val = split_train_val(ds.tokens, 0.2, boundaries=ds.sequence_bounds())
    # target cut 84; document starts at 31, 57, 78, 94: the nearest is 78 (docs 4 and 5 held out)
    assert len(train) == 78 and val[0] == 4 and val[-1] == 0 and train[-1] == 0
    v = WindowSampler(val, ctx_len=4, global_batch_size=2, shuffle=False, random_offset=False)
    np.testing.assert_array_equal(v.batch_at(0)[0], val[:5])
    with pytest.raises(ValueError, match="val_fraction must lie in"):
        split_train_val(ds.tokens, 1.0)
