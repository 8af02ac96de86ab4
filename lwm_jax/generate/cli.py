"""`lwm-jax generate`: entry point (arguments: `lwm_jax.cli.args.add_generate_args`).

    lwm-jax generate --checkpoint DIR_OR_PTH --prompt "The Eiffel tower is in" \
        [--max-new-tokens 100] [--temperature 1.0] [--top-p 0.85] [--top-k 0] [--seed 0]

The prompt is echoed, then the continuation streams to stdout as tokens arrive (multi-byte
characters are printed once complete; `--no-echo` prints only the continuation). A summary
with tokens/s goes to stderr at the end, so stdout holds only text.
`--save-state FILE` (RWKV-7 only) stores the state after the prompt and the generated text
(with `--max-new-tokens 0`: the prompt's state) and the logits of its last position;
`--load-state FILE` starts from such a state: a prompt is fed to it first, and with an empty
prompt (`--prompt ""` or none given) generation continues right where the saved run stopped
(greedy decoding then gives the tokens one uninterrupted run would have given). A state file
of format 1 (written before the logits were stored) needs a non-empty prompt.
"""
from __future__ import annotations

import argparse
import codecs
import os
import sys
import time

from lwm_jax.user_input import quote_path

DEFAULT_TOKENIZER = {256: "byte", 65536: "world"}
__all__ = ["load_model_and_tokenizer", "generate_main",
           "DEFAULT_TOKENIZER"]


def load_model_and_tokenizer(args: argparse.Namespace):
    """`(model, cfg, tokenizer)` from the arguments of `add_model_args`; raises what
    `load_pretrained` raises, and ValueError when the tokenizer does not fit the model."""
    from lwm_jax.interop import load_pretrained
    from lwm_jax.tokenizers import get_tokenizer
    model, cfg = load_pretrained(args.checkpoint, format=args.format, policy=args.precision)
    spec = args.tokenizer or DEFAULT_TOKENIZER.get(cfg.vocab_size)
    if spec is None:
        raise ValueError(f"--tokenizer: the model's vocab_size is {cfg.vocab_size}; say which "
                         "tokenizer matches it (byte | world | hf:/path/tokenizer.json)")
    tok = get_tokenizer(spec)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"--tokenizer: {spec!r} has {tok.vocab_size} ids but the model only "
                         f"{cfg.vocab_size}")
    return model, cfg, tok


class _TextStream:
    """Prints token text as it arrives, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, out):
        self.tok, self.out, self.ids, self.shown = tokenizer, out, [], ""
        self.dec = (codecs.getincrementaldecoder("utf-8")(errors="replace")
                    if hasattr(tokenizer, "decode_bytes") else None)

    def __call__(self, row: int, token: int) -> None:
        if self.dec is not None:
            text = self.dec.decode(self.tok.decode_bytes([token]))
        else:
            self.ids.append(token)
            full = self.tok.decode(self.ids)
            text, self.shown = full[len(self.shown):], full
        self.out.write(text)
        self.out.flush()


# Why a family cannot save or load a state (all but RWKV-7); the refusal is one line.
NO_STATE_FILE = {
    "llama": "decodes from a KV cache, which is not saved",
    "rwkv7-hybrid": "cannot generate yet (its attention layers would need a KV cache)",
}


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt text; "" when neither --prompt nor --prompt-file is given (allowed only with
    --load-state, which can continue a saved state without new text)."""
    if not args.prompt_file and args.prompt is None and not args.load_state:
        raise ValueError("--prompt: no prompt given; pass --prompt TEXT or --prompt-file FILE "
                         "(only --load-state can continue without one)")
    if not args.prompt_file:
        text = args.prompt or ""
        _check_utf8(text, "--prompt: contains a byte that is not UTF-8 (or a lone surrogate)",
                    "pass the prompt as UTF-8 text, or use --prompt-file")
        return text
    check_regular_file(args.prompt_file, "--prompt-file", must_exist=False)
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file: {quote_path(args.prompt_file)} is not UTF-8 text "
                         f"(byte {err.start}); save it as UTF-8") from None
    return text


def check_regular_file(path, flag: str, must_exist: bool = True) -> None:
    """Refuse (one line naming `flag`) a `path` that exists but is not a regular file (a FIFO
    would block the open, a device never ends); with `must_exist`, refuse a missing one too."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise ValueError(f"{flag}: {quote_path(path)} is not a regular file (a FIFO, device or "
                         "socket); give a regular file")
    if must_exist and not os.path.isfile(path):
        raise ValueError(f"{flag}: {quote_path(path)}: no such file")


def _check_utf8(text: str, what: str, fix: str) -> None:
    """Refuse text holding a lone surrogate: undecodable argv bytes (Python's surrogateescape)
    or an escaped one, which cannot be encoded (and so cannot be tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} at character {err.start}; {fix}") from None


def generate_main(args: argparse.Namespace, out=None, err=None) -> list[int]:
    """Run `lwm-jax generate`; returns the generated ids.

    The prompt (unless `--no-echo`) and the generated text go to `out` (default stdout), a
    one-line summary with tokens/s to `err` (default stderr). Paths and sampling settings are
    checked before the model is loaded; every problem is a one-line ValueError (see
    `load_model_and_tokenizer`, `state_io.load_state_file`). An empty prompt needs
    `--load-state` with a file that stores its logits (format 2): generation then starts from
    those logits.
    """
    from lwm_jax.generate.engine import Generator
    from lwm_jax.generate.sampling import SamplingParams
    from lwm_jax.generate.state_io import FORMAT_V1, check_state_target, load_state_file, save_state
    from lwm_jax.models.registry import arch_of_model
    out = out or sys.stdout
    err = err or sys.stderr
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.repetition_penalty,
                              args.presence_penalty, args.frequency_penalty)
    if not 0 <= args.seed < 2**63:          # jax.random.PRNGKey takes an int64
        raise ValueError(f"--seed: must be an integer in [0, 2**63), got {args.seed}")
    if args.save_state:
        check_state_target(args.save_state, "--save-state")
    if args.load_state:
        check_regular_file(args.load_state, "--load-state")
    text = _read_prompt(args)
    model, cfg, tok = load_model_and_tokenizer(args)
    arch = arch_of_model(model).name
    if (args.save_state or args.load_state) and arch != "rwkv7":
        flag = "--save-state" if args.save_state else "--load-state"
        why = NO_STATE_FILE.get(arch, "has no recurrent state")
        raise ValueError(f"{flag}: only RWKV-7 models have a state file; this {arch} model "
                         f"{why} (leave the flag out)")
    ids = tok.encode(text)
    if not ids and not args.load_state:
        raise ValueError("--prompt: empty after tokenization; give some text")
    saved = load_state_file(args.load_state, cfg) if args.load_state else None
    if not ids and saved.logits is None:
        raise ValueError(f"--load-state: {quote_path(args.load_state)} predates stored logits "
                         f"(format {FORMAT_V1!r}), so it cannot continue without new text; give a "
                         "non-empty --prompt, or save the state again with this version "
                         "(--save-state)")
    stops = list(args.stop_token) + ([] if args.no_stop_at_eod else [tok.eod_id])
    gen = Generator(model, prefill_chunk=args.prefill_chunk, decode_block=args.decode_block)
    stream = _TextStream(tok, out)
    first: list[float] = []

    def on_token(row: int, token: int) -> None:
        if not first:
            first.append(time.perf_counter())
        stream(row, token)

    if not args.no_echo:
        out.write(text)
        out.flush()
    start = time.perf_counter()
    result = gen.generate([ids], args.max_new_tokens, sampling, stop_tokens=stops,
                          seed=args.seed, initial_state=None if saved is None else saved.state,
                          on_token=on_token,
                          initial_logits=None if ids or saved is None else saved.logits)
    elapsed = time.perf_counter() - start
    out.write("\n")
    out.flush()
    if args.save_state:
        before = [0] if saved is None else saved.n_tokens      # [] when the file did not say
        consumed = [n + len(ids) + len(result.tokens[0]) for n in before[:1]] or None
        save_state(args.save_state, result.state, cfg, n_tokens=consumed,
                   logits=result.last_logits)
    err.write(_summary(len(ids), len(result.tokens[0]), elapsed,
                       first[0] - start if first else None, result.finish_reasons[0]) + "\n")
    return result.tokens[0]


def _summary(n_prompt: int, n_new: int, elapsed: float, to_first: float | None,
             reason: str) -> str:
    """One line: prompt and new token counts, the wait for the first token (prefill and the
    compilations: seconds on a first call) and the decode rate after it (the tokens after the
    first over the time after it; compilation is not in it)."""
    line = f"[generate] prompt {n_prompt} tokens, {n_new} new tokens in {elapsed:.2f} s"
    if to_first is not None:
        line += f": first token after {to_first:.2f} s (prefill + compilation)"
        decode_s = elapsed - to_first
        if n_new > 1 and decode_s > 0:
            line += f", then {(n_new - 1) / decode_s:.1f} tokens/s"
    return line + f"; stopped by {reason}"
