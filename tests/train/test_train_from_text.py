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
