"""From the `data` config section to global token batches on the mesh.

Train batches come from a shuffled `WindowSampler` over a binidx file or the embedded corpus
(state = its step, saved in checkpoints), or, for text tokenised on the fly and for weighted
mixtures (`data.path` naming text, `data.sources`), from a `MixtureSampler` over
`TokenWindows` / `PermutedWindows` sources (state = its step and every source's position).
Validation uses a fixed, unshuffled sampler over held-out tokens, so every evaluation scores
the same windows: `data.val_path` when given, else `data.val_fraction` of the training data,
held out by document: the last documents of a binidx file (`split_train_val`), every text or
`hf:` document whose hash says so (`lwm_jax.data.text_sources`). In a mixture each source holds
out its own documents and gives its weight's share of the validation tokens; text is read and
tokenised only up to the `train.eval_batches` batches validation scores.

Each host reads only its rows of the global batch (`jax.process_index()`), and
`jax.make_array_from_process_local_data` assembles the global array.

`train_data` builds all of it, validation included, before the trainer builds the model, so a
validation split too small for one batch (`train.batch_size` windows of `train.ctx_len + 1`
tokens) or an `hf:` dataset that cannot be reached is refused in one line at start-up.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from lwm_jax.data import BinIdxDataset, WindowSampler, split_train_val, stdlib_corpus
from lwm_jax.data.mixture import MixtureSampler
from lwm_jax.data.permutation import derive_key
from lwm_jax.data.prepare import read_tokenizer_record
from lwm_jax.data.stream import PermutedWindows, TokenWindows, held_out_tokens
from lwm_jax.data.text_sources import open_documents, source_kind
from lwm_jax.tokenizers import ByteTokenizer, WorldTokenizer, get_tokenizer
from lwm_jax.train.config import DataSection, TrainSection
from lwm_jax.user_input import short


@dataclasses.dataclass
class TokenSplits:
    """Flat token arrays (memmaps) of the two splits; `val` is None when nothing is held out."""

    train: np.ndarray
    val: np.ndarray | None
    description: str
    bounds: np.ndarray | None = None    # document bounds of train + val, when val was cut off


def load_splits(d: DataSection, model: Any) -> TokenSplits:
    """Open the configured data (or the embedded corpus) and split off validation tokens.

    `model`: the run's model config (any family; only its `vocab_size` is read).

    Raises ValueError (one line naming the key) when the tokenizer does not fit the model or
    disagrees with the one `lwm-jax prepare` recorded next to `data.path` / `data.val_path`.
    """
    vocab = _tokenizer_vocab(d.tokenizer)
    if vocab is not None and vocab > model.vocab_size:
        raise ValueError(f"model.vocab_size: {model.vocab_size} is smaller than the "
                         f"{d.tokenizer!r} tokenizer's vocabulary ({vocab})")
    if d.path is None:
        if d.tokenizer != "byte":
            raise ValueError(f"data.tokenizer: the embedded corpus is byte-level; set "
                             f"data.tokenizer=byte or give data.path (got {d.tokenizer!r})")
        if d.val_fraction <= 0:
            raise ValueError("data.val_fraction: the embedded corpus needs a held-out split "
                             "> 0 (default 0.05)")
        train, val = stdlib_corpus(val_fraction=d.val_fraction)
        return TokenSplits(train, val, f"embedded Python-stdlib corpus ({len(train):,} train / "
                                       f"{len(val):,} val byte tokens)")
    for key, prefix in (("data.path", d.path), ("data.val_path", d.val_path)):
        if prefix is not None:
            check_tokenizer_record(key, prefix, d.tokenizer, vocab)
    ds = BinIdxDataset(d.path)
    bounds = None
    if d.val_path is not None:
        train, val = ds.tokens, BinIdxDataset(d.val_path).tokens
    elif d.val_fraction > 0:
        bounds = ds.sequence_bounds()
        train, val = split_train_val(ds.tokens, d.val_fraction, bounds)
    else:
        train, val = ds.tokens, None
    desc = f"{d.path} ({len(train):,} train / {0 if val is None else len(val):,} val tokens)"
    return TokenSplits(train, val, desc, bounds)


@dataclasses.dataclass
class TrainData:
    """The run's data: `sampler` (`WindowSampler` or `MixtureSampler`: `next()`, `step`,
    `state_dict()`), `val` (a validation `WindowSampler` or None), a one-line description."""

    sampler: Any
    val: WindowSampler | None
    description: str


def train_data(d: DataSection, model: Any, t: TrainSection) -> TrainData:
    """Samplers for the `data` section (see the module docstring). ValueError (one line naming
    the key) for data that cannot be read or does not fit the tokenizer or the model."""
    if not d.sources and (d.path is None or source_kind(d.path) == "binidx"):
        splits = load_splits(d, model)
        val = None
        if splits.val is not None:
            val = val_sampler(splits.val, t, "data.val_path" if d.val_path else
                              "data.val_fraction", splits.bounds)
        return TrainData(train_sampler(splits.train, t), val, splits.description)
    vocab = _tokenizer_vocab(d.tokenizer)
    if vocab is not None and vocab > model.vocab_size:
        raise ValueError(f"model.vocab_size: {model.vocab_size} is smaller than the "
                         f"{d.tokenizer!r} tokenizer's vocabulary ({vocab})")
    specs = list(d.sources) or [d.path]
    keys = [f"data.sources[{i}]" for i in range(len(d.sources))] or ["data.path"]
    weights = list(d.weights) or [1.0] * len(specs)
    hold = d.val_fraction if d.val_path is None else 0.0    # val_path replaces the hold-out
    # validation tokens wanted from each source: its weight's share of eval_batches batches
    want = t.eval_batches * t.batch_size * t.ctx_len + 1
    wants = [math.ceil(want * w / sum(weights)) for w in weights]
    sources, held, tokenizer = [], [], None
    for i, (key, spec) in enumerate(zip(keys, specs)):
        if source_kind(spec) == "binidx":
            check_tokenizer_record(key, spec, d.tokenizer, vocab)
            ds = BinIdxDataset(spec)
            tokens, val_tokens = ds.tokens, None
            if hold > 0:
                tokens, val_tokens = split_train_val(tokens, hold, ds.sequence_bounds())
                held.append(np.asarray(val_tokens[:wants[i]], np.int32))
            try:
                sources.append(PermutedWindows(tokens, t.ctx_len, seed=derive_key(t.seed, i, 4),
                                               name=spec, val_fraction=hold))
            except ValueError as e:
                raise ValueError(f"{key}: too small: {e}") from None
            continue
        if tokenizer is None:
            try:
                tokenizer = get_tokenizer(d.tokenizer)
            except (OSError, ValueError, ImportError) as e:
                raise ValueError(f"data.tokenizer: cannot load {short(d.tokenizer)} to tokenise "
                                 f"{key} ({short(str(e))})") from None
        docs = open_documents(spec, text_key=d.text_key, seed=t.seed, key=key,
                              val_fraction=hold)
        if hold > 0:
            held.append(held_out_tokens(docs, tokenizer, wants[i]))
        elif hasattr(docs, "probe"):        # a stream that cannot be reached: refused now
            docs.probe()
        sources.append(TokenWindows(docs, tokenizer, t.ctx_len))
    sampler = MixtureSampler(sources, weights, global_batch_size=t.batch_size, seed=t.seed,
                             host_index=jax.process_index(), host_count=jax.process_count())
    val, validation = None, "no validation: set data.val_fraction > 0 or data.val_path"
    if d.val_path is not None:
        check_tokenizer_record("data.val_path", d.val_path, d.tokenizer, vocab)
        val = val_sampler(BinIdxDataset(d.val_path).tokens, t, "data.val_path")
        validation = f"validation {d.val_path}"
    elif hold > 0:
        val_tokens = np.concatenate(held)
        val = val_sampler(val_tokens, t, "data.val_fraction")
        validation = f"validation {len(val_tokens):,} held-out tokens, {hold:g} of the documents"
    mix = ", ".join(f"{short(s)} x{w / sum(weights):.2f}" for s, w in zip(specs, weights))
    desc = (f"{mix} ({'tokenised on the fly by ' + d.tokenizer if tokenizer else 'binidx'}; "
            f"{validation})")
    return TrainData(sampler, val, desc)


def check_tokenizer_record(key: str, prefix: str, spec: str, vocab: int | None) -> None:
    """Refuse data prepared with another tokenizer than `data.tokenizer` = `spec` (its kind
    differs, e.g. byte vs world, or its vocabulary size differs from `vocab`). Data without a
    record (prepared elsewhere) is not checked. Raises ValueError (one line)."""
    record = read_tokenizer_record(prefix)
    if record is None:
        return
    used = record["tokenizer"]
    same_kind = used.partition(":")[0] == spec.partition(":")[0]
    same_vocab = vocab is None or record.get("vocab_size") in (None, vocab)
    if not (same_kind and same_vocab):
        raise ValueError(f"data.tokenizer: {short(spec)} does not match {key}={prefix}, which was "
                         f"prepared with tokenizer {used!r} (vocab_size "
                         f"{record.get('vocab_size')}); set data.tokenizer={used} or re-run "
                         f"lwm-jax prepare --tokenizer {spec}")


def eod_id_for(d: DataSection) -> int:
    """The end-of-document token id of the training data (for
    `data.reset_at_document_boundary`): the id `lwm-jax prepare` recorded beside `data.path`,
    else the tokenizer's (0 for byte and World, the embedded corpus included; an `hf:`
    tokenizer is loaded to find its own). Raises ValueError (one line) when it cannot be
    known."""
    if d.path is not None:
        record = read_tokenizer_record(d.path)
        if record is not None and isinstance(record.get("eod_id"), int):
            return int(record["eod_id"])
    kind = d.tokenizer.partition(":")[0]
    if kind in ("byte", "world"):
        return int((ByteTokenizer if kind == "byte" else WorldTokenizer).eod_id)
    try:
        return int(get_tokenizer(d.tokenizer).eod_id)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"data.reset_at_document_boundary: cannot find the end-of-document "
                         f"id of data.tokenizer={short(d.tokenizer)} ({short(str(e))}); make "
                         "the tokenizer loadable or set data.reset_at_document_boundary=false") \
            from None


def _tokenizer_vocab(spec: str) -> int | None:
    """The tokenizer's vocabulary size, or None (with a warning) when it cannot be loaded:
    training reads token ids only, the tokenizer just guards `model.vocab_size`."""
    try:
        return get_tokenizer(spec).vocab_size
    except (OSError, ValueError, ImportError) as e:
        warnings.warn(f"data.tokenizer: cannot load {spec!r} ({e}); not checking "
                      "model.vocab_size against it", RuntimeWarning, stacklevel=3)
        return None


def train_sampler(tokens: np.ndarray, t: TrainSection) -> WindowSampler:
    """Shuffled windows of `ctx_len + 1` tokens, this host's share of `batch_size` per step."""
    try:
        return WindowSampler(tokens, t.ctx_len, t.batch_size, seed=t.seed,
                             host_index=jax.process_index(), host_count=jax.process_count())
    except ValueError as e:
        raise ValueError(f"data.path: training split too small: {e}") from None


def val_sampler(tokens: np.ndarray, t: TrainSection, key: str = "data.val_fraction",
                bounds: np.ndarray | None = None) -> WindowSampler:
    """Fixed (unshuffled, offset 0) validation windows; batch i is `batch_at(i)`.

    `key`: the setting the tokens come from (`data.val_fraction` or `data.val_path`), named
    with the fix when they hold fewer than the `train.batch_size * train.ctx_len + 1` tokens
    of one batch; `bounds`: the document bounds (token offsets, `sequence_bounds()`) of the
    binidx tokens the held-out fraction was cut from (None: unknown), to suggest a fraction
    that suffices."""
    check_validation_size(len(tokens), t, key, bounds)
    try:
        return WindowSampler(tokens, t.ctx_len, t.batch_size, seed=t.seed, shuffle=False,
                             random_offset=False, host_index=jax.process_index(),
                             host_count=jax.process_count())
    except ValueError as e:
        raise ValueError(f"{key}: validation split too small: {e}") from None


def check_validation_size(n_tokens: int, t: TrainSection, key: str = "data.val_fraction",
                          bounds: np.ndarray | None = None) -> None:
    """Refuse (one-line ValueError naming `key`, train.batch_size, train.ctx_len and the fix)
    validation tokens too few for one batch of `train.batch_size` windows of
    `train.ctx_len + 1` tokens (consecutive windows share a token: B * T + 1 in all)."""
    need = t.batch_size * t.ctx_len + 1
    if n_tokens >= need:
        return
    if key == "data.val_path":
        fix = "give a larger data.val_path, or lower train.batch_size or train.ctx_len"
    else:
        enough = _enough_fraction(need, bounds)
        enough = f" (to {enough:g} or more)" if enough else ""
        fix = (f"raise data.val_fraction{enough}, lower train.batch_size or train.ctx_len, "
               "give data.val_path, or set data.val_fraction=0 to train without validation")
    raise ValueError(f"{key}: validation split too small: it holds {n_tokens:,} tokens, fewer "
                     f"than the train.batch_size * train.ctx_len + 1 = {t.batch_size} * "
                     f"{t.ctx_len} + 1 = {need:,} of one validation batch; {fix}")


def _enough_fraction(need: int, bounds: np.ndarray | None) -> float | None:
    """The smallest `data.val_fraction` (rounded up to 3 decimals, below 0.5) whose split, cut
    at the document bound `split_train_val` moves it to, holds `need` tokens; None when no
    such fraction exists or `bounds` is None. A fraction of at least `(total - b) / total`
    for the last bound b leaving `need` tokens puts the cut at b or before it."""
    if bounds is None or len(bounds) < 2:
        return None
    total = int(bounds[-1])
    cuts = bounds[(bounds > 0) & (bounds <= total - need)]
    if total <= 0 or not cuts.size:
        return None
    fraction = math.ceil(1000 * (total - int(cuts.max())) / total) / 1000
    return fraction if fraction < 0.5 else None


def to_global(local_BT1: np.ndarray, sharding: NamedSharding, global_batch: int,
              grad_accum: int = 1, vocab_size: int | None = None) -> jax.Array:
    """This host's `[b, T+1]` rows -> global `[B, T+1]` (or `[A, B/A, T+1]`) jax.Array.

    With `vocab_size`, a token id outside `[0, vocab_size)` is a one-line error (an embedding
    lookup would otherwise turn it into NaN logits without a word).
    """
    if vocab_size is not None and local_BT1.size:
        top = int(local_BT1.max())
        if top >= vocab_size or int(local_BT1.min()) < 0:
            raise ValueError(f"data: token id {top} is outside model.vocab_size={vocab_size}; "
                             "the data was tokenised with another vocabulary (check "
                             "data.tokenizer and model.vocab_size)")
    shape = global_batch_shape(global_batch, local_BT1.shape[-1], grad_accum)
    local = local_BT1.reshape(grad_accum, -1, shape[-1]) if grad_accum > 1 else local_BT1
    return jax.make_array_from_process_local_data(sharding, local, shape)


def global_batch_shape(global_batch: int, width: int, grad_accum: int = 1) -> tuple[int, ...]:
    """Shape of the global token batch a train step takes: `[B, T+1]`, or `[A, B/A, T+1]` with
    `grad_accum` A > 1 (`width` = T+1)."""
    if grad_accum > 1:
        return (grad_accum, global_batch // grad_accum, width)
    return (global_batch, width)
