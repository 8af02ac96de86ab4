"""Run config: defaults, shipped YAMLs, overrides, one-line errors, CLI error path."""
import dataclasses
import glob
import os

import numpy as np
import pytest
import yaml

from lwm_jax.runtime import Runtime
from lwm_jax.cli import main
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.train.config import (MeshSection, RunConfig, build_config, check_against_mesh,
                                  load_config, mesh_shape)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
DATA_DOCS = (4, 300)         # the `data_prefix` fixture (conftest.py): 4 random documents


def test_builtin_defaults_equal_configs_tiny_yaml():
    assert load_config(os.path.join(REPO, "configs", "tiny.yaml")) == load_config(None)
    assert load_config(None) == RunConfig()


def test_every_shipped_config_loads(data_prefix):
    expected = {  # name: (L, C, V, resolved lora sizes decay/a/v/gate)
        "tiny": (4, 256, 256, None),
        "rwkv7-0.1b": (12, 768, 65536, (64, 64, 32, 128)),
        "rwkv7-0.4b": (24, 1024, 65536, (64, 64, 64, 160)),
        "rwkv7-1.5b": (24, 2048, 65536, (96, 96, 64, 256)),
        "rwkv7-2.9b": (32, 2560, 65536, (128, 128, 96, 256)),
        "llama-tiny": (4, 256, 256, None),
        "rwkv7-hybrid-tiny": (4, 256, 256, None),
        "llama-0.1b": (12, 768, 65536, None),
        "llama-1b": (16, 2048, 128256, None),
    }
    assert sorted(os.path.basename(p)[:-5] for p in CONFIGS) == sorted(expected)
    for path in CONFIGS:
        with open(path) as f:
            raw = yaml.safe_load(f)
        overrides = [f"data.path={data_prefix}"] if raw.get("data", {}).get("path") else []
        cfg = load_config(path, overrides)
        L, C, V, lora = expected[cfg.name]
        m = cfg.model.resolved()
        assert (m.n_layer, m.n_embd, m.vocab_size) == (L, C, V), path
        if lora is not None:
            assert (m.decay_lora, m.a_lora, m.v_lora, m.gate_lora) == lora, path
            t = cfg.train
            assert (t.betas, t.eps, t.weight_decay, t.grad_clip) == ((0.9, 0.99), 1e-18, 1e-3, 1.0)
            assert (t.lr, t.min_lr, cfg.precision) == (6e-4, 6e-5, "bf16-mixed")
            assert t.ctx_len in (512, 4096) and cfg.data.tokenizer == "world"
    assert load_config(os.path.join(REPO, "configs", "rwkv7-0.1b.yaml"),
                       [f"data.path={data_prefix}"]).model.param_count() == 191_084_544


def test_overrides_are_typed_yaml_values():
    cfg = load_config(None, ["train.lr=3e-4", "model.n_layer=2", "precision=bf16-mixed",
                             "train.betas=[0.9, 0.95]", "checkpoint.async=false",
                             "run_dir=/tmp/somewhere", "data.tokenizer=byte"])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.model.n_layer == 2 and cfg.precision == "bf16-mixed"
    assert cfg.train.betas == (0.9, 0.95) and cfg.checkpoint.async_ is False
    assert cfg.resolved_run_dir == "/tmp/somewhere"
    assert cfg.checkpoint_dir == os.path.join("/tmp/somewhere", "checkpoints")
    # a value that is not valid Python is still only YAML-parsed, never evaluated
    with pytest.raises(ValueError, match=r"^name: expected a string, got \['__import__'\]$"):
        load_config(None, ["name=[__import__]"])


def test_yaml_round_trip(tmp_path, data_prefix):
    cfg = load_config(None, ["train.lr=1e-3", f"data.path={data_prefix}", "name=rt"])
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(str(path)) == cfg


def test_run_name_defaults_to_file_stem(tmp_path):
    path = tmp_path / "my-run.yaml"
    path.write_text("train:\n  steps: 5\n  warmup_steps: 2\n")
    cfg = load_config(str(path))
    assert cfg.name == "my-run" and cfg.resolved_run_dir == os.path.join("runs", "my-run")
    assert cfg.train.steps == 5 and cfg.model == RunConfig().model


@pytest.mark.parametrize("overrides, message", [
    (["train.lrr=1"], "train.lrr: unknown key; valid keys: batch_size, betas, ctx_len, eps, "
                      "eval_batches, eval_every, grad_accum, grad_clip, l2wrap, log_every, "
                      "loss_chunk, lr, max_consecutive_skips, min_lr, profile_steps, seed, "
                      "steps, warmup_steps, weight_decay"),
    (["foo=1"], "foo: unknown key; valid keys: arch, checkpoint, data, logging, mesh, model, "
                "name, precision, run_dir, runtime, train"),
    (["logging.trackers=[jsonl, mlflow]"],
     "logging.trackers[1]: 'mlflow' is not one of jsonl, tensorboard, wandb"),
    (["logging.trackers=[jsonl, jsonl]"],
     "logging.trackers[1]: jsonl is listed twice; list each tracker once"),
    (["train.profile_steps=[5, 5]"],
     "train.profile_steps: [5, 5] must satisfy 0 <= start < stop <= train.steps=150"),
    (["data.reset_at_document_boundary=1"],
     "data.reset_at_document_boundary: expected true or false, got 1"),
    (["runtime.wkv_impl=fast"], "runtime.wkv_impl: 'fast' is not one of ('auto', 'pallas', "
                                "'chunked', 'recurrent')"),
    (["runtime.remat=maybe"], "runtime.remat: expected true or false, got 'maybe'"),
    (["runtime.scan=true"], "runtime.scan: unknown key; valid keys: chunk_size, ffn_impl, "
                            "ln_x_impl, norm_impl, remat, remat_layers, remat_policy, "
                            "scan_layers, wkv_impl"),
    (["runtime.ffn_impl=cublas"], "runtime.ffn_impl: 'cublas' is not one of ('auto', 'xla', "
                                  "'pallas', 'interpret')"),
    (["runtime.ln_x_impl=triton"], "runtime.ln_x_impl: 'triton' is not one of ('auto', 'xla', "
                                   "'pallas', 'interpret')"),
    (["runtime.remat_layers=-2"], "runtime.remat_layers: must be -1 (every block) or a number "
                                  "of blocks >= 0, got -2"),
    (["runtime.remat_layers=half"], "runtime.remat_layers: expected an integer, got 'half'"),
    (["runtime.remat_policy=dots"], "runtime.remat_policy: 'dots' is not one of ('full', "
                                    "'save_dots')"),
    (["model.remat=true", "runtime.remat=false"],
     "model.remat: is a runtime key, also set as runtime.remat; keep only runtime.remat"),
    (["model.n_layers=2"], "model.n_layers: unknown key; valid keys: "),
    (["train.lr=fast"], "train.lr: expected a number, got 'fast'"),
    (["train.steps=1.5"], "train.steps: expected an integer, got 1.5"),
    (["run_dir=/tmp/\udcffrun"], "run_dir: the value holds byte 0xff, which is not UTF-8"),
    (["data.path=d\udce9ta"], "data.path: the value holds byte 0xe9, which is not UTF-8"),
    # beyond int32 (the device's step counter and seeds): named, never an OverflowError later
    (["train.steps=9223372036854775808"], "train.steps: 9223372036854775808 is out of range; "
                                          "config integers lie within +-2147483647"),
    (["train.seed=-99999999999999999999"], "train.seed: -99999999999999999999 is out of range"),
    (["train.ctx_len=4294967296"], "train.ctx_len: 4294967296 is out of range"),
    (["train.l2wrap=yes please"], "train.l2wrap: expected true or false, got 'yes please'"),
    (["train.betas=[0.9]"], "train.betas: expected a list of 2 numbers, got [0.9]"),
    (["train.betas=[0.9, 1.0]"], "train.betas[1]: must be in [0, 1), got 1.0"),
    (["train.ctx_len=0"], "train.ctx_len: must be >= 1, got 0"),
    (["train.lr=0"], "train.lr: must be > 0, got 0.0"),
    (["train.lr=1e39"], "train.lr: 1e+39 is beyond 1e+30: one AdamW update would move the weights out"),
    (["train.lr=1e-4"], "train.min_lr: 0.0003 is larger than train.lr=0.0001; lower "
                        "train.min_lr too"),
    (["train.batch_size=6", "train.grad_accum=4"],
     "train.batch_size: 6 is not divisible by train.grad_accum=4"),
    (["data.path=/no/such/data"], "data.path: /no/such/data.bin not found (a binidx pair "
                                  "<prefix>.bin + <prefix>.idx); create it with `lwm-jax prepare "
                                  "--input <.jsonl/.parquet/.txt files> --output /no/such/data "
                                  "--tokenizer byte`, or stream the text instead with "
                                  "data.path=hf:<dataset>[:<config>[:<split>]] (e.g. "
                                  "data.path=hf:JeanKaddour/minipile), or give data.path a "
                                  "directory or .jsonl/.parquet/.txt file of text, or "
                                  "data.path=null for the embedded corpus"),
    (["data.path=hf:some/dataset", "data.val_path=/no/val"],
     "data.val_path: /no/val.bin not found (a binidx pair <prefix>.bin + <prefix>.idx); create "
     "it with `lwm-jax prepare --input <.jsonl/.parquet/.txt files> --output /no/val "),
    (["data.path=/no/such/corpus.jsonl"], "data.path: /no/such/corpus.jsonl not found; give a "
                                          "directory or a .jsonl, .parquet or .txt file"),
    (["data.sources=[hf:a, hf:b]", "data.weights=[1.0]"],
     "data.weights: 1 weights for 2 data.sources; give one per source, or none for equal "
     "weights"),
    (["data.sources=[hf:a, hf:b]", "data.weights=[1.0, 0]"], "data.weights[1]: must be > 0"),
    (["data.sources=[hf:a]", "data.path=hf:b"], "data.sources: set data.path or data.sources, "
                                                "not both"),
    (["precision=fp8"], "precision: unknown preset 'fp8'"),
    (["model.n_embd=100"], "model.n_embd: 100 is not a multiple of model.head_size=64"),
    (["mesh.fsdp=0"], "mesh.fsdp: must be >= 1 or -1 (= the remaining devices), got 0"),
    (["mesh.fsdp=-1"], "mesh: at most one axis may be -1"),
    (["train=3"], "train: expected a mapping of keys, got 3"),
    (["train.lr.x=1"], "train.lr: expected a finite number, got {'x': 1}"),
    (["train.lr"], "override 'train.lr': expected key=value, e.g. train.lr=3e-4"),
])
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ValueError) as info:
        load_config(None, overrides)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(message), text


def test_device_dependent_checks():
    assert mesh_shape(MeshSection(), 4) == {"data": 4, "fsdp": 1, "tensor": 1, "sequence": 1}
    assert mesh_shape(MeshSection(data=1, fsdp=-1, tensor=2), 8)["fsdp"] == 4
    with pytest.raises(ValueError, match=r"^mesh: data\*fsdp\*tensor\*sequence = 2 but 4 "
                                         r"devices are available; set one axis to -1 to fill$"):
        mesh_shape(MeshSection(data=2), 4)
    with pytest.raises(ValueError, match=r"^mesh: the fixed axis sizes .* do not divide the 4 "):
        mesh_shape(MeshSection(data=-1, tensor=3), 4)
    cfg = load_config(None, ["train.batch_size=6", "train.ctx_len=256"])
    with pytest.raises(ValueError, match=r"^train\.batch_size: 6 sequences \(6 per micro-batch "
                                         r"with train\.grad_accum=1\) is not divisible by mesh "
                                         r"data\*fsdp = 4 devices$"):
        check_against_mesh(cfg, {"data": 2, "fsdp": 2, "tensor": 1, "sequence": 1})
    with pytest.raises(ValueError, match=r"^train\.ctx_len: 256 is not divisible by "
                                         r"mesh\.sequence=3$"):
        check_against_mesh(cfg, {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 3})
    check_against_mesh(load_config(None, ["train.batch_size=8"]),
                       {"data": 2, "fsdp": 2, "tensor": 1, "sequence": 2})


def test_runtime_keys_of_older_configs_still_load_from_the_model_section():
    """Before the `runtime:` section, wkv_impl / chunk_size / remat / scan_layers sat under
    `model:`; such configs (and saved run configs) load, with the keys moved to `runtime`."""
    cfg = build_config({"model": {"n_layer": 2, "wkv_impl": "recurrent", "remat": True}})
    assert cfg.runtime == Runtime(wkv_impl="recurrent", remat=True)
    assert cfg.model == dataclasses.replace(RunConfig().model, n_layer=2)
    assert "remat" not in cfg.to_dict()["model"] and cfg.to_dict()["runtime"]["remat"] is True
    assert build_config(cfg.to_dict()) == cfg


def test_model_section_merges_onto_tiny_defaults():
    cfg = build_config({"model": {"n_layer": 2}})
    assert cfg.model == dataclasses.replace(RunConfig().model, n_layer=2)
    assert isinstance(cfg.model, ModelConfig)


def test_cli_reports_one_line_error(capsys):
    assert main(["train", "train.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("lwm-jax train: error: train.lrr: unknown key; valid keys: ")


def test_cli_print_config(capsys, tmp_path):
    assert main(["train", "--print-config", "model.n_layer=3", f"run_dir={tmp_path}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["n_layer"] == 3 and printed["run_dir"] == str(tmp_path)
    assert build_config(printed) == load_config(None, ["model.n_layer=3", f"run_dir={tmp_path}"])


README_EXAMPLE = ["--config", os.path.join(REPO, "configs", "rwkv7-0.1b.yaml"), "train.lr=3e-4",
                  "precision=bf16-mixed"]


def test_print_config_of_the_readme_example_needs_no_data(capsys, tmp_path, monkeypatch):
    """README's first example, with --print-config, printed `data/minipile.bin not found`
    instead of the config: printing never needs the data."""
    monkeypatch.chdir(tmp_path)                     # data/minipile.* cannot exist here
    assert main(["train", *README_EXAMPLE, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["path"] == "data/minipile" and printed["train"]["lr"] == 3e-4
    assert printed["precision"] == "bf16-mixed"


def test_missing_training_data_says_how_to_get_it(capsys, tmp_path, monkeypatch):
    """Without --print-config the missing data is one line naming data.path, the `lwm-jax
    prepare` command that makes it and the `hf:` stream that needs none."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *README_EXAMPLE]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("lwm-jax train: error: data.path: data/minipile.bin not found")
    assert ("`lwm-jax prepare --input <.jsonl/.parquet/.txt files> --output data/minipile "
            "--tokenizer world`") in err
    assert "data.path=hf:JeanKaddour/minipile" in err


@pytest.mark.parametrize("name", ["rwkv7-0.1b.yaml", "llama-0.1b.yaml"])
def test_the_configs_streaming_alternative_loads(name):
    """The `data.path=hf:...` override the config's header comment shows is a valid `hf:`
    source for that config (no data file needed)."""
    from lwm_jax.data.text_sources import HFDocuments, source_kind
    path = os.path.join(REPO, "configs", name)
    shown = [w for line in open(path, encoding="utf-8") if line.startswith("#")
             for w in line.split() if w.startswith("data.path=hf:")]
    assert shown == ["data.path=hf:JeanKaddour/minipile"]
    cfg = load_config(path, shown)
    assert source_kind(cfg.data.path) == "hf"
    pytest.importorskip("datasets")
    docs = HFDocuments(cfg.data.path)
    assert (docs.path, docs.config, docs.split) == ("JeanKaddour/minipile", None, "train")


def test_cli_prepare_feeds_train_config(tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "def f(x):\\n    return x\\n"}\n{"text": "print(1)"}\n')
    prefix = tmp_path / "out" / "mine"
    prefix.parent.mkdir()
    assert main(["prepare", "--input", str(docs), "--output", str(prefix), "--tokenizer", "byte",
                 "--quiet"]) == 0
    assert "2 documents" in capsys.readouterr().out
    cfg = load_config(None, [f"data.path={prefix}"])
    assert cfg.data.path == str(prefix)
    assert main(["prepare", "--input", str(tmp_path / "none.txt"), "--output", str(prefix)]) == 2
    assert capsys.readouterr().err.startswith("lwm-jax prepare: error: --input ")


def test_token_ids_beyond_the_model_vocabulary_are_a_clear_error():
    from lwm_jax.train.batches import to_global
    from lwm_jax.train.sharding import make_mesh, tokens_sharding
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1})
    ok = np.arange(2 * 9, dtype=np.int32).reshape(2, 9)
    assert to_global(ok, tokens_sharding(mesh), 2, vocab_size=18).shape == (2, 9)
    with pytest.raises(ValueError, match=r"data: token id 17 is outside model.vocab_size=17"):
        to_global(ok, tokens_sharding(mesh), 2, vocab_size=17)


def test_resuming_accepts_a_saved_config_with_runtime_keys_under_model(tmp_path):
    """A run dir written before the `runtime:` section resumes; a changed runtime does not
    block a resume (it changes no parameter), a changed architecture still does."""
    import yaml
    from lwm_jax.train.trainer import _check_same_model
    cfg = load_config(None, [f"run_dir={tmp_path}", "runtime.remat=true"])
    os.makedirs(cfg.checkpoint_dir)
    old = cfg.to_dict()
    old["model"] = {**old["model"], "wkv_impl": "auto", "chunk_size": 0, "remat": False,
                    "scan_layers": False}
    del old["runtime"]
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(old))
    _check_same_model(str(saved), cfg)
    old["model"]["n_layer"] = cfg.model.n_layer + 1
    saved.write_text(yaml.safe_dump(old))
    with pytest.raises(ValueError, match="model.n_layer="):
        _check_same_model(str(saved), cfg)


def test_a_low_rank_size_of_0_is_refused_and_null_takes_the_rule(capsys, tmp_path):
    """`model.decay_lora: 0` once silently meant RWKV-LM's rule (32 at C=256); now null (or
    no key) means the rule and 0 is one line naming the key and the fix. Saved configs that
    wrote 0 for the rule (older run dirs and checkpoints) still read as the rule."""
    from lwm_jax.interop.native import model_config_from
    from lwm_jax.train.trainer import _check_same_model
    assert main(["train", "model.decay_lora=0", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.decay_lora: 0 is not a low-rank size" in err
    assert "write null (or leave the key out) for RWKV-LM's rule (32 here)" in err
    for bad in ("-4", "2.5", "true", "'32'"):
        with pytest.raises(ValueError, match=r"model\.a_lora"):
            load_config(None, [f"model.a_lora={bad}"])
    cfg = load_config(None, ["model.gate_lora=null", "model.v_lora=24"])
    assert cfg.model.gate_lora is None and cfg.model.v_lora == 24
    assert (cfg.model.resolved().gate_lora, cfg.model.resolved().v_lora) == (64, 24)  # 5√256
    # a run dir written when 0 meant the rule resumes under today's null ...
    cfg = load_config(None, [f"run_dir={tmp_path}"])
    os.makedirs(cfg.checkpoint_dir)
    old = cfg.to_dict()
    old["model"] = {**old["model"], "decay_lora": 0, "a_lora": 0, "v_lora": 0, "gate_lora": 0}
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(old))
    _check_same_model(str(saved), cfg)
    # ... and its checkpoint's config reads as the rule
    assert model_config_from(old, saved).resolved() == cfg.model.resolved()
