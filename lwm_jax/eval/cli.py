"""`lwm-jax eval`: perplexity / bits-per-byte of a text or binidx file, LAMBADA-style accuracy.

    lwm-jax eval --checkpoint DIR --data corpus.txt [--ctx-len 1024] [--max-tokens N]
    lwm-jax eval --checkpoint DIR --data data/minipile_text_document      # binidx prefix
    lwm-jax eval --checkpoint DIR --lambada lambada_test.jsonl [--max-examples N]

Prints one JSON object per task (also written to `--output FILE` when given).
"""
from __future__ import annotations

import argparse
import json
import sys

from lwm_jax.generate.cli import add_model_args, load_model_and_tokenizer


def add_eval_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_args(p)
    p.add_argument("--data", help="text file, or binidx prefix / .bin / .idx, for perplexity")
    p.add_argument("--lambada", help="JSONL file of {\"text\": ...} for last-word accuracy")
    p.add_argument("--ctx-len", type=int, default=1024, help="tokens per scoring window")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--max-examples", type=int, default=None, help="LAMBADA examples to use")
    p.add_argument("--batch-size", type=int, default=8, help="LAMBADA batch size")
    p.add_argument("--output", help="also write the results as JSON to this file")
    return p


def eval_main(args: argparse.Namespace, out=None) -> dict:
    """Run the requested evaluations; returns `{"perplexity": {...}, "lambada": {...}}`."""
    from lwm_jax.eval.lambada import encode_examples, last_word_accuracy, read_jsonl
    from lwm_jax.eval.perplexity import evaluate_stream, load_stream
    from lwm_jax.eval.scoring import Scorer
    out = out or sys.stdout
    if not args.data and not args.lambada:
        raise ValueError("eval: give --data (perplexity) and/or --lambada (last-word accuracy)")
    model, cfg, tok = load_model_and_tokenizer(args)
    scorer = Scorer(model)
    results: dict = {}
    if args.data:
        stream = load_stream(args.data, tok)
        res = evaluate_stream(scorer, stream, tok, ctx_len=args.ctx_len,
                              max_tokens=args.max_tokens, eod_id=tok.eod_id)
        results["perplexity"] = {"data": args.data, **res.to_dict()}
        out.write(json.dumps({"task": "perplexity", **results["perplexity"]}) + "\n")
    if args.lambada:
        examples = encode_examples(tok, read_jsonl(args.lambada, args.max_examples))
        res = last_word_accuracy(scorer, examples, batch_size=args.batch_size)
        results["lambada"] = {"data": args.lambada, **res.to_dict()}
        out.write(json.dumps({"task": "lambada", **results["lambada"]}) + "\n")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


def main(argv=None) -> None:
    p = add_eval_args(argparse.ArgumentParser(prog="lwm-jax eval"))
    eval_main(p.parse_args(argv))
