"""`lwm-jax train` on text tokenised on the fly: a weighted mixture of a JSONL directory, a
Parquet file and a binidx file trains, stops and resumes to exactly the losses of one run."""
import os
import sys

import numpy as np
import pytest

from lwm_jax.data import write_binidx
from lwm_jax.train.compile_cache import enable_compilation_cache
from lwm_jax.train.config import load_config
from lwm_jax.train.metrics import read_metrics
from lwm_jax.train.trainer import train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "data"))
from test_text_sources import write_corpus  # noqa: E402

RUN = ["arch=llama", "model.n_layer=1", "model.n_embd=64", "model.n_head=2",
       "model.n_kv_head=1", "model.head_dim=32", "model.ffn_hidden=128", "model.max_seq_len=64",
       "train.ctx_len=32", "train.batch_size=4", "train.steps=6", "train.warmup_steps=1",
       "train.log_every=1", "train.eval_every=3", "train.eval_batches=1", "checkpoint.every=3",
       "checkpoint.async=false", "logging.trackers=[jsonl]"]


def test_a_text_mixture_trains_and_resumes_exactly(tmp_path):
    enable_compilation_cache(str(tmp_path / "jax-compile"))    # the second run reuses the steps
    write_corpus(tmp_path / "corpus")
    os.rename(tmp_path / "corpus" / "z.parquet", tmp_path / "extra.parquet")
    prefix = str(tmp_path / "bin")
    rng = np.random.default_rng(0)
    write_binidx(prefix, [rng.integers(1, 256, 300) for _ in range(6)], np.uint16,
                 append_eod=True)
    data = [f"data.sources=[{tmp_path / 'corpus'}, {tmp_path / 'extra.parquet'}, {prefix}]",
            "data.weights=[2.0, 1.0, 1.0]", f"data.val_path={prefix}"]

    whole = train(load_config(None, RUN + data + [f"run_dir={tmp_path / 'whole'}"]),
                  progress=False)
    cfg = load_config(None, RUN + data + [f"run_dir={tmp_path / 'split'}"])
    assert train(cfg, progress=False, stop_after=3).step == 3
    assert train(cfg, progress=False).step == 6

    losses = {name: [r["loss"] for r in read_metrics(str(tmp_path / name / "metrics.jsonl"))[0]]
              for name in ("whole", "split")}
    assert len(losses["whole"]) == 6 and losses["split"] == losses["whole"]
    assert whole.final_val_loss is not None and np.isfinite(whole.final_val_loss)

    with pytest.raises(ValueError, match=r"^data.weights: the checkpoint's data order used"):
        train(load_config(None, RUN + data[:1] + ["data.weights=[1.0, 1.0, 1.0]",
                                                  "train.steps=8", data[2],
                                                  f"run_dir={tmp_path / 'split'}"]),
              progress=False)


def test_text_validation_is_held_out_documents_only(tmp_path):
    """`data.val_fraction` was ignored for text (no validation at all); now validation scores
    held-out documents that training never reads, each mixture source giving its share."""
    from lwm_jax.data.text_sources import open_documents
    from lwm_jax.train.batches import train_data
    texts = write_corpus(tmp_path / "corpus", n_files=6, docs_per_file=30)
    prefix = str(tmp_path / "bin")
    write_binidx(prefix, [np.full(40, 200 + i) for i in range(20)], np.uint16, append_eod=True)
    cfg = load_config(None, RUN + [f"data.path={tmp_path / 'corpus'}", "data.val_fraction=0.2",
                                   "data.tokenizer=byte", "train.eval_batches=2"])
    data = train_data(cfg.data, cfg.model, cfg.train)
    assert "held-out tokens, 0.2 of the documents" in data.description
    held = set(open_documents(str(tmp_path / "corpus"), val_fraction=0.2).held_out_documents())
    every = {t for docs in texts.values() for t in docs}
    assert held and held < every
    rows = np.concatenate([data.val.batch_at(i) for i in range(data.val.steps_per_epoch)])
    stream = bytes(np.concatenate([rows[0], *[r[1:] for r in rows[1:]]]).astype(np.uint8))
    scored = [p.decode() for p in stream.split(b"\0")[1:-1]]
    assert scored and set(scored) <= held                     # validation: held out only
    rows = np.concatenate([next(data.sampler) for _ in range(40)])
    trained = {p.decode() for r in rows for p in bytes(r.astype(np.uint8)).split(b"\0")[1:-1]}
    assert trained and not trained & held                     # training: never held out
    assert data.val.tokens.size == cfg.train.eval_batches * 4 * 32 + 1   # read up to the cap

    mix = load_config(None, RUN + [f"data.sources=[{tmp_path / 'corpus'}, {prefix}]",
                                   "data.weights=[3.0, 1.0]", "data.val_fraction=0.2",
                                   "train.eval_batches=2"])
    data = train_data(mix.data, mix.model, mix.train)
    val = np.asarray(data.val.tokens)
    from_bin = int(np.sum(val >= 200))                         # the binidx's last documents
    assert 0 < from_bin <= np.ceil(len(val) / 4) and set(val[val >= 200]) <= {216, 217, 218, 219}


def test_a_validation_split_too_small_is_refused_before_the_model_is_built(tmp_path,
                                                                           monkeypatch, capsys):
    """It was refused only after the model was built and the step compiled (~50 s on a GPU);
    now first, in one line naming the keys and the fix."""
    import lwm_jax.train.trainer as trainer
    from lwm_jax.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")
    monkeypatch.setattr(trainer, "build_program", no_model)
    write_corpus(tmp_path / "corpus")
    prefix = str(tmp_path / "bin")
    write_binidx(prefix, [np.full(100, 7) for _ in range(20)], np.uint16, append_eod=True)
    small = ["train.batch_size=4", "train.ctx_len=32", "data.val_fraction=0.02"]
    for data in (f"data.path={tmp_path / 'corpus'}", f"data.path={prefix}"):
        cfg = load_config(None, RUN + [data, *small, f"run_dir={tmp_path / 'run'}"])
        with pytest.raises(ValueError, match=r"^data.val_fraction: validation split too small: "
                                             r"it holds \d+ tokens, fewer than the "
                                             r"train.batch_size \* train.ctx_len \+ 1 = 4 \* 32 "
                                             r"\+ 1 = 129 of one validation batch; raise "
                                             r"data.val_fraction"):
            train(cfg, progress=False)
    # binidx: 20 documents of 101 tokens; 129 tokens need the last 2 documents, 0.1 of them
    assert "raise data.val_fraction (to 0.1 or more), lower" in str(pytest.raises(
        ValueError, train, cfg, progress=False).value)
    from lwm_jax.train.batches import train_data
    enough = load_config(None, RUN + [f"data.path={prefix}", *small, "data.val_fraction=0.1"])
    assert train_data(enough.data, enough.model, enough.train).val.steps_per_epoch == 1
    assert main(["train", *RUN, f"data.path={prefix}", *small,
                 f"run_dir={tmp_path / 'cli'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("lwm-jax train: error: data.val_fraction: validation split too small")
    assert not os.path.exists(tmp_path / "cli" / "config.yaml")


def test_an_unreachable_hf_dataset_is_refused_before_the_model_is_built(tmp_path, monkeypatch,
                                                                        capsys):
    datasets = pytest.importorskip("datasets")
    import lwm_jax.train.trainer as trainer
    from lwm_jax.cli import main

    def unreachable(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr(trainer, "build_program", lambda *a, **k: pytest.fail("model built"))
    for val_fraction in ("0.05", "0"):          # the held-out read, or the probe
        assert main(["train", *RUN, "data.path=hf:JeanKaddour/minipile", "data.tokenizer=byte",
                     f"data.val_fraction={val_fraction}", f"run_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert err.startswith("lwm-jax train: error: data.path: hf:JeanKaddour/minipile cannot "
                              "be streamed: the Hugging Face Hub is not reachable")
        assert "set data.path=hf:DIR" in err
