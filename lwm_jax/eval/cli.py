"""`lwm-jax eval`: perplexity / bits-per-byte of a text or binidx file, LAMBADA-style accuracy,
and lm-evaluation-harness tasks.

    lwm-jax eval --checkpoint DIR --data corpus.txt [--ctx-len 1024] [--max-tokens N]
    lwm-jax eval --checkpoint DIR --data data/minipile_text_document      # binidx prefix
    lwm-jax eval --checkpoint DIR --lambada lambada_test.jsonl [--max-examples N]
    lwm-jax eval --checkpoint DIR --tasks lambada_openai,piqa [--num-fewshot 0] [--limit N]

Every model family: an RWKV-7 carries its state through windows of `--ctx-len` tokens (exact
at any length); a LLaMA scores in windows of its `max_seq_len`, the RWKV-7/attention hybrid
(no carried state) in windows of `--ctx-len` (`lwm_jax.eval.scoring.model_context`). Nothing is
dropped: perplexity predicts every token once and reports its window; a LAMBADA or lm-eval
context cut to fit a window is counted in `n_truncated`.

Prints ONE JSON object `{"perplexity": {...}, "lambada": {...}, "lm_eval": {...}}` (the
evaluations run) to stdout, and writes the identical text to `--output FILE` when given;
stderr gets `[eval] ...` progress lines from the first second on. A NaN/inf result is not
printed: it is a one-line `NonFiniteError` (exit status 3), since a NaN loss means a broken
model or precision. `--tasks` needs `lm_eval` (`pip install 'lwm_jax[eval]'`;
`lwm_jax.eval.lm_eval_adapter`); `--batch-size` is the rows per call. An `--include-path`
directory from which lm-eval would run Python (a `.py` file, a `!function` tag) is refused
unless `--allow-task-code` is given, and without that flag its Jinja templates render in a
sandbox: task files are data until the user says they trust them. Arguments:
`lwm_jax.cli.args.add_eval_args`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

from lwm_jax.user_input import NonFiniteError, check_output_file, quote_path, write_text


def _check_finite(task: str, data: str, metrics: dict) -> None:
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            shown = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            raise NonFiniteError(
                f"{task} {key} is {shown} on {data!r}: the model's outputs are not finite; the "
                "checkpoint is broken or the precision too narrow (try --precision fp32)")


def _stage(err, text: str) -> None:
    """One progress line `[eval] text` on `err` (stderr), flushed at once."""
    err.write(f"[eval] {text}\n")
    err.flush()


def eval_main(args: argparse.Namespace, out=None, err=None) -> dict:
    """Run the requested evaluations; returns `{"perplexity": {...}, "lambada": {...}}`, the
    object printed to `out` (default stdout) and written to `--output`.

    Progress goes to `err` (default stderr): one `[eval] ...` line as each stage begins
    (indexing tasks, loading the checkpoint, each evaluation, whose first call compiles) and
    a progress bar while scoring, so the wait is never silent; `out` gets the results only.
    Every check that needs no model (options, paths, JSONL lines, task code) runs before the
    first stage, so a mistake there is the only line on stderr.

    Raises ValueError (one line) for missing tasks, bad paths or inputs, and NonFiniteError
    (a ValueError, exit status 3 in the CLI) when a metric is NaN/inf.
    """
    from lwm_jax.eval.lambada import read_jsonl
    from lwm_jax.eval.perplexity import check_stream_path
    out = out or sys.stdout
    err = err or sys.stderr
    tasks = getattr(args, "tasks", None)
    if not args.data and not args.lambada and not tasks:
        raise ValueError("eval: give --data (perplexity), --lambada (last-word accuracy) and/or "
                         "--tasks (lm-eval tasks)")
    _check_counts(args)
    if getattr(args, "allow_task_code", False) and not getattr(args, "include_path", None):
        raise ValueError("--allow-task-code: only applies to an --include-path directory of "
                         "task files; give --include-path DIR or drop --allow-task-code")
    _check_checkpoint(args)
    if args.data:
        check_stream_path(args.data)
    texts = read_jsonl(args.lambada, args.max_examples) if args.lambada else None
    if args.output:
        check_output_file(args.output, "--output")
    if tasks:       # before the model is loaded: a missing lm_eval or a bad task name is cheap
        from lwm_jax.eval.lm_eval_adapter import (  # ImportError
            check_task_code, check_task_names, task_manager)
        _check_task_options(args)
        check_task_code(args.include_path, getattr(args, "allow_task_code", False))
        where = f" (and {quote_path(args.include_path)})" if args.include_path else ""
        _stage(err, f"indexing lm-eval tasks{where} ...")
        manager = task_manager(args.include_path, tasks.split(","))
        names = check_task_names(tasks.split(","), manager)
    _stage(err, f"loading checkpoint {quote_path(args.checkpoint)} and building the model ...")
    from lwm_jax.generate.cli import load_model_and_tokenizer
    model, cfg, tok = load_model_and_tokenizer(args)
    _stage(err, _describe(model, args.ctx_len))
    results: dict = {}
    with _closing_bars():
        if args.data:
            results["perplexity"] = _perplexity(args, model, tok, err)
        if texts is not None:
            results["lambada"] = _lambada(args, model, tok, texts, err)
        if tasks:
            results["lm_eval"] = _run_lm_eval(args, model, tok, manager, names, err)
    text = json.dumps(results, indent=2, allow_nan=False) + "\n"
    out.write(text)
    out.flush()
    if args.output:
        write_text(args.output, text)
    return results


def _check_checkpoint(args: argparse.Namespace) -> None:
    """The checkpoint's format detected from its path (what loading it does first), unless
    `--format` forces one or the name is a Hugging Face Hub name: a missing or unrecognised
    checkpoint is then one line before any stage begins."""
    from lwm_jax.interop.api import detect_format
    from lwm_jax.interop.hub import is_hub_name
    if getattr(args, "format", None) is None and not is_hub_name(args.checkpoint):
        detect_format(args.checkpoint)


def _describe(model, ctx_len: int) -> str:
    """`arch, parameters, how far it sees` of a loaded model, for the progress line."""
    from lwm_jax.eval.scoring import model_context
    from lwm_jax.models.registry import arch_of_model
    recurrent, max_len = model_context(model)
    if recurrent:
        seen = f"state carried through windows of {ctx_len} tokens (--ctx-len)"
    elif max_len is not None:
        seen = f"windows of {max_len} tokens (its max_seq_len; --ctx-len does not apply)"
    else:
        seen = f"windows of {ctx_len} tokens (--ctx-len; no state carried between them)"
    return f"{arch_of_model(model).name} model, {model.param_count():,} parameters; {seen}"


def _perplexity(args: argparse.Namespace, model, tok, err) -> dict:
    from lwm_jax.eval.perplexity import count_windows, evaluate_stream, load_stream
    from lwm_jax.eval.scoring import Scorer
    _stage(err, f"perplexity: reading {quote_path(args.data)} ...")
    stream = load_stream(args.data, tok)
    scorer = Scorer(model)
    n = min(len(stream), args.max_tokens or len(stream))
    if n:
        windows = count_windows(scorer, n, args.ctx_len)
        _stage(err, f"perplexity: {n:,} tokens in {windows:,} window{'s' * (windows > 1)}; "
                    "compiling the scorer (first window) ...")
    res = evaluate_stream(scorer, stream, tok, ctx_len=args.ctx_len, max_tokens=args.max_tokens,
                          eod_id=tok.eod_id, batch_size=args.batch_size,
                          progress=lambda total: _progress_bar("perplexity", total, err,
                                                               "window"))
    metrics = res.to_dict()
    _check_finite("perplexity", args.data, metrics)
    return {"data": args.data, **metrics}


def _lambada(args: argparse.Namespace, model, tok, texts: list[str], err) -> dict:
    from lwm_jax.eval.batched import PairScorer
    from lwm_jax.eval.lambada import encode_examples, last_word_accuracy
    examples = encode_examples(tok, texts)
    scorer = PairScorer(model, batch_size=args.batch_size, window=args.ctx_len)
    _stage(err, f"lambada: {len(examples):,} examples; compiling the scorer (first batch) ...")
    res = last_word_accuracy(scorer, examples,
                             _progress_bar("lambada", len(examples), err, "example"))
    if res.n_truncated:
        _stage(err, f"lambada: {res.n_truncated} of {res.n} contexts were cut from the left to "
                    f"fit {scorer.max_len} tokens ({scorer.limit}); see n_truncated")
    metrics = res.to_dict()
    _check_finite("lambada", args.lambada, metrics)
    return {"data": args.lambada, **metrics}


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


_OPEN_BARS: list = []     # bars not yet closed: `_closing_bars` closes them when a stage fails


@contextlib.contextmanager
def _closing_bars():
    """Close every progress bar opened inside when leaving (an error included), so an error
    message prints on its own line after the bar, not into it, and no bar is redrawn after it."""
    mark = len(_OPEN_BARS)
    try:
        yield
    finally:
        while len(_OPEN_BARS) > mark:
            _OPEN_BARS.pop().close()


def _progress_bar(kind: str, total: int, err=None, unit: str = "req"):
    """A progress bar on `err` (default stderr) over `total` units of one kind; returns its
    updater `update(n_done)`, which closes the bar at `total` (`_closing_bars` closes it
    earlier when the stage fails)."""
    from tqdm import tqdm
    bar = tqdm(total=total, desc=f"[eval] {kind}", file=err or sys.stderr, unit=unit)
    _OPEN_BARS.append(bar)

    def update(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()
    return update


def _run_lm_eval(args: argparse.Namespace, model, tok, manager, names: list[str], err) -> dict:
    """lm-eval's results for `--tasks`, checked finite (standard errors may be None). Task
    templates render in a Jinja sandbox when `--include-path` is given without
    `--allow-task-code` (`lm_eval_adapter.sandboxed_templates`)."""
    from lwm_jax.eval.harness import HarnessModel
    from lwm_jax.eval.lm_eval_adapter import run_tasks
    harness = HarnessModel(model, tok, batch_size=args.batch_size, window=args.ctx_len,
                           prefix=args.prefix,
                           progress=lambda kind, total: _progress_bar(kind, total, err))
    _stage(err, f"lm-eval: running {','.join(names)} (the first batch of each request kind "
                "compiles) ...")
    sandbox = bool(args.include_path) and not getattr(args, "allow_task_code", False)
    out = run_tasks(harness, names, num_fewshot=args.num_fewshot, limit=args.limit,
                    bootstrap_iters=args.bootstrap_iters, manager=manager, sandbox=sandbox)
    if out["n_truncated"]:
        _stage(err, f"lm-eval: {out['n_truncated']} requests lost context tokens from the left "
                    "to fit the model's window; see n_truncated")
    for task, metrics in out["results"].items():
        _check_finite(task, ",".join(names),
                      {k: v for k, v in metrics.items() if "_stderr" not in k})
    return {"tasks": names, "prefix": args.prefix, "limit": args.limit, **out}
