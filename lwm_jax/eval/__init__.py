"""Scoring: perplexity / bits-per-byte of a stream, LAMBADA-style last-word accuracy, and
evaluation-harness requests (lm-eval's `LM` interface: `lwm_jax.eval.lm_eval_adapter`).

    scorer = Scorer(model)
    res = evaluate_stream(scorer, load_stream("corpus.txt", tok), tok)   # res.bits_per_byte
    acc = last_word_accuracy(PairScorer(model),
                             encode_examples(tok, read_jsonl("lambada.jsonl")))
    HarnessModel(model, tok).loglikelihood([("The cat sat on the", " mat")])

Names load on first use (PEP 562): importing `lwm_jax.eval.cli` (what `lwm-jax eval` runs
first) imports no jax, so the command reports its first stage at once.
"""
from lwm_jax._lazy import lazy_getattr

_SOURCES = {
    "PairScorer": "lwm_jax.eval.batched",
    "eval_main": "lwm_jax.eval.cli", "HarnessModel": "lwm_jax.eval.harness",
    **dict.fromkeys(("LambadaResult", "encode_examples", "last_word_accuracy", "read_jsonl",
                     "split_last_word"), "lwm_jax.eval.lambada"),
    **dict.fromkeys(("PerplexityResult", "count_bytes", "evaluate_stream", "load_stream",
                     "stream_nll"), "lwm_jax.eval.perplexity"),
    "Scorer": "lwm_jax.eval.scoring",
}
__getattr__ = lazy_getattr(__name__, _SOURCES)
__all__ = ["Scorer", "PerplexityResult", "stream_nll", "evaluate_stream", "load_stream",
           "count_bytes", "LambadaResult", "split_last_word", "read_jsonl", "encode_examples",
           "last_word_accuracy", "eval_main", "HarnessModel", "PairScorer"]
