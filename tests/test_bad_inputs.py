"""Bad inputs through the real CLI (`lwm_jax.cli.main`, in-process): each is ONE line on stderr,
no traceback, and the documented exit status (2 bad input, 3 non-finite result, 1 internal
error with a crash log). One representative case per class of the hardening corpus."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from lwm_jax.cli import main
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.interop import hf, load_pretrained
from lwm_jax.interop.testing import random_params

# Byte-level vocabulary so that generate/eval can use the byte tokenizer.
CFG = ModelConfig(vocab_size=256, n_layer=1, n_embd=64, head_size=32).resolved()
BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{p}'] * 9 if p else ['lol'] * 9)}]\n"
               for p, a in zip([None, *"abcdefgh"], "abcdefghi"))   # 9^9 values, 342 bytes


def run(capsys, *argv) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return status, cap.out, cap.err


def error_lines(err: str) -> list[str]:
    """stderr without `lwm-jax eval`'s progress (its `[eval] ...` stage lines)."""
    return [line for line in err.strip().splitlines()
            if line.strip() and not line.startswith("[eval] ")]


def one_line_error(capsys, *argv, status: int = 2, match: str | None = None) -> str:
    """Run the CLI; assert the exit status and exactly one stderr line besides progress lines,
    the last one; return that line."""
    code, _, err = run(capsys, *argv)
    lines = error_lines(err)
    assert err.strip().splitlines()[-1:] == lines[-1:], err
    assert code == status, err
    assert len(lines) == 1 and "Traceback" not in err, err
    if match is not None:
        assert re.search(match, lines[0]), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=1)


@pytest.fixture(scope="module")
def hf_dir(tree, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "hf"
    hf.write_hf(CFG, tree, root)
    return root


@pytest.fixture
def hf_copy(hf_dir, tmp_path):
    return Path(shutil.copytree(hf_dir, tmp_path / "hf"))


def _writable(d: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=d)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


@pytest.fixture
def unwritable_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    if _writable(d):                 # root ignores permission bits: use sysfs, read-only for all
        d.chmod(0o755)
        d = Path("/sys")
        if not d.is_dir() or _writable(d):
            pytest.skip("no unwritable directory available")
    yield d
    if d != Path("/sys"):
        d.chmod(0o755)


# ----------------------------------------------------------- 1. damaged files and bad paths
def test_truncated_safetensors_names_the_file(hf_copy, tmp_path, capsys):
    weights = hf_copy / hf.SINGLE
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    one_line_error(capsys, "convert", "--input", hf_copy, "--output", tmp_path / "o",
                   match=r"model\.safetensors': not a readable safetensors file")


def test_garbled_state_file(hf_dir, tmp_path, capsys):
    state = tmp_path / "s.safetensors"
    state.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    one_line_error(capsys, "generate", "--checkpoint", hf_dir, "--prompt", "hi",
                   "--load-state", state, match=r"state file .*not a readable safetensors")


@pytest.mark.parametrize("config, match", [
    ([1, 2], r"config\.json': expected a JSON object .* got an array"),
    ({"model_type": "rwkv7", "hidden_size": "big"},
     r"field 'hidden_size' is a string \('big'\), expected an integer"),
])
def test_hf_config_of_the_wrong_json_type(hf_copy, tmp_path, capsys, config, match):
    (hf_copy / hf.CONFIG).write_text(json.dumps(config))
    one_line_error(capsys, "convert", "--input", hf_copy, "--output", tmp_path / "o", match=match)


def test_damaged_orbax_checkpoint(tree, tmp_path, capsys):
    from lwm_jax.interop.native import save_native
    save_native(CFG, tree, tmp_path / "ours")
    (tmp_path / "ours" / "params" / "manifest.ocdbt").unlink()
    one_line_error(capsys, "generate", "--checkpoint", tmp_path / "ours", "--prompt", "hi",
                   match=r"cannot restore the orbax checkpoint .*damaged or incomplete")


def test_malformed_run_dir_config(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "5" / "state").mkdir(parents=True)
    (run / "config.yaml").write_text("model: [unclosed\n")
    one_line_error(capsys, "generate", "--checkpoint", run, "--prompt", "hi",
                   match=r"config\.yaml: not valid YAML: .* at line 2")


def test_pth_meta_tensor(tree, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from lwm_jax.interop.rwkv_pth import write_official
    sd = {k: torch.from_numpy(v) for k, v in write_official(CFG, tree).items()}
    sd["emb.weight"] = torch.empty(sd["emb.weight"].shape, device="meta")
    torch.save(sd, tmp_path / "m.pth")
    one_line_error(capsys, "convert", "--input", tmp_path / "m.pth", "--output", tmp_path / "o",
                   match=r"tensor 'emb\.weight' is a meta tensor")


def test_unwritable_output_dir(hf_dir, unwritable_dir, capsys):
    one_line_error(capsys, "convert", "--input", hf_dir, "--output", unwritable_dir / "out",
                   match=r"output_dir: .* is not writable")


def test_output_path_of_the_wrong_kind(hf_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    one_line_error(capsys, "convert", "--input", hf_dir, "--output", tmp_path / "file",
                   match=r"'.*file' is a file, but a directory is needed")
    (tmp_path / "dir").mkdir()
    one_line_error(capsys, "generate", "--checkpoint", hf_dir, "--prompt", "hi",
                   "--save-state", tmp_path / "dir",
                   match=r"--save-state: '.*dir' is a directory, but a file is needed")


def test_deeply_nested_yaml(tmp_path, capsys):
    (tmp_path / "deep.yaml").write_text("train: " + "[" * 5000 + "]" * 5000 + "\n")
    one_line_error(capsys, "train", "--config", tmp_path / "deep.yaml",
                   match=r"deep\.yaml: refused YAML: nested deeper than 64 levels")


def test_vocab_too_large_for_memory_is_refused_before_allocating(capsys):
    one_line_error(capsys, "train", "model.vocab_size=2000000000",      # within int32
                   match=r"model\.vocab_size: .* need ~.* TiB, more than the .* available")


def test_export_pth_without_torch(hf_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)          # as if torch were not installed
    one_line_error(capsys, "export", "--input", hf_dir, "--output", tmp_path / "m.pth",
                   "--format", "rwkv-pth", match=r"needs PyTorch, which is not installed")


def test_full_disk(hf_dir, tmp_path, capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    (tmp_path / "t.txt").write_text("hello there\n")
    one_line_error(capsys, "eval", "--checkpoint", hf_dir, "--data", tmp_path / "t.txt",
                   "--ctx-len", "16", "--output", "/dev/full",
                   match=r"'/dev/full': no space left on device")


# -------------------------------------------------------- 2. accepted silently before, refused
def test_nonfinite_weights_are_refused_naming_the_tensor(tree, hf_copy, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file
    sd = load_file(str(hf_copy / hf.SINGLE))
    sd["model.layers.0.attn.k_proj.weight"][3, 5] = np.inf
    save_file(sd, str(hf_copy / hf.SINGLE))
    one_line_error(capsys, "convert", "--input", hf_copy, "--output", tmp_path / "o",
                   match=r"tensor 'model\.layers\.0\.attn\.k_proj\.weight' holds 0 NaN and 1 inf")
    with pytest.raises(ValueError, match="k_proj.weight' holds"):
        load_pretrained(hf_copy)


@pytest.mark.parametrize("kind", ["complex", "sparse"])
def test_pth_complex_or_sparse_tensor(tree, tmp_path, capsys, kind):
    torch = pytest.importorskip("torch")
    from lwm_jax.interop.rwkv_pth import write_official
    sd = {k: torch.from_numpy(v) for k, v in write_official(CFG, tree).items()}
    w = sd["head.weight"]
    sd["head.weight"] = w.to(torch.complex64) if kind == "complex" else w.to_sparse()
    torch.save(sd, tmp_path / "m.pth")
    want = (r"is complex .*imaginary part" if kind == "complex"
            else r"has sparse_coo layout, not dense")
    one_line_error(capsys, "convert", "--input", tmp_path / "m.pth", "--output", tmp_path / "o",
                   match=r"tensor 'head\.weight' " + want)


def test_eval_nan_loss_exits_3(tree, tmp_path, capsys):
    broken = {**tree, "head": np.where(np.arange(CFG.vocab_size) % 2, 3e38, -3e38)
              .astype(np.float32)[None, :].repeat(CFG.n_embd, 0)}      # finite, but logits overflow
    hf.write_hf(CFG, broken, tmp_path / "hf")
    (tmp_path / "t.txt").write_text("hello there\n")
    code, out, err = run(capsys, "eval", "--checkpoint", tmp_path / "hf", "--data",
                         tmp_path / "t.txt", "--ctx-len", "16")
    assert code == 3 and out == "" and len(error_lines(err)) == 1, err
    assert "perplexity loss is NaN" in err


def test_alias_bomb_is_refused_with_a_short_message(tmp_path, capsys):
    (tmp_path / "bomb.yaml").write_text(BOMB)
    assert len(BOMB) < 400
    line = one_line_error(capsys, "train", "--config", tmp_path / "bomb.yaml",
                          match=r"aliases expand to more than 100,000 values")
    assert len(line) < 500
    # an oversized value quoted in a message is cut, not printed whole
    line = one_line_error(capsys, "train", "train.lr=" + "x" * 10_000,
                          match=r"train\.lr: expected a number, got 'xxx.*\.\.\.")
    assert len(line) < 300


def test_duplicate_yaml_key_names_key_and_line(tmp_path, capsys):
    (tmp_path / "dup.yaml").write_text("train:\n  lr: 1.0e-3\n  steps: 5\n  lr: 2.0e-3\n")
    one_line_error(capsys, "train", "--config", tmp_path / "dup.yaml",
                   match=r"duplicate key 'lr' \(first given on line 2\).*line 4")


def test_warmup_longer_than_the_run(capsys):
    one_line_error(capsys, "train", "train.warmup_steps=50", "train.steps=20",
                   match=r"train\.warmup_steps: 50 is larger than train\.steps=20")


# ------------------------------------------------------------------ 3. unexpected exceptions
def test_unexpected_exception_writes_a_crash_log(tmp_path, monkeypatch, capsys):
    def boom(args):
        raise KeyError("surprise")
    monkeypatch.setattr("lwm_jax.interop.cli.convert_main", boom)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("LWM_DEBUG", raising=False)
    monkeypatch.delenv("LWM_JAX_DEBUG", raising=False)
    line = one_line_error(capsys, "convert", "--input", "a", "--output", "b", status=1,
                          match=r"internal error: KeyError: 'surprise' \(full traceback in ")
    log = Path(re.search(r"full traceback in (\S+?);", line).group(1))
    assert log.parent == tmp_path and "Traceback" in log.read_text()
    assert "raise KeyError" in log.read_text()
    for var in ("LWM_DEBUG", "LWM_JAX_DEBUG"):
        monkeypatch.setenv(var, "1")
        with pytest.raises(KeyError, match="surprise"):
            main(["convert", "--input", "a", "--output", "b"])
        monkeypatch.delenv(var)


# ------------------------------------------------------------------------ 4. lazy, helpful help
def test_help_is_lazy_and_shows_defaults(capsys):
    code = ("import sys; from lwm_jax.cli import build_parser; "
            "build_parser().parse_args(['generate', '--checkpoint', 'c', '--prompt', 'x']); "
            "print([m for m in sys.modules if m.split('.')[0] in ('flax', 'orbax', 'optax') or "
            "m.startswith(('lwm_jax.interop', 'lwm_jax.generate', 'lwm_jax.eval', "
            "'lwm_jax.train', 'lwm_jax.models', 'lwm_jax.data'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 128)" in text and "(default: 1.0)" in text and "(default: None)" not in text
    with pytest.raises(SystemExit) as info:                   # usage errors are one line too
        main(["generate", "--checkpoint", "c", "--max-new-tokens", "many"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert err[0] == ("lwm-jax generate: error: argument --max-new-tokens: invalid int value: "
                      "'many' (see lwm-jax generate --help)")


# ------------------------------------------------------------------- 5. generate / eval output
def test_generate_echoes_prompt_and_reports_speed(hf_dir, capsys):
    code, out, err = run(capsys, "generate", "--checkpoint", hf_dir, "--prompt", "Hi there",
                         "--max-new-tokens", "3", "--temperature", "0", "--no-stop-at-eod",
                         "--decode-block", "4")
    assert code == 0 and out.startswith("Hi there") and out.endswith("\n")
    assert re.search(r"prompt 8 tokens, 3 new tokens in [\d.]+ s: first token after [\d.]+ s "
                     r"\(prefill \+ compilation\), then [\d.]+ tokens/s; stopped by length$",
                     err.strip()), err


def test_eval_stdout_and_output_file_have_the_same_shape(hf_dir, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("hello there\n")
    code, out, _ = run(capsys, "eval", "--checkpoint", hf_dir, "--data", tmp_path / "t.txt",
                       "--ctx-len", "16", "--output", tmp_path / "r.json")
    assert code == 0
    printed, saved = json.loads(out), json.loads((tmp_path / "r.json").read_text())
    assert printed == saved and set(printed) == {"perplexity"}
    assert printed["perplexity"]["n_tokens"] == len("hello there\n")


# ------------------------------------------------------------------------- 6. newcomer path
def test_prepare_defaults_to_byte_and_training_refuses_a_mismatch(tmp_path, capsys):
    from lwm_jax.train.batches import load_splits
    from lwm_jax.train.config import DataSection
    (tmp_path / "a.txt").write_text("print('hello')\n" * 20)
    prefix = tmp_path / "data" / "mine"
    code, out, _ = run(capsys, "prepare", "--input", tmp_path / "a.txt", "--output", prefix,
                       "--quiet")
    assert code == 0 and "tokenizer byte" in out
    record = json.loads(Path(f"{prefix}.tokenizer.json").read_text())
    assert record["tokenizer"] == "byte" and record["vocab_size"] == 256
    byte_model = ModelConfig(vocab_size=256, n_layer=1, n_embd=64, head_size=32)
    assert load_splits(DataSection(path=str(prefix), val_fraction=0.0), byte_model).val is None
    world_model = ModelConfig(vocab_size=65536, n_layer=1, n_embd=64, head_size=32)
    with warnings.catch_warnings(), pytest.raises(ValueError) as info:
        warnings.simplefilter("ignore", RuntimeWarning)        # World vocab file may be absent
        load_splits(DataSection(path=str(prefix), tokenizer="world"), world_model)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("data.tokenizer: 'world' does not match data.path=")
    assert "prepared with tokenizer 'byte'" in msg
    # the CLI refuses it before building the model
    one_line_error(capsys, "train", f"data.path={prefix}", "data.tokenizer=world",
                   "model.vocab_size=65536", f"run_dir={tmp_path / 'run'}",
                   match=r"data\.tokenizer: 'world' does not match .*set data\.tokenizer=byte")


def test_shipped_configs_reference_existing_docs():
    root = Path(__file__).resolve().parents[1]
    for cfg in sorted((root / "configs").glob("*.yaml")):
        for ref in re.findall(r"docs/[\w./-]+", cfg.read_text()):
            assert (root / ref.rstrip(".,)")).exists(), f"{cfg.name} refers to missing {ref}"

