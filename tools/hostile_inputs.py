#!/usr/bin/env python3
"""Hostile-input pass over the user-facing surfaces of `lwm-jax` and `python -m tpu_scripts`.

Each case writes hostile files into a directory of its own, runs ONE command there as a
subprocess with a timeout, and is classified:

  clean      the expected exit status (2 bad input, 3 non-finite result, 0 for a valid input,
             130/143 after SIGINT/SIGTERM) and, when refused, exactly one error line on stderr
  unclear    clean, but the line does not name what the case expects (file, field or flag)
  traceback  'Traceback' in the output, or exit 1 `internal error` (the crash path)
  hang       still running at the timeout (then killed)
  code-exec  the case's canary file exists afterwards; payloads only ever create that file
  accepted   exit 0 where the input should have been refused
  other      anything else: another status, extra lines, a valid input refused

Other stderr lines (libraries, warnings) are listed separately. Fixtures (tiny RWKV-7 and LLaMA
checkpoints, a run dir, a state file, a compiled step, a stand-in `gcloud` that runs remote
strings with shell builtins only) are built once, in a temporary directory (see --keep).

    python tools/hostile_inputs.py [--only SURFACE[,SURFACE]] [--jobs 2] [--case SUBSTRING]
                                   [--timeout 120] [--list] [--keep] [--json FILE]

The cases (what runs, with which hostile files, expecting what) are in tools/hostile_cases.py;
this file builds the fixtures, runs the cases and classifies and reports what they did.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv" / "bin"
if Path(sys.prefix).resolve() != VENV.parent.resolve() and not os.environ.get("HOSTILE_REEXEC"):
    os.environ["HOSTILE_REEXEC"] = "1"       # numpy, safetensors, pyarrow, torch: the venv's
    os.execv(str(VENV / "python"), [str(VENV / "python"), __file__, *sys.argv[1:]])

import argparse, concurrent.futures, dataclasses, json, re, shlex, shutil  # noqa: E401,E402
import signal, subprocess, tempfile, threading, time  # noqa: E401,E402

from hostile_cases import CASES, STATUS, TINY, Case, sub  # noqa: E402  (tools/, beside this file)


# ------------------------------------------------------------------------------------ fixtures
FIXTURES = r'''
import json, sys, numpy as np, torch
from pathlib import Path
from safetensors.numpy import save_file
from lwm_jax.interop import hf
from lwm_jax.interop.native import save_native
from lwm_jax.interop.rwkv_pth import write_official
from lwm_jax.interop.testing import random_params
from lwm_jax.models.rwkv7.config import ModelConfig
fx = Path(sys.argv[1])
cfg = ModelConfig(vocab_size=256, n_layer=1, n_embd=64, head_size=32).resolved()
tree = random_params(cfg, seed=1)
hf.write_hf(cfg, tree, fx / "hf")
save_native(cfg, tree, fx / "lwm")
torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in write_official(cfg, tree).items()}, fx / "m.pth")
r = np.random.default_rng(0)
f = lambda *s: (r.standard_normal(s) * 0.05).astype(np.float32)
shapes = {"embed_tokens": (256, 64), "norm": (64,), "layers.0.input_layernorm": (64,), "layers.0.post_attention_layernorm": (64,),
          "layers.0.self_attn.q_proj": (64, 64), "layers.0.self_attn.k_proj": (32, 64), "layers.0.self_attn.v_proj": (32, 64),
          "layers.0.self_attn.o_proj": (64, 64), "layers.0.mlp.gate_proj": (96, 64), "layers.0.mlp.up_proj": (96, 64),
          "layers.0.mlp.down_proj": (64, 96)}
t = {f"model.{k}.weight": f(*v) if len(v) > 1 else np.ones(v, np.float32) for k, v in shapes.items()}
(fx / "llama").mkdir()
save_file({**t, "lm_head.weight": f(256, 64)}, str(fx / "llama/model.safetensors"))
(fx / "llama/config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
    "vocab_size": 256, "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False}))
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
(fx / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(r.choice(words, 60))}) + "\n" for _ in range(200)))
'''
GCLOUD = r'''#!/bin/bash
# stand-in for gcloud: records its arguments, then runs what a worker's shell would run (an ssh
# --command, the remote path of an scp) with nothing on PATH, so only shell builtins run: a
# command injected into one of those strings shows up as the canary file
printf '%q ' "$@" >>"$FAKE_LOG"; echo >>"$FAKE_LOG"
remote() { mkdir -p "$FAKE_HOME"; env -i HOME="$FAKE_HOME" PATH=/nonexistent /bin/bash -c \
  "command_not_found_handle() { return 0; }; cd ~ || exit 0; $1" >/dev/null 2>&1; }
for a in "$@"; do case $a in --command=*) remote "${a#--command=}" ;; esac; done
if [ "$4" = scp ]; then remote "scp -t ${6#*:}"; fi
case " $* " in *" describe "*) echo READY ;; esac
exit 0
'''


def child_env(d: Path, fx: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (
        "LWM_DEBUG", "LWM_JAX_DEBUG", "CLOUDSDK_CORE_PROJECT", "CLOUDSDK_COMPUTE_ZONE", "HOSTILE_REEXEC")}
    return {**env, "TMPDIR": str(d), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),  # tpu_scripts
            "FAKE_LOG": str(d / "gcloud.log"), "FAKE_HOME": str(d / "worker-home"),
            "PATH": f"{fx / 'bin'}{os.pathsep}{env.get('PATH', '')}"}


def build_fixtures(fx: Path) -> None:
    """Every fixture a case may copy; a failure here is a bug of this tool, so it stops."""
    (fx / "bin").mkdir(parents=True)
    (fx / "bin" / "gcloud").write_text(GCLOUD)
    (fx / "bin" / "gcloud").chmod(0o755)
    lwm = str(VENV / "lwm-jax")
    for argv in [[str(VENV / "python"), "-c", FIXTURES, str(fx)],
                 [lwm, "train", "--no-progress", *TINY, f"run_dir={fx}/run"],
                 [lwm, "generate", "--checkpoint", f"{fx}/hf", "--prompt", "hi", "--max-new-tokens", "2",
                  "--save-state", f"{fx}/state.safetensors"],
                 [lwm, "compile", *TINY, "--no-eval", "--save", f"{fx}/step.bin"],
                 [lwm, "prepare", "--quiet", "--input", f"{fx}/docs.jsonl", "--output", f"{fx}/bx"]]:
        done = subprocess.run(argv, cwd=fx, capture_output=True, text=True, env=child_env(fx, fx))
        if done.returncode != 0:
            sys.exit(f"fixture step failed: {shlex.join(argv[:3])} ...\n{done.stderr[-3000:]}")


# -------------------------------------------------------------------------------------- runner
ERROR = re.compile(r"(lwm-jax [\w-]+|python -m tpu_scripts \w+): (error|internal error): ")
PROGRESS = re.compile(r"^\[(eval|generate)\] |\d+%\||/s\]$|^step \d+:|^lwm-jax \w+: (run |step \d|\w+ received)")


@dataclasses.dataclass
class Result:
    case: Case
    cls: str
    rc: int | None
    secs: float
    errors: list            # the error lines (ideally exactly one)
    other: list             # every other line that is not progress: libraries, tracebacks, notices
    argv: str = ""
    where: str = ""         # innermost frames of the traceback (crash log or stderr)


def classify(c: Case, rc, hung, out, err, canary) -> tuple[str, list, list]:
    """The class (module docstring) of one finished command."""
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ERROR.search(ln)]
    other = [ln for ln in lines if not ERROR.search(ln) and not PROGRESS.search(ln)]
    if canary or hung:
        return ("code-exec" if canary else "hang"), errors, other
    if "Traceback (most recent call last)" in out + err or (rc == 1 and "internal error" in err):
        return "traceback", errors, other
    if rc not in STATUS[c.expect]:
        return ("accepted" if rc == 0 else "other"), errors, other
    if rc == 0 or c.sig:
        return "clean", errors, other
    if len(errors) != 1 or not ERROR.match(errors[0]):          # none, several, or glued to a bar
        return "other", errors, other
    return ("unclear" if c.names and not re.search(c.names, errors[0]) else "clean"), errors, other


def run_case(i: int, c: Case, fx: Path, work: Path, timeout: float) -> Result:
    d = work / f"c{i:03d}"             # no case words in the path: `names` must match the message
    d.mkdir()
    t0 = time.time()
    try:
        c.setup and c.setup(d, fx)
    except Exception as err:           # noqa: BLE001 -- a broken case, reported as such
        return Result(c, "tool-error", None, 0.0, [f"setup: {type(err).__name__}: {err}"], [])
    argv = [a for tok in shlex.split(c.argv) for a in (TINY if tok == "%T" else [sub(tok, d, fx)])]
    argv = {"lwm": [str(VENV / "lwm-jax")], "tpu": [str(VENV / "python"), "-m", "tpu_scripts"]}[argv[0]] + argv[1:]
    p = subprocess.Popen(argv, cwd=d, env=child_env(d, fx), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0)
    timer = threading.Timer(c.sig[1], p.send_signal, (c.sig[0],)) if c.sig else None
    timer and timer.start()
    try:
        out, err, hung = *p.communicate(timeout=c.timeout or timeout), False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)          # the command's own process group only
        out, err, hung = *p.communicate(), True
    timer and timer.cancel()
    short = lambda b: b.decode(errors="replace").replace(str(d), "$D").replace(str(fx), "$FX")  # noqa: E731
    out, err = short(out), short(err)
    cls, errors, other = classify(c, p.returncode, hung, out, err, (d / "CANARY").exists())
    log = re.search(r"full traceback in (\S+?);", err)
    log = Path(log.group(1).replace("$D", str(d))) if log else None
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', log.read_text() if log and log.exists() else err)
    where = " <- ".join(f"{Path(f).name}:{n}:{fn}" for f, n, fn in reversed(frames[-3:]))
    shown = short(shlex.join(argv).encode("utf-8", "surrogateescape")).replace(str(VENV) + "/", "")
    return Result(c, cls, p.returncode, time.time() - t0, errors, other, shown, where)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated surfaces (see --list)")
    ap.add_argument("--case", help="only the cases whose name contains this text")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per case (default 120)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    cases = [c for c in CASES if (not args.only or c.surface in args.only.split(",")) and (args.case or "") in c.name]
    if args.list:
        print("\n".join(f"{c.surface:<12} {c.expect:<8} {c.name}" for c in cases) + f"\n{len(cases)} cases")
        return 0
    start, work = time.time(), Path(tempfile.mkdtemp(prefix="hostile-inputs-"))
    print(f"building fixtures in {work}/fx ...", flush=True)
    build_fixtures(work / "fx")
    print(f"fixtures built in {time.time() - start:.0f} s; {len(cases)} cases, {args.jobs} at a time", flush=True)
    results = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        jobs = {pool.submit(run_case, i, c, work / "fx", work, args.timeout): c for i, c in enumerate(cases)}
        for job in concurrent.futures.as_completed(jobs):
            try:
                r = job.result()
            except Exception as err:   # noqa: BLE001 -- a bug of this tool in one case; the others go on
                r = Result(jobs[job], "tool-error", None, 0.0, [f"{type(err).__name__}: {err}"], [])
            results.append(r)
            print(f"{r.cls:<10} {r.case.surface:<11} {r.case.name[:44]:<44} {str(r.rc):>4} {r.secs:5.1f}s  "
                  f"{(r.errors or r.other or [''])[-1][:110]}", flush=True)
    order = ["code-exec", "traceback", "hang", "accepted", "other", "unclear", "tool-error"]
    counts = {k: sum(r.cls == k for r in results) for k in ["clean", *order]}
    print("\n== totals: " + ", ".join(f"{k} {n}" for k, n in counts.items() if n or k == "clean")
          + f"; {len(results)} cases, {time.time() - start:.0f} s in all\n\n== not clean")
    for r in sorted(results, key=lambda r: (order.index(r.cls) if r.cls in order else 9, r.case.surface, r.case.name)):
        if r.cls != "clean":
            print(f"[{r.cls}] {r.case.surface} / {r.case.name}  (exit {r.rc}; expected {r.case.expect}"
                  f"{'; should name /' + r.case.names + '/' if r.case.names else ''})\n    argv: {r.argv[:500]}")
            print("".join(f"    stderr: {ln[:500]}\n" for ln in (r.other[-3:] + r.errors)[-5:]), end="")
            print(f"    where: {r.where}" if r.where else "", end="\n" if r.where else "")
    print("\n== other stderr lines of clean cases (libraries, notices; not error lines)")
    for r in results:
        if r.cls == "clean" and r.other:
            print(f"  {r.case.name}: " + " | ".join(sorted({x.strip()[:100] for x in r.other})[:3]))
    if args.json:
        Path(args.json).write_text(json.dumps([{"name": r.case.name, "surface": r.case.surface, "class": r.cls, "rc": r.rc,
                                                "secs": round(r.secs, 1), "argv": r.argv, "errors": r.errors,
                                                "other": r.other[-20:], "where": r.where} for r in results], indent=1))
    print(f"\nkept {work}" if args.keep else "", end="\n" if args.keep else "")
    args.keep or shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.cls == "clean" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
