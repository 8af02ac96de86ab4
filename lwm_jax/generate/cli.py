"""`lwm-jax generate`: argparse setup and entry point (wired into `lwm_jax.cli` by the lead).

    lwm-jax generate --checkpoint DIR_OR_PTH --prompt "The Eiffel tower is in" \
        [--max-new-tokens 100] [--temperature 1.0] [--top-p 0.85] [--top-k 0] [--seed 0]

Text streams to stdout as tokens arrive (multi-byte characters are printed once complete).
`--save-state FILE` stores the state after the prompt and the generated text (with
`--max-new-tokens 0`: the prompt's state); `--load-state FILE` starts from such a state.
"""
from __future__ import annotations

import argparse
import codecs
import sys

from lwm_jax.generate.sampling import SamplingParams

DEFAULT_TOKENIZER = {256: "byte", 65536: "world"}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--checkpoint / --format / --tokenizer / --precision (shared with `lwm-jax eval`)."""
    p.add_argument("--checkpoint", required=True,
                   help="our converted directory, an official .pth file or an HF directory")
    p.add_argument("--format", default=None, choices=("rwkv-pth", "hf", "lwm", "run"),
                   help="checkpoint format (default: detected from the path)")
    p.add_argument("--tokenizer", default=None,
                   help="byte | world | world:/path/vocab.txt | hf:/path/tokenizer.json "
                        "(default: byte for vocab 256, world for vocab 65536)")
    p.add_argument("--precision", default="fp32", help="precision policy (fp32, bf16, ...)")


def load_model_and_tokenizer(args: argparse.Namespace):
    """`(model, cfg, tokenizer)` from the arguments of `add_model_args`."""
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


def add_generate_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-token", type=int, action="append", default=[],
                   help="token id that ends generation (repeatable)")
    p.add_argument("--no-stop-at-eod", action="store_true",
                   help="do not stop at the tokenizer's end-of-document id")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--decode-block", type=int, default=16,
                   help="decode steps per compiled call (one host sync each; text is streamed "
                        "in bursts of up to this many tokens)")
    p.add_argument("--load-state", help="start from a state saved with --save-state")
    p.add_argument("--save-state", help="save the final state (.safetensors)")
    return p


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


def generate_main(args: argparse.Namespace, out=None) -> list[int]:
    """Run `lwm-jax generate`; returns the generated ids (text goes to `out`, default stdout)."""
    from lwm_jax.generate.engine import Generator
    from lwm_jax.generate.state_io import load_state, save_state
    out = out or sys.stdout
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.repetition_penalty,
                              args.presence_penalty, args.frequency_penalty)
    model, cfg, tok = load_model_and_tokenizer(args)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = args.prompt
    ids = tok.encode(text)
    if not ids:
        raise ValueError("--prompt: empty after tokenization; give some text")
    stops = list(args.stop_token) + ([] if args.no_stop_at_eod else [tok.eod_id])
    initial = load_state(args.load_state, cfg) if args.load_state else None
    gen = Generator(model, prefill_chunk=args.prefill_chunk, decode_block=args.decode_block)
    result = gen.generate([ids], args.max_new_tokens, sampling, stop_tokens=stops,
                          seed=args.seed, initial_state=initial,
                          on_token=_TextStream(tok, out))
    out.write("\n")
    if args.save_state:
        save_state(args.save_state, result.state, cfg, n_tokens=[len(ids) + len(result.tokens[0])])
    return result.tokens[0]


def main(argv=None) -> None:
    p = add_generate_args(argparse.ArgumentParser(prog="lwm-jax generate"))
    generate_main(p.parse_args(argv))
