"""Argument definitions of every `lwm-jax` subcommand, in one light module.

Nothing here imports JAX-level code: `lwm-jax --help` and argument parsing build every
subparser from this module alone, and only the chosen subcommand's implementation module is
imported when it runs (`COMMANDS` names it). Defaults are shown in `--help` (`HelpFormatter`).
The `add_*_args` functions live only here (`from lwm_jax.cli.args import add_eval_args`);
the subcommand modules do not re-export them.
"""
from __future__ import annotations

import argparse

from lwm_jax.tokenizers import SPEC_HELP as TOKENIZER_SPEC_HELP

# Checkpoint formats (`lwm_jax.interop.api.FORMATS` / `EXPORT_FORMATS`; a test keeps them equal).
FORMATS = ("rwkv-pth", "hf", "lwm", "run")
EXPORT_FORMATS = ("rwkv-pth", "hf")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends `(default: X)` to an option's help when X says something (not None/False/[]) and
    the help text does not already explain its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (action.required or default is None or default is False or default == []
                or default is argparse.SUPPRESS or "(default" in text
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


# ------------------------------------------------------------------------------------ train
def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `lwm-jax train` (implemented in `lwm_jax.train.cli.train_main`)."""
    p.add_argument("--config", "-c", default=None, metavar="YAML",
                   help="run config (default: the built-in tiny config, = configs/tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. train.lr=3e-4 model.n_layer=4 precision=bf16")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="run at most N steps now, checkpoint and exit (resume later)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--compiled", default=None, metavar="PATH",
                   help="load the train step saved by `lwm-jax compile --save` instead of "
                        "compiling it (refused in one line when made for another config, "
                        "topology or jax/jaxlib/libtpu; runs the machine code in the file: "
                        "load only files you made)")
    return p


# ---------------------------------------------------------------------------------- compile
def add_compile_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `lwm-jax compile` (implemented in `lwm_jax.aot.cli.compile_main`)."""
    p.add_argument("--config", "-c", default=None, metavar="YAML",
                   help="run config (default: the built-in tiny config)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, as for train (e.g. train.batch_size=64 mesh.fsdp=-1)")
    p.add_argument("--topology", "-t", default=None, metavar="T",
                   help="TPU slice to compile for, without a TPU: v4-32, v5p-128, v5litepod-16, "
                        "v6e-64 (Cloud accelerator types) or JAX's v5p:4x4x4 (needs libtpu: "
                        "the [tpu] extra); default: the devices JAX sees here")
    p.add_argument("--num-slices", type=int, default=1, metavar="N",
                   help="N copies of the slice joined over DCN (multi-slice; mesh.data spans "
                        "them)")
    p.add_argument("--save", default=None, metavar="PATH",
                   help="write the compiled train step here, for `lwm-jax train --compiled`")
    p.add_argument("--no-eval", action="store_true", help="compile the train step only")
    p.add_argument("--json", action="store_true",
                   help="print the plan as one JSON object instead of text")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache directory (default: none)")
    return p


# ---------------------------------------------------------------------------------- prepare
def add_prepare_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `lwm-jax prepare` (implemented in `lwm_jax.data.prepare.run_prepare`)."""
    p.add_argument("--input", "-i", nargs="+", action="extend", required=True, metavar="PATH",
                   help=".txt (one document per file), .jsonl (one per line) or .parquet (one "
                        "per row) files, or directories of them")
    p.add_argument("--output", "-o", required=True, metavar="PREFIX",
                   help="output prefix; writes PREFIX.bin, PREFIX.idx and "
                        "PREFIX.tokenizer.json (the tokenizer used)")
    p.add_argument("--tokenizer", default="byte",
                   help=f"{TOKENIZER_SPEC_HELP}; byte matches the default (tiny, byte-level) "
                        "model, world the RWKV World models (vocab 65536)")
    p.add_argument("--text-key", default="text",
                   help="field of each .jsonl object holding the text")
    p.add_argument("--eod-token", default=None,
                   help="hf: tokenizers only: end-of-document token text")
    p.add_argument("--no-eod", action="store_true",
                   help="do not append the EOD token to documents")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="tokenise in N processes (1: in this process; the output is the same "
                        "for every N); default: min(cores, 32), one per 4 MB of input at most, "
                        "1 for the byte tokenizer")
    return p


# ------------------------------------------------------------------------- convert / export
def add_convert_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `lwm-jax convert` (implemented in `lwm_jax.interop.cli.convert_main`)."""
    p.add_argument("--input", "-i", required=True,
                   help="official .pth file, HF directory or training run directory")
    p.add_argument("--output", "-o", required=True, dest="output_dir",
                   help="new directory for config.yaml + params/")
    p.add_argument("--format", default=None, choices=FORMATS,
                   help="input format (default: detected from the path)")
    return p


def add_export_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `lwm-jax export` (implemented in `lwm_jax.interop.cli.export_main`)."""
    p.add_argument("--input", "-i", required=True, help="any checkpoint load_pretrained reads")
    p.add_argument("--output", "-o", required=True,
                   help=".pth file (rwkv-pth) or directory (hf)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="output layout")
    p.add_argument("--dtype", default=None, choices=("bf16", "f32"),
                   help="stored dtype (default: bf16 for rwkv-pth, f32 for hf)")
    p.add_argument("--input-format", default=None, choices=FORMATS,
                   help="format of --input (default: detected from the path)")
    p.add_argument("--max-shard-mb", type=int, default=None,
                   help="hf: split the weights into shards of at most this many MiB "
                        "(default: one file)")
    return p


# ------------------------------------------------------------------------ generate / eval
def add_model_args(p: argparse.ArgumentParser) -> None:
    """--checkpoint / --format / --tokenizer / --precision (shared by generate and eval)."""
    p.add_argument("--checkpoint", required=True,
                   help="our converted directory, an official .pth file, an HF directory or a "
                        "training run directory")
    p.add_argument("--format", default=None, choices=FORMATS,
                   help="checkpoint format (default: detected from the path)")
    p.add_argument("--tokenizer", default=None,
                   help=f"{TOKENIZER_SPEC_HELP} (default: byte for vocab 256, world for "
                        "vocab 65536)")
    p.add_argument("--precision", default="fp32", help="precision policy (fp32, bf16, ...)")


def add_generate_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `lwm-jax generate` (implemented in `lwm_jax.generate.cli.generate_main`)."""
    add_model_args(p)
    src = p.add_mutually_exclusive_group()     # neither: only with --load-state (no new text)
    src.add_argument("--prompt", help="prompt text (may be empty or left out with --load-state)")
    src.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits of already seen tokens by this")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logits of already seen tokens")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times the count of each seen token")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--stop-token", type=int, action="append", default=[],
                   help="token id that ends generation (repeatable)")
    p.add_argument("--no-stop-at-eod", action="store_true",
                   help="do not stop at the tokenizer's end-of-document id")
    p.add_argument("--no-echo", action="store_true",
                   help="print only the generated text, not the prompt before it")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per call")
    p.add_argument("--decode-block", type=int, default=16,
                   help="decode steps per compiled call (one host sync each; text is streamed "
                        "in bursts of up to this many tokens)")
    p.add_argument("--load-state",
                   help="start from a state saved with --save-state; with an empty or no "
                        "prompt, continue it without new text (RWKV-7)")
    p.add_argument("--save-state",
                   help="save the final state and its last logits (.safetensors, RWKV-7)")
    return p


def add_eval_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `lwm-jax eval` (implemented in `lwm_jax.eval.cli.eval_main`)."""
    add_model_args(p)
    p.add_argument("--data", help="text file, or binidx prefix / .bin / .idx, for perplexity")
    p.add_argument("--lambada", help="JSONL file of {\"text\": ...} for last-word accuracy")
    p.add_argument("--ctx-len", type=int, default=1024, help="tokens per scoring window")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score only the first N tokens (default: all)")
    p.add_argument("--max-examples", type=int, default=None,
                   help="LAMBADA examples to use (default: all)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="rows per scoring call (--lambada, --tasks)")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks, e.g. lambada_openai,piqa,"
                                   "hellaswag,arc_easy,mmlu (needs pip install 'lwm_jax[eval]')")
    p.add_argument("--num-fewshot", type=int, default=None,
                   help="--tasks: few-shot examples per prompt (default: each task's own)")
    p.add_argument("--limit", type=int, default=None,
                   help="--tasks: only the first N examples of each task (default: all)")
    p.add_argument("--include-path", default=None,
                   help="--tasks: directory of extra lm-eval task YAML files")
    p.add_argument("--allow-task-code", action="store_true",
                   help="--include-path: let its task files run their Python (`!function` "
                        "tags, .py files beside them); without it such a directory is refused")
    p.add_argument("--prefix", default="eod", choices=("eod", "newline", "none"),
                   help="--tasks: tokens before every context: the end-of-document id, the "
                        "tokens of '\\n' (BlinkDL's RWKV evaluations) or none")
    p.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="--tasks: bootstrap resamples for standard errors (0 = skip them)")
    p.add_argument("--output", help="also write the results (the JSON printed) to this file")
    return p


def add_precision_report_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", "-c", default=None, metavar="YAML",
                     help="run config whose model is built at its initialisation and warmed "
                          "(default: the built-in tiny config); KEY=VALUE overrides apply to it")
    src.add_argument("--checkpoint", default=None,
                     help="study a trained model instead: our converted directory, a training "
                          "run directory (its newest step, e.g. runs/tiny after lwm-jax train), "
                          "an official .pth file or an HF directory")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. model.n_layer=2 runtime.chunk_size=16")
    p.add_argument("--format", default=None, choices=FORMATS,
                   help="checkpoint format (default: detected from the path)")
    p.add_argument("--policy", default=None,
                   help="precision policy to examine (default: the config's precision; "
                        "bf16-mixed for a checkpoint)")
    p.add_argument("--shadow", default="fp32",
                   help="reference policy for end-to-end and gradient errors; none = local "
                        "errors only (one run)")
    p.add_argument("--data", default="auto", choices=("auto", "corpus", "random"),
                   help="batch: the embedded byte-level corpus or uniform random tokens; auto = "
                        "corpus for a byte-level model (vocab 256), random otherwise")
    p.add_argument("--batch-size", type=int, default=2, help="sequences in the batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the batch (window or tokens) and of the warming noise; an "
                        "integer in [0, 2**63)")
    p.add_argument("--no-warm", action="store_true",
                   help="study the initialisation as built (zero-initialised projections then "
                        "measure as exact); not with --checkpoint")
    p.add_argument("--no-gradients", action="store_true",
                   help="skip the gradient comparison (saves one compilation per policy)")
    p.add_argument("--fp8-calibration-steps", type=int, default=None, metavar="N",
                   help="FP8 policies: forward + backward steps that calibrate the delayed "
                        "scales before the measurement, each on its own batch drawn like the "
                        "report's (seeds --seed + 1, ...); default 8 from fresh scales, 0 when "
                        "--checkpoint is a training run that saved its FP8 scales")
    p.add_argument("--output", "-o", default="precision_report",
                   help="directory for report.json and heatmap.png")
    return p


REPORT_HELP = "where a precision policy loses accuracy: per-layer, per-op errors and a heat map"
REPORT_DESCRIPTION = (
    "Run one batch through a model under a precision policy and under a shadow policy (default "
    "fp32) in this process; measure every layer's sub-ops (RWKV-7: decay, WKV, ln_x, FFN; "
    "LLaMA: attention, RMSNorm, MLP, RoPE; both: logits, loss) against float64 formulas on "
    "the run's own inputs and against the shadow, and each parameter group's gradient. Prints "
    "a table, writes report.json and heatmap.png, and names the worst offender with the "
    "policy change that would fix it. The model: --checkpoint's as trained; otherwise the "
    "config's initialisation, warmed (its zero-initialised projections and constant norms "
    "drawn at a trained-like scale from --seed, since a zero projection measures as exact in "
    "every precision); every output names the model studied. Under an FP8 policy "
    "(fp8-mixed) the delayed scales are calibrated first (--fp8-calibration-steps, or a "
    "training run's saved scales) and each FP8 GEMM is measured against its e4m3 floor; the "
    "report adds the scale / amax trajectories and flags a GEMM meant to be FP8 that is not.")

# (name, one-line help, module of the entry point, entry point, add-arguments function)
COMMANDS = (
    ("train", "train (or resume) a model", "lwm_jax.train.cli", "train_main", add_train_args),
    ("prepare", "tokenise .txt/.jsonl/.parquet files into a binidx dataset", "lwm_jax.data.prepare",
     "run_prepare", add_prepare_args),
    ("convert", "import an official RWKV-7 .pth, an FLA/HF RWKV-7 or a HF LLaMA checkpoint",
     "lwm_jax.interop.cli", "convert_main", add_convert_args),
    ("export", "export a checkpoint to the official .pth or FLA/HF format",
     "lwm_jax.interop.cli", "export_main", add_export_args),
    ("generate", "sample text from a checkpoint (RWKV-7: RNN state; LLaMA: KV cache)",
     "lwm_jax.generate.cli",
     "generate_main", add_generate_args),
    ("eval", "perplexity / bits-per-byte, LAMBADA-style accuracy, lm-eval tasks",
     "lwm_jax.eval.cli", "eval_main", add_eval_args),
    ("compile", "compile a config's train step for a TPU topology (no TPU needed): per-chip "
     "memory plan, estimate, --save", "lwm_jax.aot.cli", "compile_main", add_compile_args),
    ("precision-report", REPORT_HELP, "lwm_jax.cli.precision_report", "precision_report_main",
     add_precision_report_args),
)
DESCRIPTIONS = {
    "train": "Train a model of any family (RWKV-7, LLaMA-style, hybrid: the config's arch). "
             "With no --config: the tiny byte-level RWKV-7 on the built-in corpus. Rerunning "
             "the same command resumes from the newest checkpoint.",
    "precision-report": REPORT_DESCRIPTION,
}
