"""Scoring: perplexity / bits-per-byte of a stream, LAMBADA-style last-word accuracy, and
evaluation-harness requests (lm-eval's `LM` interface: `lwm_jax.eval.lm_eval_adapter`).

    scorer = Scorer(model)
    res = evaluate_stream(scorer, load_stream("corpus.txt", tok), tok)   # res.bits_per_byte
    acc = last_word_accuracy(scorer, encode_examples(tok, read_jsonl("lambada.jsonl")))
    HarnessModel(model, tok).loglikelihood([("The cat sat on the", " mat")])
"""
from lwm_jax.eval.batched import PairScorer
from lwm_jax.eval.cli import add_eval_args, eval_main
from lwm_jax.eval.harness import HarnessModel
from lwm_jax.eval.lambada import (LambadaResult, encode_examples, last_word_accuracy, read_jsonl,
                                  split_last_word)
from lwm_jax.eval.perplexity import (PerplexityResult, count_bytes, evaluate_stream, load_stream,
                                     stream_nll)
from lwm_jax.eval.scoring import Scorer

__all__ = ["Scorer", "PerplexityResult", "stream_nll", "evaluate_stream", "load_stream",
           "count_bytes", "LambadaResult", "split_last_word", "read_jsonl", "encode_examples",
           "last_word_accuracy", "add_eval_args", "eval_main", "HarnessModel", "PairScorer"]
