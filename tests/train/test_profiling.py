"""`train.profile_steps`: the step window traced and nothing else; and the model's named
scopes in the compiled train step, so a trace reads like the model."""
import glob
import gzip
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.train.config import load_config
from lwm_jax.train.profiling import StepWindowProfiler
from lwm_jax.train.trainer import build_program


def _traced_runs(out_dir, module):
    (path,) = glob.glob(os.path.join(out_dir, "plugins", "profile", "*",
                                     "perfetto_trace.json.gz"))
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return {e["args"]["run_id"] for e in events
            if e.get("args", {}).get("hlo_module") == module and "run_id" in e["args"]}


def test_the_window_and_only_the_window_is_traced(tmp_path):
    step = jax.jit(lambda x: jnp.tanh(x @ x.T))
    x = jnp.ones((64, 64))
    step(x).block_until_ready()
    prof = StepWindowProfiler((2, 4), str(tmp_path / "p"))
    for s in range(6):
        prof.before(s)
        y = step(x + s)
        prof.after(s, y)
    prof.close()
    assert prof.traced_steps == [2, 3]
    assert len(_traced_runs(str(tmp_path / "p"), "jit__lambda")) == 2

    resumed = StepWindowProfiler((2, 4), str(tmp_path / "q"))     # resumed inside the window
    for s in range(3, 6):
        resumed.before(s)
        resumed.after(s, step(x))
    assert resumed.traced_steps == [3]
    for prof in (StepWindowProfiler((0, 2), str(tmp_path / "off"), enabled=False),
                 StepWindowProfiler(None, str(tmp_path / "none"))):
        for s in range(3):
            prof.before(s)
            prof.after(s, step(x))
        prof.close()
        assert prof.traced_steps == [] and not os.path.exists(prof.out_dir)


@pytest.mark.parametrize("arch, scopes", [
    ("rwkv7", ["time_mix", "time_mix)/wkv", "channel_mix", "head", "loss", "optimizer"]),
    ("llama", ["attention", "mlp", "head", "loss", "optimizer"]),
])
def test_the_train_step_carries_the_model_scopes(arch, scopes):
    small = ["model.n_layer=1", "model.n_embd=64", "train.ctx_len=16", "train.batch_size=2"]
    if arch == "llama":
        small += ["arch=llama", "model.n_head=2", "model.n_kv_head=1", "model.head_dim=32",
                  "model.ffn_hidden=128", "model.max_seq_len=64"]
    prog = build_program(load_config(None, small))
    tokens = jax.ShapeDtypeStruct((2, 17), np.int32)
    text = prog.train_step.lower(prog.abstract_state, tokens).as_text(debug_info=True)
    for scope in scopes:      # under autodiff a scope reads `jvp(time_mix)/...`
        assert re.search(rf"[/(]{re.escape(scope)}[/)]", text), scope
