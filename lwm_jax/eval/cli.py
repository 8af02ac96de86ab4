"""`lwm-jax eval`: perplexity / bits-per-byte of a text or binidx file, LAMBADA-style accuracy,
and lm-evaluation-harness tasks.

    lwm-jax eval --checkpoint DIR --data corpus.txt [--ctx-len 1024] [--max-tokens N]
    lwm-jax eval --checkpoint DIR --data data/minipile_text_document      # binidx prefix
    lwm-jax eval --checkpoint DIR --lambada lambada_test.jsonl [--max-examples N]
    lwm-jax eval --checkpoint DIR --tasks lambada_openai,piqa [--num-fewshot 0] [--limit N]

Prints ONE JSON object `{"perplexity": {...}, "lambada": {...}, "lm_eval": {...}}` (the
evaluations run) to stdout, and writes the identical text to `--output FILE` when given. A
NaN/inf result is not printed: it is a one-line `NonFiniteError` (exit status 3), since a NaN
loss means a broken model or precision. `--tasks` needs `lm_eval` (`pip install
'lwm_jax[eval]'`; `lwm_jax.eval.lm_eval_adapter`); `--ctx-len` is then the scoring window
and `--batch-size` the rows per call. An `--include-path` directory from which lm-eval would
run Python (a `.py` file, a `!function` tag) is refused unless `--allow-task-code` is given:
task files are data until the user says they trust their code. Arguments:
`lwm_jax.cli_args.add_eval_args`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from lwm_jax.cli_args import add_eval_args  # re-exported (API)
from lwm_jax.user_input import NonFiniteError, check_output_file, quote_path, write_text


def _check_finite(task: str, data: str, metrics: dict) -> None:
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            shown = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            raise NonFiniteError(
                f"{task} {key} is {shown} on {data!r}: the model's outputs are not finite; the "
                "checkpoint is broken or the precision too narrow (try --precision fp32)")


def eval_main(args: argparse.Namespace, out=None) -> dict:
    """Run the requested evaluations; returns `{"perplexity": {...}, "lambada": {...}}`, the
    object printed to `out` (default stdout) and written to `--output`.

    Raises ValueError (one line) for missing tasks, bad paths or inputs, and NonFiniteError
    (a ValueError, exit status 3 in the CLI) when a metric is NaN/inf.
    """
    from lwm_jax.eval.lambada import encode_examples, last_word_accuracy, read_jsonl
    from lwm_jax.eval.perplexity import evaluate_stream, load_stream
    from lwm_jax.eval.scoring import Scorer
    from lwm_jax.generate.cli import load_model_and_tokenizer
    from lwm_jax.models.registry import arch_of_model
    out = out or sys.stdout
    tasks = getattr(args, "tasks", None)
    if not args.data and not args.lambada and not tasks:
        raise ValueError("eval: give --data (perplexity), --lambada (last-word accuracy) and/or "
                         "--tasks (lm-eval tasks)")
    _check_counts(args)
    if getattr(args, "allow_task_code", False) and not getattr(args, "include_path", None):
        raise ValueError("--allow-task-code: only applies to an --include-path directory of "
                         "task files; give --include-path DIR or drop --allow-task-code")
    if tasks:       # before the model is loaded: a missing lm_eval or a bad task name is cheap
        from lwm_jax.eval.lm_eval_adapter import (  # ImportError
            check_task_code, check_task_names, task_manager)
        _check_task_options(args)
        check_task_code(args.include_path, getattr(args, "allow_task_code", False))
        manager = task_manager(args.include_path, tasks.split(","))
        names = check_task_names(tasks.split(","), manager)
    if args.output:
        check_output_file(args.output, "--output")
    model, cfg, tok = load_model_and_tokenizer(args)
    arch = arch_of_model(model).name
    if args.data and arch != "rwkv7":     # windows carry a recurrent state through the stream
        raise ValueError(f"--data: stream perplexity is implemented for RWKV-7 models only; "
                         f"this is a {arch} model (--lambada works)")
    scorer = Scorer(model)
    results: dict = {}
    if args.data:
        stream = load_stream(args.data, tok)
        res = evaluate_stream(scorer, stream, tok, ctx_len=args.ctx_len,
                              max_tokens=args.max_tokens, eod_id=tok.eod_id)
        metrics = res.to_dict()
        _check_finite("perplexity", args.data, metrics)
        results["perplexity"] = {"data": args.data, **metrics}
    if args.lambada:
        examples = encode_examples(tok, read_jsonl(args.lambada, args.max_examples))
        res = last_word_accuracy(scorer, examples, batch_size=args.batch_size)
        metrics = res.to_dict()
        _check_finite("lambada", args.lambada, metrics)
        results["lambada"] = {"data": args.lambada, **metrics}
    if tasks:
        results["lm_eval"] = _run_lm_eval(args, model, tok, manager, names)
    text = json.dumps(results, indent=2, allow_nan=False) + "\n"
    out.write(text)
    out.flush()
    if args.output:
        write_text(args.output, text)
    return results


def _check_counts(args: argparse.Namespace) -> None:
    """Every count option at or above its least value (`--max-examples -1` once scored one
    example), whichever evaluation uses it; one-line ValueError otherwise."""
    checks = (("--max-examples", "max_examples", 1), ("--max-tokens", "max_tokens", 1),
              ("--batch-size", "batch_size", 1), ("--ctx-len", "ctx_len", 1),
              ("--num-fewshot", "num_fewshot", 0), ("--limit", "limit", 1),
              ("--bootstrap-iters", "bootstrap_iters", 0))
    for flag, name, low in checks:
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise ValueError(f"{flag}: must be >= {low}, got {value}")


def _check_task_options(args: argparse.Namespace) -> None:
    if args.include_path and not os.path.isdir(args.include_path):
        raise ValueError(f"--include-path: {quote_path(args.include_path)} is not a directory "
                         "of task YAML files")


def _progress_bar(kind: str, total: int):
    """A stderr progress bar over `total` requests of one kind; returns its updater."""
    from tqdm import tqdm
    bar = tqdm(total=total, desc=f"[eval] {kind}", file=sys.stderr, unit="req")

    def update(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()
    return update


def _run_lm_eval(args: argparse.Namespace, model, tok, manager, names: list[str]) -> dict:
    """lm-eval's results for `--tasks`, checked finite (standard errors may be None)."""
    from lwm_jax.eval.harness import HarnessModel
    from lwm_jax.eval.lm_eval_adapter import run_tasks
    harness = HarnessModel(model, tok, batch_size=args.batch_size, window=args.ctx_len,
                           prefix=args.prefix, progress=_progress_bar)
    out = run_tasks(harness, names, num_fewshot=args.num_fewshot, limit=args.limit,
                    bootstrap_iters=args.bootstrap_iters, manager=manager)
    for task, metrics in out["results"].items():
        _check_finite(task, ",".join(names),
                      {k: v for k, v in metrics.items() if "_stderr" not in k})
    return {"tasks": names, "prefix": args.prefix, "limit": args.limit, **out}


def main(argv=None) -> None:
    p = add_eval_args(argparse.ArgumentParser(prog="lwm-jax eval"))
    eval_main(p.parse_args(argv))
