"""Hostile inputs to `lwm-jax eval`: each is one line (ValueError naming the file or flag),
never a hang, a crash or code run without --allow-task-code."""
from __future__ import annotations

import io
import json
import os
import signal

import pytest

from lwm_jax.eval.lambada import read_jsonl
from lwm_jax.eval.perplexity import check_stream_path


@pytest.fixture
def alarm():
    """Fail (instead of hanging) a check that would block on a FIFO."""
    def on_alarm(*_):
        raise TimeoutError("blocked: the FIFO was opened")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_lambada_and_data_fifo_are_refused_not_opened(tmp_path, alarm):
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"--lambada: '.*in.jsonl' is not a regular file"):
        read_jsonl(fifo)
    with pytest.raises(ValueError, match=r"data: '.*in.jsonl' is not a regular file"):
        check_stream_path(fifo)
    os.mkfifo(tmp_path / "d.idx")
    (tmp_path / "d.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"d.idx' is not a regular file"):
        check_stream_path(tmp_path / "d")


def test_lambada_lone_surrogate_and_no_last_word_name_file_line(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"text": "a b"}\n{"text": "x \\ud800 y"}\n')
    with pytest.raises(ValueError, match=r"l.jsonl:2: field 'text' holds a lone surrogate"):
        read_jsonl(path)
    path.write_text('{"text": "a b"}\n\n{"text": "single"}\n')
    with pytest.raises(ValueError, match=r"l.jsonl:3: 'text' has no 'context last-word' split"):
        read_jsonl(path)


def test_progress_bars_close_before_an_error_propagates():
    from lwm_jax.eval.cli import _closing_bars, _progress_bar
    err = io.StringIO()
    with pytest.raises(RuntimeError):
        with _closing_bars():
            update = _progress_bar("lambada", 10, err, "example")
            update(3)
            raise RuntimeError("boom")
    assert err.getvalue().endswith("\n")            # the bar is closed: its line is finished
    size = len(err.getvalue())
    update(3)                                       # a closed bar is never redrawn
    assert len(err.getvalue()) == size


# ---------------------------------------------------------------------------- lm-eval tasks
ROW = {"question": "Which word fits here?", "choices": [" red", " green"], "label": 1}


def task_yaml(root, name="t", doc_to_text="{{question}}", extra=""):
    root.mkdir(exist_ok=True)
    (root / "rows.jsonl").write_text(json.dumps(ROW) + "\n")
    (root / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'rows.jsonl'}\n  cache_dir: {root / 'hf_cache'}\ntest_split: test\n"
        f"output_type: multiple_choice\ndoc_to_text: {json.dumps(doc_to_text)}\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n" + extra)
    return root


def test_unregistered_or_hf_evaluate_metric_is_task_code(tmp_path):
    pytest.importorskip("lm_eval")
    from lwm_jax.eval.lm_eval_adapter import check_task_code, find_task_code
    evil = tmp_path / "evilmetric"
    evil.mkdir()
    root = task_yaml(tmp_path / "a", extra=f"metric_list:\n  - metric: {evil}\n")
    with pytest.raises(ValueError, match=r"t.yaml' metric '.*' is not one lm-eval "
                                         r"registers.*--allow-task-code"):
        check_task_code(str(root))
    check_task_code(str(root), allow=True)
    root = task_yaml(tmp_path / "b", extra="metric_list:\n  - metric: acc\n    hf_evaluate: true\n")
    assert "metric 'acc' has hf_evaluate: true" in find_task_code(str(root))
    root = task_yaml(tmp_path / "c", extra="metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    assert find_task_code(str(root)) is None       # lm-eval's own metrics stay data


def test_fifo_in_include_path_is_refused(tmp_path, alarm):
    pytest.importorskip("lm_eval")
    from lwm_jax.eval.lm_eval_adapter import check_task_code
    root = task_yaml(tmp_path / "a")
    os.mkfifo(root / "u.yaml")
    for allow in (False, True):
        with pytest.raises(ValueError, match=r"u.yaml' is not a regular file \(a FIFO"):
            check_task_code(str(root), allow=allow)


@pytest.fixture(scope="module")
def harness():
    pytest.importorskip("lm_eval")
    from lwm_jax.eval.harness import HarnessModel
    from lwm_jax.interop.params import model_from_params
    from lwm_jax.interop.testing import random_params
    from lwm_jax.models.rwkv7.config import ModelConfig
    from lwm_jax.runtime import Runtime
    from lwm_jax.tokenizers import ByteTokenizer
    cfg = ModelConfig(vocab_size=256, n_layer=1, n_embd=64, head_size=32, decay_lora=16,
                      a_lora=16, v_lora=16, gate_lora=32).resolved()
    model = model_from_params(cfg, random_params(cfg, seed=1, scale=0.5), "fp32",
                              Runtime(wkv_impl="recurrent"))
    return HarnessModel(model, ByteTokenizer(), batch_size=4, window=16, granule=8)


@pytest.mark.parametrize("template,sandbox", [
    ("{{ question2 }}", False),                                   # a typo'd field
    ("{{ (cycler|attr('__init__')|attr('__globals__'))['os'] }}", True),   # Undefined[...]
])
def test_template_that_fails_to_render_is_one_line(harness, tmp_path, template, sandbox):
    from lwm_jax.eval.lm_eval_adapter import run_tasks, task_manager
    root = task_yaml(tmp_path / "a", name="tpl", doc_to_text=template)
    with pytest.raises(ValueError, match=r"--tasks tpl: a template of the task fails to render "
                                         r"\(.*\); fix doc_to_text"):
        run_tasks(harness, ["tpl"], manager=task_manager(str(root), ["tpl"]), limit=1,
                  bootstrap_iters=0, sandbox=sandbox)
    try:
        run_tasks(harness, ["tpl"], manager=task_manager(str(root), ["tpl"]), limit=1,
                  bootstrap_iters=0, sandbox=sandbox)
    except ValueError as err:       # the sandbox is named where it may be the cause
        assert ("--include-path templates render in a sandbox" in str(err)) == sandbox


def test_num_fewshot_beyond_the_data_names_the_flag(harness, tmp_path):
    from lwm_jax.eval.lm_eval_adapter import run_tasks, task_manager
    root = task_yaml(tmp_path / "a", name="few")
    with pytest.raises(ValueError, match=r"--num-fewshot: 5 is more than the few-shot examples "
                                         r"--tasks few has \(its few-shot pool holds 1\); give "
                                         r"a smaller --num-fewshot"):
        run_tasks(harness, ["few"], manager=task_manager(str(root), ["few"]), num_fewshot=5,
                  limit=1, bootstrap_iters=0)
