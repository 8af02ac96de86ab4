"""lm-eval on our models, offline: the `LM` methods answer `Instance`s as `HarnessModel` does,
and local tasks (YAML + JSONL, no hub access) run through `simple_evaluate` and `lwm-jax eval
--tasks` with accuracies equal to those computed from our own scores."""
from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from lwm_jax.cli.args import add_eval_args  # noqa: E402
from lwm_jax.eval import eval_main  # noqa: E402
from lwm_jax.eval.harness import HarnessModel  # noqa: E402
from lwm_jax.eval.lm_eval_adapter import (  # noqa: E402
    LwmLM, check_task_code, find_task_code, run_tasks, sandboxed_templates, task_manager)
from lwm_jax.interop.native import save_native  # noqa: E402
from lwm_jax.interop.params import model_from_params  # noqa: E402
from lwm_jax.interop.testing import random_params  # noqa: E402
from lwm_jax.models.rwkv7.config import ModelConfig  # noqa: E402
from lwm_jax.runtime import Runtime  # noqa: E402
from lwm_jax.tokenizers import ByteTokenizer  # noqa: E402

CFG = ModelConfig(vocab_size=256, n_layer=2, n_embd=64, head_size=32, decay_lora=16, a_lora=16,
                  v_lora=16, gate_lora=32).resolved()
TOK = ByteTokenizer()
QUESTIONS = [{"question": f"Question {i}: which word fits here?", "choices": [" red", " green",
              " blue sky"], "label": i % 3} for i in range(5)]
CLOZE = [{"text": f"Story {i} ends with the word", "target": [" end", " dog", " tree"][i % 3]}
         for i in range(4)]


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=7, scale=0.5)


@pytest.fixture(scope="module")
def harness(tree):
    model = model_from_params(CFG, tree, "fp32", Runtime(wkv_impl="recurrent"))
    return HarnessModel(model, TOK, batch_size=4, window=16, granule=8)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Two local tasks: multiple choice (acc, acc_norm) and LAMBADA-style cloze (acc, ppl)."""
    root = tmp_path_factory.mktemp("tasks")
    cache = root / "hf_cache"
    for name, rows in (("mc", QUESTIONS), ("cloze", CLOZE)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {{path}}\n"
              f"  cache_dir: {cache}\ntest_split: test\n")
    (root / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common.format(path=root / "mc.jsonl") +
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (root / "tiny_cloze.yaml").write_text(
        "task: tiny_cloze\n" + common.format(path=root / "cloze.jsonl") +
        "output_type: loglikelihood\ndoc_to_text: '{{text}}'\ndoc_to_target: '{{target}}'\n"
        "target_delimiter: ''\nmetric_list:\n"
        "  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return root


def expected(harness):
    """Accuracies and cloze perplexity from HarnessModel's own scores."""
    mc = harness.loglikelihood([(q["question"], c) for q in QUESTIONS for c in q["choices"]])
    lp = np.array([s for s, _ in mc]).reshape(len(QUESTIONS), 3)
    acc_mc = float(np.mean(lp.argmax(1) == [q["label"] for q in QUESTIONS]))
    cloze = harness.loglikelihood([(d["text"], d["target"]) for d in CLOZE])
    acc_cloze = float(np.mean([greedy for _, greedy in cloze]))
    ppl = float(np.exp(-np.mean([s for s, _ in cloze])))
    return acc_mc, acc_cloze, ppl


def test_lm_methods_answer_instances_like_the_harness(harness):
    lm = LwmLM(harness)
    pairs = [("The sky is", " blue"), ("The sky is", " green"), ("", "Hello")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    assert lm.loglikelihood(reqs) == harness.loglikelihood(pairs)
    texts = ["A whole document to score.", "Another."]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    assert lm.loglikelihood_rolling(rolling) == harness.loglikelihood_rolling(texts)
    gen = [("Once", {"until": ["\n"], "max_gen_toks": 8})]
    assert lm.generate_until([Instance("generate_until", {}, gen[0], 0)]) == \
        harness.generate_until(gen)


def test_local_tasks_through_simple_evaluate(harness, task_dir):
    manager = task_manager(str(task_dir), ["tiny_mc", "tiny_cloze"])
    assert "piqa" not in manager.all_tasks          # only the local files were indexed
    out = run_tasks(harness, ["tiny_mc", "tiny_cloze"], manager=manager, bootstrap_iters=0)
    acc_mc, acc_cloze, ppl = expected(harness)
    res = out["results"]
    assert res["tiny_mc"]["acc,none"] == pytest.approx(acc_mc, abs=1e-12)
    assert res["tiny_cloze"]["acc,none"] == pytest.approx(acc_cloze, abs=1e-12)
    assert res["tiny_cloze"]["perplexity,none"] == pytest.approx(ppl, rel=1e-9)
    assert out["n_shot"] == {"tiny_mc": 0, "tiny_cloze": 0} and out["n_truncated"] == 0
    with pytest.raises(ValueError, match=r"'tiny_mcq' is not an lm-eval task; did you mean tiny_mc"):
        run_tasks(harness, ["tiny_mcq"], manager=manager)


def test_cli_tasks_end_to_end(harness, tree, task_dir, tmp_path):
    save_native(CFG, tree, tmp_path / "ckpt")
    args = add_eval_args(argparse.ArgumentParser()).parse_args(
        ["--checkpoint", str(tmp_path / "ckpt"), "--tasks", "tiny_mc,tiny_cloze",
         "--include-path", str(task_dir), "--ctx-len", "16", "--batch-size", "4",
         "--limit", "3", "--bootstrap-iters", "0", "--output", str(tmp_path / "r.json")])
    out = io.StringIO()
    results = eval_main(args, out=out)
    assert json.loads(out.getvalue()) == results == json.loads((tmp_path / "r.json").read_text())
    lm = results["lm_eval"]
    assert lm["tasks"] == ["tiny_mc", "tiny_cloze"] and lm["prefix"] == "eod"
    assert lm["results"]["tiny_mc"]["sample_len"] == 3           # --limit
    lp = np.array([s for s, _ in harness.loglikelihood(
        [(q["question"], c) for q in QUESTIONS[:3] for c in q["choices"]])]).reshape(3, 3)
    want = float(np.mean(lp.argmax(1) == [q["label"] for q in QUESTIONS[:3]]))
    assert lm["results"]["tiny_mc"]["acc,none"] == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="--limit: must be >= 1, got 0"):
        eval_main(add_eval_args(argparse.ArgumentParser()).parse_args(
            ["--checkpoint", str(tmp_path / "ckpt"), "--tasks", "tiny_mc", "--limit", "0"]))


def code_task_dir(root, marker):
    """A task whose `process_docs: !function utils.keep` imports utils.py, which writes
    `marker` when imported: the file exists afterwards only if lm-eval ran the directory's code."""
    root.mkdir()
    (root / "rows.jsonl").write_text(json.dumps(QUESTIONS[0]) + "\n")
    (root / "evil.yaml").write_text(
        f"task: evil\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'rows.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "process_docs: !function utils.keep\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n")
    (root / "utils.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                   "def keep(docs):\n    return docs\n")
    return root


def test_include_path_with_task_code_is_refused_before_lm_eval_reads_it(tree, tmp_path,
                                                                         capsys):
    from lwm_jax.cli import main
    save_native(CFG, tree, tmp_path / "ckpt")
    marker = tmp_path / "code_ran"
    root = code_task_dir(tmp_path / "tasks", marker)
    status = main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--tasks", "evil",
                   "--include-path", str(root), "--limit", "1", "--bootstrap-iters", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "evil.yaml" in err[0] and "!function" in err[0] and "--allow-task-code" in err[0]
    assert not marker.exists()                      # utils.py was never imported


def test_task_code_found_in_py_files_includes_and_spelled_tags(tmp_path):
    plain = "task: t\ndataset_path: json\n"
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "a.yaml").write_text(plain)
    (tmp_path / "py" / "deep").mkdir()
    (tmp_path / "py" / "deep" / "helpers.py").write_text("")
    assert "helpers.py' is Python" in find_task_code(str(tmp_path / "py"))
    (tmp_path / "outside").mkdir()                  # an include reaching out of the directory
    (tmp_path / "outside" / "base.yaml").write_text("doc_to_text: !function u.f\n")
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "t.yaml").write_text(plain + "include: ../outside/base.yaml\n")
    why = find_task_code(tmp_path / "inc")
    assert "base.yaml' (included by" in why and "t.yaml'" in why and "!function" in why
    (tmp_path / "tag").mkdir()                      # %TAG and %-escapes spell the same tag
    (tmp_path / "tag" / "a.yaml").write_text("%TAG ! !fun\n---\nx: !ction u.f\n")
    (tmp_path / "tag" / "b.yaml").write_text("x: !%66unction u.f\n")
    assert "a.yaml' has a !function tag" in find_task_code(tmp_path / "tag")
    (tmp_path / "tag" / "a.yaml").unlink()
    assert "b.yaml' has a !function tag" in find_task_code(tmp_path / "tag")
    (tmp_path / "bad").mkdir()                      # unparseable: cannot be shown code-free
    (tmp_path / "bad" / "x.yaml").write_text("a: [1\n")
    with pytest.raises(ValueError, match=r"x.yaml' could not be checked for task code"):
        find_task_code(tmp_path / "bad")
    check_task_code(str(tmp_path / "py"), allow=True)           # --allow-task-code: as before
    with pytest.raises(ValueError, match=r"helpers.py' is Python; pass --allow-task-code"):
        check_task_code(str(tmp_path / "py"))


def test_plain_task_yaml_needs_no_opt_in(task_dir):
    assert find_task_code(str(task_dir)) is None
    check_task_code(str(task_dir))      # test_cli_tasks_end_to_end runs it without the flag


def test_allow_task_code_without_include_path_is_one_line(tmp_path, capsys):
    from lwm_jax.cli import main
    (tmp_path / "corpus.txt").write_text("some text\n")
    status = main(["eval", "--checkpoint", str(tmp_path / "nope"), "--data",
                   str(tmp_path / "corpus.txt"), "--allow-task-code"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "--allow-task-code" in err[0], err
    assert "--include-path" in err[0]


def template_task_dir(root, doc_to_text: str):
    """A plain multiple-choice task (no Python files, no tags) whose doc_to_text is
    `doc_to_text`: the only way it can run code is through its Jinja template."""
    root.mkdir()
    (root / "rows.jsonl").write_text(json.dumps(QUESTIONS[0]) + "\n")
    (root / "jinja.yaml").write_text(
        f"task: jinja\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'rows.jsonl'}\n  cache_dir: {root / 'hf_cache'}\ntest_split: test\n"
        f"output_type: multiple_choice\ndoc_to_text: {json.dumps(doc_to_text)}\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n")
    return root


def test_template_code_is_stopped_unless_allow_task_code(tree, tmp_path, capsys):
    """The template calls os.makedirs through Jinja's globals (`cycler.__init__.__globals__`):
    without --allow-task-code it is refused in one line and nothing ran; with the flag lm-eval
    renders it as before and the directory appears (so the refusal is the sandbox's doing)."""
    from lwm_jax.cli import main
    save_native(CFG, tree, tmp_path / "ckpt")
    marker = tmp_path / "template_ran"
    root = template_task_dir(tmp_path / "tasks", "{{ cycler.__init__.__globals__.os.makedirs("
                             + repr(str(marker)) + ", exist_ok=True) }}{{question}}")
    assert find_task_code(str(root)) is None        # no Python files, no tags: not task code
    argv = ["eval", "--checkpoint", str(tmp_path / "ckpt"), "--tasks", "jinja", "--include-path",
            str(root), "--limit", "1", "--bootstrap-iters", "0", "--batch-size", "4",
            "--ctx-len", "16"]
    status = main(argv)
    err = capsys.readouterr().err.strip().splitlines()     # progress lines, then the error
    errors = [line for line in err if line.startswith("lwm-jax eval: ")]
    assert status == 2 and errors == err[-1:], err[-3:]
    assert "template" in err[-1] and "sandbox" in err[-1] and "--allow-task-code" in err[-1]
    assert not marker.exists()
    assert main(argv + ["--allow-task-code"]) == 0
    assert marker.is_dir()


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ question|attr('_' * 2 ~ 'class' ~ '_' * 2) }}",      # the name built at run time
    "{{ question['__cla' ~ 'ss__'] }}",                        # subscript, not attribute
    "{{ lipsum.__globals__ }}",
])
def test_sandbox_stops_every_spelling(harness, tmp_path, template):
    root = template_task_dir(tmp_path / "tasks", template + "{{question}}")
    manager = task_manager(str(root), ["jinja"])
    with pytest.raises(ValueError, match=r"--include-path: a template of --tasks jinja reaches "
                                         r"for Python internals .*--allow-task-code"):
        run_tasks(harness, ["jinja"], manager=manager, limit=1, bootstrap_iters=0, sandbox=True)


def test_sandboxed_templates_keep_lm_evals_rendering():
    """Inside the sandbox lm-eval's own templates render as before (its regex_replace filter,
    StrictUndefined, kept trailing newlines), and its environment is back afterwards."""
    import jinja2
    from lm_eval import utils as lm_utils
    original = lm_utils.env
    doc = {"q": "a-b-c", "choices": ["x", "y"], "label": 1}
    templates = ["{{ q|regex_replace('-', ' ') }}\n", "{{ choices[label] }}{{ choices|length }}",
                 "{% for c in choices %}{{ loop.index }}. {{ c }}\n{% endfor %}",
                 "{{ ['a', 'b'].index('b') }} {{ q.split('-')|join('+') }} {{ range(3)|list }}"]
    plain = [lm_utils.apply_template(t, doc) for t in templates]
    with sandboxed_templates():
        assert lm_utils.env is not original
        assert [lm_utils.apply_template(t, doc) for t in templates] == plain
        with pytest.raises(jinja2.exceptions.UndefinedError):
            lm_utils.apply_template("{{ missing }}", doc)
        with pytest.raises(jinja2.exceptions.SecurityError):
            lm_utils.apply_template("{{ q.__class__ }}", doc)
    assert lm_utils.env is original
    assert plain[0] == "a b c\n" and plain[1] == "y2"
