"""The cases of the hostile-input pass that `tools/hostile_inputs.py` runs: a table per surface
of `lwm-jax` or `python -m tpu_scripts` (config, data, checkpoints, generate, eval, tasks,
compile, tpu, signals, ...), a `Case` per row: the command, the hostile files its `setup` writes
first, the exit status expected and what the error line must name.

A `setup` is built from the small step makers below (`W` writes a file, `FIFO` makes one, `CP`
copies a fixture, `CUT` truncates a file, `HF` / `ST` / `PTH` alter a fixture checkpoint, ...).
Payloads only ever create the case's canary file (`TOUCH`). Not a script: run hostile_inputs.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import struct
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TINY = ("model.n_layer=1 model.n_embd=64 model.head_size=32 train.steps=2 train.batch_size=2 "
        "train.ctx_len=16 train.warmup_steps=0 train.eval_every=0 train.eval_batches=1 "
        "checkpoint.every=0 logging.trackers=[jsonl]").split()
LLAMA = (f"--config {ROOT}/configs/llama-tiny.yaml model.n_head=4 model.n_kv_head=2 model.head_dim=16 "
         "model.ffn_hidden=96 model.max_seq_len=64 " + " ".join(a for a in TINY if "head_size" not in a))
BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{p}'] * 9 if p else ['lol'] * 9)}]\n"
               for p, a in zip([None, *"abcdefgh"], "abcdefghi"))          # 9^9 values
STATUS = {"refuse": {2}, "nonfinite": {3}, "ok": {0}, "any": {0, 2}, "sigint": {130}, "sigterm": {143}}
TOUCH = "open('%C', 'w').write('x')"          # the one thing every payload does
P = "--project hostile-proj --zone us-central2-b"


@dataclasses.dataclass
class Case:
    """One command run on hostile input, and what it should do (`STATUS[expect]`, `names`)."""

    name: str
    surface: str
    argv: str                  # shlex text: %D case dir, %F fixtures, %C canary, %T the TINY overrides
    setup: object = None       # callable(d, fx) writing the hostile files
    expect: str = "refuse"     # a STATUS key
    names: str | None = None   # regex the error line must match (with the case dir shown as $D)
    timeout: float | None = None
    sig: tuple | None = None   # (signal, seconds): sent that long after the start


CASES: list[Case] = []


def table(surface, base, rows):
    """Cases `(name, argv tail, setup, names[, expect])` after the argv head `base`; FIFO cases get
    45 s (a refusal takes seconds, a blocked open forever)."""
    for name, tail, setup, names, *expect in rows:
        CASES.append(Case(name, surface, f"{base} {tail}".strip(), setup,
                          expect[0] if expect else "refuse", names, 45 if "FIFO" in name else None))


# ------------------------------------------------------------------------------ setup helpers
# Each helper returns a step `(case dir d, fixtures fx) -> None` that writes some of a case's files.
def sub(text, d, fx):
    return text.replace("%D", str(d)).replace("%F", str(fx)).replace("%C", str(d / "CANARY"))


def W(rel, data):                  # bytes as given; text with %D, %F and %C filled in
    def run(d, fx):
        p = d / sub(rel, d, fx)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else sub(data, d, fx).encode("utf-8", "surrogateescape"))
    return run


# one-liners (noqa E731: a table of small step makers reads best as one)
S = lambda *steps: lambda d, fx: [s(d, fx) for s in steps if s]  # noqa: E731
JL = lambda rel, *objs: W(rel, "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))  # noqa: E731
FIFO = lambda rel: lambda d, fx: (d / rel).parent.mkdir(parents=True, exist_ok=True) or os.mkfifo(d / rel)  # noqa: E731
CP = lambda src, rel: lambda d, fx: (shutil.copytree if (fx / src).is_dir() else shutil.copy2)(fx / src, d / rel)  # noqa: E731
EDIT = lambda rel, fn: lambda d, fx: fn(d / rel)  # noqa: E731
CUT = lambda rel, frac=0.5: EDIT(rel, lambda p: os.truncate(p, int(p.stat().st_size * frac)))  # noqa: E731
RUN = lambda *steps: S(CP("run", "run"), *steps)  # noqa: E731
BINIDX = lambda rel, docs: lambda d, fx: __import__("lwm_jax.data.binidx").data.binidx.write_binidx(  # noqa: E731
    d / rel, docs, dtype=np.uint16)


def HF(src="hf", cfg=None, sd=None, extra=None):
    """Fixture `src` copied to %D/m, `cfg` merged into its config.json, `sd(tensors)` applied to
    its model.safetensors, then `extra`."""
    def run(d, fx):
        from safetensors.numpy import load_file, save_file
        shutil.copytree(fx / src, d / "m")
        if cfg is not None:
            (d / "m/config.json").write_text(json.dumps({**json.loads((d / "m/config.json").read_text()), **cfg}))
        if sd is not None:
            t = load_file(str(d / "m/model.safetensors"))
            sd(t)
            save_file(t, str(d / "m/model.safetensors"))
        extra and extra(d, fx)
    return run


def RAWST(rel, header, body=b"", hlen=None):     # safetensors written byte by byte
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return W(rel, struct.pack("<Q", len(h) if hlen is None else hlen) + h + body)


def ST(meta=None, t=None):         # %D/s.safetensors: the fixture state with metadata / tensors changed
    def run(d, fx):
        from safetensors import safe_open
        from safetensors.numpy import save_file
        with safe_open(str(fx / "state.safetensors"), "np") as f:
            m, a = {**f.metadata(), **(meta or {})}, {k: f.get_tensor(k) for k in f.keys()}
        t and t(a)
        save_file(a, str(d / "s.safetensors"), metadata=m)
    return run


def PQ(rel, col):
    def run(d, fx):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": col(pa) if callable(col) else col}), d / rel)
    return run


@dataclasses.dataclass
class Exec:                        # unpickling it calls fn(code): exec, or numpy's exec wrapper runstring
    code: str
    fn: object = exec

    def __reduce__(self):
        return (self.fn, (self.code,) if self.fn is exec else (self.code, {}))


def PTH(make, legacy=False):       # torch.save(make(d, fx, torch)) as %D/m.pth
    def run(d, fx):
        import torch
        torch.save(make(d, fx, torch), d / "m.pth", _use_new_zipfile_serialization=not legacy)
    return run


def PTH_EDIT(fn):                  # the fixture .pth with its state dict changed by fn(sd, torch)
    return PTH(lambda d, fx, torch: [sd := torch.load(fx / "m.pth", weights_only=True), fn(sd, torch), sd][2])


def EVIL_STEP(d, fx):
    """fx/step.bin with a payload that calls numpy's `runstring` when unpickled; its header
    (config, devices, versions, program, checksum) still matches this run."""
    from numpy.testing._private.utils import runstring
    data = (fx / "step.bin").read_bytes()
    start = data.find(b"\n") + 1
    end = data.find(b"\n", start)
    header, payload = json.loads(data[start:end]), pickle.dumps(Exec(sub(TOUCH, d, fx), runstring))
    header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    (d / "evil.bin").write_bytes(data[:start] + json.dumps(header).encode() + b"\n" + payload)


TASK = ("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: %D/q.jsonl\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_target: '{{a}}'\n")


def TASKS(extra="doc_to_text: '{{q}}'\n", *more, head=""):    # %D/tasks/t.yaml (task t) and its data
    return S(JL("q.jsonl", {"q": "the cat", "a": " sat"}, {"q": "a dog", "a": " ran"}),
             W("tasks/t.yaml", head + TASK + extra), *more)


# --------------------------------------------------------------------------------------- cases
TRAIN = "lwm train --no-progress %T run_dir=%D/run"
FIFO_NAMES = "FIFO|regular file"           # a FIFO reported as "not found" is a misleading line
OVERRIDES = ["train.lr=nan", "model.decay_lora=0", "run_dir=%D/f", 'train.lr=!!python/object/apply:os.system ["touch %C"]',
             "train.lr=!!python/name:os.system", "data.path=%D/caf\udce9.jsonl", "checkpoint.dir=foo://bucket/ckpt",
             "run_dir=gs://bucket/run", "train.lr=" + BOMB]
table("config", TRAIN, [(f"override {ov[:40]!r}", shlex.quote(ov), W("f", "x"), re.escape(ov.split("=")[0]))
                        for ov in OVERRIDES] + [("override without '='", "train.lr", None, "override")])
table("config", f"lwm train {LLAMA} run_dir=%D/run", [(f"llama override {ov}", shlex.quote(ov), None, r"model\.|ctx_len")
                                                      for ov in ["model.n_kv_head=3", "model.rope_scaling={kind: yarn}",
                                                                 "model.rope_theta=.nan", "model.max_seq_len=8"]])
table("config-file", f"{TRAIN} --config %D/c.yaml", [
    ("config malformed", "", W("c.yaml", "train: [unclosed\n"), "c.yaml"),
    ("config !!python/object/apply", "", W("c.yaml", "train: {lr: !!python/object/apply:os.system ['touch %C']}\n"), "c.yaml"),
    ("config !!python/object/new exec", "", W("c.yaml", f'name: !!python/object/new:builtins.exec ["{TOUCH}"]\n'), "c.yaml"),
    ("config billion laughs", "", W("c.yaml", BOMB), "c.yaml"),
    ("config non-UTF-8 bytes", "", W("c.yaml", b"name: caf\xe9\n"), "c.yaml"),
    ("config is a FIFO", "", FIFO("c.yaml"), FIFO_NAMES)])

table("run-dir", f"{TRAIN} train.steps=3", [
    ("run config.yaml garbage", "", RUN(W("run/config.yaml", "model: [x\n")), "config.yaml"),
    ("run metrics.jsonl symlink", "", RUN(EDIT("run/metrics.jsonl", os.unlink), lambda d, fx: os.symlink(d / "x", d / "run/metrics.jsonl")), "metrics.jsonl"),
    ("run metrics.jsonl torn + record without loss", "", RUN(EDIT("run/metrics.jsonl", lambda p: p.open("a").write('{"step": 1}\n{"step": 2, "lo'))), None, "ok"),
    ("run metrics.jsonl is a FIFO", "", RUN(EDIT("run/metrics.jsonl", os.unlink), FIFO("run/metrics.jsonl")), "metrics.jsonl"),
    ("run step dir named ²", "", RUN(CP("run/checkpoints/2", "run/checkpoints/²")), "checkpoint", "any"),
    ("run step state/_METADATA garbage", "", RUN(W("run/checkpoints/2/state/_METADATA", "[1")), "_METADATA"),
    ("run step 99999999999999999999", "", RUN(CP("run/checkpoints/2", "run/checkpoints/99999999999999999999")), "checkpoint", "any"),
    ("run resumed with another model", "model.n_embd=128", RUN(), "model")])

TXT = "alpha beta gamma delta " * 30
DOCS = JL("a.jsonl", *[{"text": f"alpha {i} " * 40} for i in range(40)])
MIX = "data.sources=[%D/a.jsonl,%D/b.jsonl]"
table("data", TRAIN, [
    ("data jsonl bad line", "data.path=%D/a.jsonl", JL("a.jsonl", {"text": TXT}, "{not json"), "a.jsonl"),
    ("data jsonl text is a number", "data.path=%D/a.jsonl", JL("a.jsonl", {"text": 5}), "a.jsonl"),
    ("data jsonl lone surrogate", "data.path=%D/a.jsonl data.val_fraction=0", W("a.jsonl", '{"text": "\\ud800 ' + TXT + '"}\n'), "a.jsonl"),
    ("data jsonl is a FIFO", "data.path=%D/a.jsonl", FIFO("a.jsonl"), FIFO_NAMES),
    ("data jsonl one 30 MB line", "data.path=%D/a.jsonl data.val_fraction=0", JL("a.jsonl", {"text": "x" * 30_000_000}), None, "ok"),
    ("data parquet corrupt", "data.path=%D/a.parquet", W("a.parquet", b"PAR1" + bytes(range(256)) + b"PAR1"), "a.parquet"),
    ("data parquet dictionary strings", "data.path=%D/a.parquet data.val_fraction=0", PQ("a.parquet", lambda pa: pa.array([TXT] * 9).dictionary_encode()), None, "ok"),
    ("data hf unknown dataset", "data.path=hf:hostile-nobody/no-such-dataset", None, "data.path"),
    ("data binidx ids beyond vocab", "data.path=%D/b data.val_fraction=0", BINIDX("b", [[60000] * 200] * 8), "vocab"),
    ("mixture negative weight", f"{MIX} data.weights=[1,-1]", S(DOCS, JL("b.jsonl", {"text": TXT})), "weights"),
    ("mixture weight 1e-300", f"{MIX} data.weights=[1,1e-300]", S(DOCS, JL("b.jsonl", {"text": TXT})), "weights"),
    ("mixture source all blank", f"{MIX} data.val_fraction=0", S(DOCS, W("b.jsonl", "\n\n")), "b.jsonl"),
    ("mixture source missing", MIX, DOCS, "b.jsonl")])

table("prepare", "lwm prepare --quiet --output %D/out/p --input", [
    ("prepare jsonl bad line", "%D/a.jsonl", JL("a.jsonl", {"text": "x"}, "{oops"), r"a\.jsonl:2"),
    ("prepare jsonl lone surrogate", "%D/a.jsonl", W("a.jsonl", '{"text": "\\udcff x"}\n'), "a.jsonl"),
    ("prepare parquet truncated", "%D/a.parquet", S(PQ("a.parquet", ["x" * 999] * 50), CUT("a.parquet")), "a.parquet"),
    ("prepare parquet dictionary strings", "%D/a.parquet", PQ("a.parquet", lambda pa: pa.array(["x", "y"]).dictionary_encode()), None, "ok"),
    ("prepare input is a FIFO", "%D/a.txt", FIFO("a.txt"), FIFO_NAMES),
    ("prepare non-UTF-8 file name", "%D/caf\udce9.txt", W("caf\udce9.txt", "hello"), None, "ok"),
    ("prepare --eod-token with byte", "%D/a.txt --eod-token '</s>'", W("a.txt", "hi"), "eod"),
    ("prepare world vocab huge id", "%D/a.txt --tokenizer world:%D/v.txt", S(W("a.txt", "hi"), W("v.txt", "".join(
        f"{i + 1} {bytes([i])!r} 1\n" for i in range(256)) + "1000000000000000 'zz' 2\n")), "v.txt"),
    ("prepare world vocab code line", "%D/a.txt --tokenizer world:%D/v.txt", S(W("a.txt", "hi"), W("v.txt", "1 __import__('os') 1\n")), "v.txt")])

table("hf", "lwm convert --input %D/m --output %D/o", [
    ("hf config.json NaN", "", HF(cfg={"norm_eps": float("nan")}), "norm_eps"),
    ("hf config.json deep nesting", "", HF(extra=W("m/config.json", "[" * 100000 + "]" * 100000)), "config.json"),
    ("hf config.json FIFO", "", HF(extra=S(EDIT("m/config.json", os.unlink), FIFO("m/config.json"))), FIFO_NAMES),
    ("hf safetensors truncated", "", HF(extra=CUT("m/model.safetensors")), "model.safetensors"),
    ("hf safetensors offsets past end", "", HF(extra=RAWST("m/model.safetensors", {"x": {
        "dtype": "F32", "shape": [1000000], "data_offsets": [0, 4000000]}}, bytes(64))), "model.safetensors"),
    ("hf tensor int32 dtype", "", HF(sd=lambda t: t.update({"model.embeddings.weight": np.ones((256, 64), np.int32)})), "embeddings"),
    ("hf tensor bool dtype", "", HF(sd=lambda t: t.update({"model.norm.weight": np.ones(64, bool)})), "norm"),
    ("hf tensor 0-d", "", HF(sd=lambda t: t.update({"model.layers.0.ffn.key.weight": np.array(1, np.float32)})), "ffn.key"),
    ("hf embeddings 1-D", "", HF(sd=lambda t: t.update({"model.embeddings.weight": np.ones(64, np.float32)})), "embeddings"),
    ("hf index path traversal", "", HF(extra=W("m/model.safetensors.index.json", '{"weight_map": {"a": "../x.safetensors"}}')), "index"),
    ("hf auto_map + modeling code", "", HF(cfg={"auto_map": {"AutoModelForCausalLM": "modeling_evil.M"}},
                                           extra=W("m/modeling_evil.py", TOUCH + "\n")), None, "ok")])

table("llama", "lwm convert --input %D/m --output %D/o", [(name, "", HF("llama", cfg, sd), names, *exp) for name, cfg, sd, names, *exp in [
    ("llama rope type yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, None, "config.json"),
    ("llama heads 0", {"num_attention_heads": 0}, None, "num_attention_heads"),
    ("llama rope_parameters theta NaN", {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, None, "config.json"),
    ("llama rope_theta negative", {"rope_theta": -5.0}, None, "config.json"),
    ("llama3 scaling missing field", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, None, "config.json"),
    ("llama linear factor -2", {"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, None, "config.json"),
    ("llama rms_norm_eps -1", {"rms_norm_eps": -1.0}, None, "config.json"),
    ("llama max_position_embeddings 0", {"max_position_embeddings": 0}, None, "config.json"),
    ("llama q_proj 0-d", None, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.array(1, np.float32)}), "q_proj"),
    ("llama layer gap", None, lambda t: t.update({k.replace("layers.0.", "layers.2."): t.pop(k) for k in [k for k in t if ".layers.0." in k]}), "layer"),
    ("llama int64 weights", None, lambda t: t.update({"model.norm.weight": np.ones(64, np.int64)}), "norm"),
    ("llama auto_map (no code is run)", {"auto_map": {"AutoModelForCausalLM": "modeling_evil.M"}}, None, None, "ok")]])
table("llama", "lwm", [
    ("llama generate --save-state", "generate --checkpoint %F/llama --prompt hi --max-new-tokens 2 --save-state %D/s.st", None, "--save-state"),
    ("llama eval --lambada no space", "eval --checkpoint %F/llama --lambada %D/l.jsonl", JL("l.jsonl", {"text": "nospace"}), "l.jsonl")])

table("pth", "lwm convert --input %D/m.pth --output %D/o", [
    ("pth exec payload (zip)", "", PTH(lambda d, fx, torch: Exec(sub(TOUCH, d, fx))), "m.pth"),
    ("pth exec payload (legacy)", "", PTH(lambda d, fx, torch: {"emb.weight": Exec(sub(TOUCH, d, fx))}, legacy=True), "m.pth"),
    ("pth plain pickle payload", "", lambda d, fx: (d / "m.pth").write_bytes(pickle.dumps(Exec(sub(TOUCH, d, fx)))), "m.pth"),
    ("pth truncated", "", S(CP("m.pth", "m.pth"), CUT("m.pth")), "m.pth"),
    ("pth is a FIFO", "", FIFO("m.pth"), FIFO_NAMES),
    ("pth int64 weights", "", PTH_EDIT(lambda sd, torch: sd.update({"ln_out.weight": sd["ln_out.weight"].long()})), "ln_out"),
    ("pth emb wrong shape", "", PTH_EDIT(lambda sd, torch: sd.update({"emb.weight": torch.zeros(3)})), "emb")])

table("lwm", "lwm generate --checkpoint %D/m --prompt hi --max-new-tokens 2", [
    ("lwm config.yaml !!python tag", "", S(CP("lwm", "m"), W("m/config.yaml", "model: !!python/object/apply:os.system ['touch %C']\n")), "config.yaml"),
    ("lwm config.yaml n_layer mismatch", "", S(CP("lwm", "m"), EDIT("m/config.yaml", lambda p: p.write_text(p.read_text().replace("n_layer: 1", "n_layer: 2")))), "checkpoint"),
    ("lwm manifest.ocdbt truncated", "", S(CP("lwm", "m"), CUT("m/params/manifest.ocdbt", 0.3)), "manifest"),
    ("lwm array data zeroed", "", S(CP("lwm", "m"), EDIT("m/params/d", lambda p: [f.write_bytes(bytes(f.stat().st_size)) for f in p.iterdir()])), "checkpoint")])
table("run-read", "lwm generate --checkpoint %D/run --prompt hi --max-new-tokens 2", [
    ("run read step dir named ²", "", RUN(CP("run/checkpoints/2", "run/checkpoints/²")), "checkpoint", "any"),
    ("run read _METADATA garbage", "", RUN(W("run/checkpoints/2/state/_METADATA", "nope")), "_METADATA"),
    ("run read model section mismatch", "", RUN(EDIT("run/config.yaml", lambda p: p.write_text(p.read_text().replace("n_embd: 64", "n_embd: 128")))), "checkpoint")])

table("generate", "lwm generate --checkpoint %F/hf --max-new-tokens 2", [(n, t, S(FIFO("fifo"), W("bad.txt", b"\xff\xfe")), names) for n, t, names in [
    ("generate --checkpoint missing", "--checkpoint %D/nosuch --prompt hi", "nosuch"),
    ("generate --checkpoint FIFO", "--checkpoint %D/fifo --prompt hi", FIFO_NAMES),
    ("generate --prompt-file FIFO", "--prompt-file %D/fifo", "prompt-file"),
    ("generate --prompt-file not UTF-8", "--prompt-file %D/bad.txt", "prompt-file"),
    ("generate --prompt not UTF-8", "--prompt caf\udce9", "prompt"),
    ("generate --tokenizer hf: not JSON", "--prompt hi --tokenizer hf:%D/bad.txt", "bad.txt"),
    ("generate --save-state FIFO", "--prompt hi --save-state %D/fifo", "save-state"),
    ("generate Hub name offline", "--prompt hi --checkpoint hostile-nobody/no-model", "checkpoint")]])

table("state", "lwm generate --checkpoint %F/hf --max-new-tokens 2 --load-state %D/s.safetensors --prompt", [
    ("state garbage", "hi", W("s.safetensors", bytes(range(200))), "s.safetensors"),
    ("state n_layer '²'", "hi", ST({"n_layer": "²"}), "n_layer"),
    ("state wkv wrong shape", "hi", ST(t=lambda a: a.update({"wkv": a["wkv"][..., :3]})), "wkv"),
    ("state NaN tmix_shift", "hi", ST(t=lambda a: a["tmix_shift"].__setitem__((0, 0, 0), np.nan)), "tmix_shift"),
    ("state int32 cmix_shift", "hi", ST(t=lambda a: a.update({"cmix_shift": a["cmix_shift"].astype(np.int32)})), "cmix_shift"),
    ("state zero rows", "hi", ST(t=lambda a: a.update({k: v[:, :0] if v.ndim > 2 else v[:0] for k, v in a.items()})), "s.safetensors"),
    ("state is a FIFO", "hi", FIFO("s.safetensors"), FIFO_NAMES),
    ("state format 1 + empty prompt", "''", ST({"format": "lwm_jax-rwkv7-state/1"}, lambda a: a.pop("logits")), "load-state"),
    ("state n_tokens garbage", "hi", ST({"n_tokens": "x,,-1"}), None, "ok")])

E = "lwm eval --checkpoint %F/hf --ctx-len 16"
table("eval", E, [
    ("eval --data ids beyond vocab", "--data %D/b", BINIDX("b", [[60000] * 50]), "vocab|b"),
    ("eval --data FIFO", "--data %D/a.txt", FIFO("a.txt"), FIFO_NAMES),
    ("eval --lambada FIFO", "--lambada %D/l.jsonl", FIFO("l.jsonl"), FIFO_NAMES),
    ("eval --lambada no space", "--lambada %D/l.jsonl", JL("l.jsonl", {"text": "a b"}, {"text": "nospace"}), "l.jsonl"),
    ("eval --lambada lone surrogate", "--lambada %D/l.jsonl", W("l.jsonl", '{"text": "a \\udc80b"}\n'), "l.jsonl"),
    ("eval --lambada blank only", "--lambada %D/l.jsonl", W("l.jsonl", "\n \n"), "l.jsonl"),
    ("eval logits overflow to NaN", "--data %D/a.txt --checkpoint %D/m", S(W("a.txt", "hello there"), HF(sd=lambda t: t.update(
        {"lm_head.weight": np.where(np.arange(256)[:, None] % 2, 3e38, -3e38).repeat(64, 1).astype(np.float32)}))), "NaN", "nonfinite"),
    ("eval --ctx-len 2**40", "--data %D/a.txt --ctx-len 1099511627776", W("a.txt", "hello"), "ctx", "any")])

table("tasks", f"{E} --limit 2 --bootstrap-iters 0 --tasks t --include-path %D/tasks", [
    ("tasks !function beside the YAML", "", TASKS("doc_to_text: !function utils.f\n", W("tasks/utils.py", TOUCH + "\n")), "--include-path"),
    ("tasks !function in an include outside", "", TASKS("include: %D/out/base.yaml\n", W("out/base.yaml", "doc_to_text: !function evil.f\n"),
                                                         W("out/evil.py", TOUCH + "\n")), "base.yaml"),
    ("tasks !!python tag", "", TASKS("x: !!python/object/apply:os.system ['touch %C']\ndoc_to_text: '{{q}}'\n"), "--include-path"),
    ("tasks python tag via %TAG", "", TASKS("x: !p!object/apply:os.system ['touch %C']\ndoc_to_text: '{{q}}'\n",
                                            head="%TAG !p! tag:yaml.org,2002:python/\n---\n"), "--include-path"),
    ("tasks jinja cycler globals", "", TASKS("doc_to_text: \"{{ cycler.__init__.__globals__.os.popen('touch %C').read() }}\"\n"), "--include-path"),
    ("tasks jinja attr filter", "", TASKS("doc_to_text: \"{{ (cycler|attr('__init__')|attr('__globals__'))['os'].system('touch %C') }}\"\n"), "--include-path"),
    ("tasks jinja subscript dunder", "", TASKS("doc_to_text: \"{{ lipsum['__globals__']['os'].system('touch %C') }}\"\n"), "--include-path"),
    ("tasks metric names a local script", "", TASKS("doc_to_text: '{{q}}'\nmetric_list:\n  - metric: %D/outside/evilmetric\n"
                                                    "    aggregation: mean\n    higher_is_better: true\n",
                                                    W("outside/evilmetric/evilmetric.py", "import evaluate\n" + TOUCH + "\n")), "metric|--include-path"),
    ("tasks FIFO task file", "", TASKS("doc_to_text: '{{q}}'\n", FIFO("tasks/u.yaml")), "u.yaml"),
    ("tasks data_files FIFO", "", TASKS("doc_to_text: '{{q}}'\n", EDIT("q.jsonl", os.unlink), FIFO("q.jsonl")), "q.jsonl"),
    ("tasks malformed YAML", "", TASKS("doc_to_text: [unclosed\n"), "t.yaml"),
    ("tasks include cycle", "", TASKS("include: u.yaml\n", W("tasks/u.yaml", "include: t.yaml\n")), "yaml"),
    ("tasks template names a missing field", "", TASKS("doc_to_text: '{{ question }}'\n"), "t.yaml|question|template"),
    ("tasks output_type bogus", "", S(TASKS(), EDIT("tasks/t.yaml", lambda p: p.write_text(p.read_text().replace("loglikelihood", "bogus")))), "output_type"),
    ("tasks --num-fewshot beyond the data", "--num-fewshot 5", TASKS(), "fewshot"),
    ("tasks unknown task name", "--tasks no_such_task_xyz", TASKS(), "--tasks")])

table("compile", "lwm compile %T --no-eval", [(f"compile {t}", t, W("f", "x"), n) for t, n in [
    ("--topology v4-7", "--topology"), ("--topology v4:0x2x2", "--topology"), ("--topology 'v4-8;touch %C'", "--topology"),
    ("--topology v4:4096x4096x4096", "--topology"), ("--topology v5p:4x4", "--topology"),
    ("--topology v4-8 --num-slices 0", "--num-slices"), ("--topology v4-8 --num-slices 4294967296", "--num-slices"),
    ("--save %D", "--save"), ("--save %D/f/x", "--save")]])
table("compiled", TRAIN, [
    ("compiled garbage", "--compiled %D/s.bin", W("s.bin", bytes(range(256))), "--compiled"),
    ("compiled FIFO", "--compiled %D/s.bin", FIFO("s.bin"), "--compiled"),
    ("compiled header damaged", "--compiled %D/s.bin", W("s.bin", b"LWM-JAX-COMPILED-STEP 1\n{oops\n" + bytes(99)), "--compiled"),
    ("compiled payload byte flipped", "--compiled %D/step.bin", S(CP("step.bin", "step.bin"),
                                                                  EDIT("step.bin", lambda p: p.write_bytes(p.read_bytes()[:-1] + b"\1"))), "--compiled"),
    ("compiled numpy-exec payload", "--compiled %D/evil.bin", EVIL_STEP, "--compiled"),
    ("compiled for another config", "model.n_embd=128 --compiled %F/step.bin", None, "--compiled")])

table("report", "lwm precision-report --output %D/rep", [(f"report {t}", t, S(W("c.yaml", "model: [x\n"), W("f", "x"), FIFO("fifo")), n) for t, n in [
    ("--seq-len 0", "--seq-len"), ("--batch-size 100000 --seq-len 100000", "--batch-size"), ("--policy bogus", "--policy"),
    ("--checkpoint %F/hf model.n_layer=1", "model.n_layer|overrides"), ("--checkpoint %F/hf --no-warm", "--no-warm"),
    ("--config %D/c.yaml", "c.yaml"), ("--data corpus model.vocab_size=65536", "corpus"), ("--checkpoint %D/fifo", FIFO_NAMES),
    ("--output %D/f", "--output")]])

CFG = W("c.yaml", (ROOT / "configs" / "tiny.yaml").read_text())
L = f"launch tpu1 {P} --config %D/c.yaml"
table("tpu", "tpu", [
    ("tpu bad TPU name", f"create Bad_Name {P} --accelerator-type v4-8 --dry-run", None, "TPU|name"),
    ("tpu --project injection", "create tpu1 --project 'x;touch %C' --zone us-central2-b --accelerator-type v4-8", None, "project"),
    ("tpu --config with $()", f"launch tpu1 {P} --config '%D/x$(touch${{IFS}}y).yaml' --dry-run", W("x$(touch${IFS}y).yaml", "name: x\n"), "--config"),
    ("tpu --config=-x.yaml", f"launch tpu1 {P} --config=-x.yaml --dry-run", W("-x.yaml", "name: x\n"), "--config"),
    ("tpu --env value injection", f"{L} --no-libtpu-flags --env 'A=$(echo pwned >%C)'", CFG, None, "ok"),
    ("tpu --set value injection", f"{L} --no-libtpu-flags --set 'data.text_key=x$(echo pwned >%C)'", CFG, None, "ok"),
    ("tpu --job injection", f"{L} --job 'x;touch %C' --dry-run", CFG, "--job"),
    ("tpu --set run_dir URL", f"{L} --set run_dir=gs://b/r --dry-run", CFG, "run_dir"),
    ("tpu multi-host local checkpoint", f"{L} --accelerator-type v4-32 --dry-run", CFG, "checkpoint.dir"),
    ("tpu --flags-file FIFO", f"{L} --flags-file %D/flags --dry-run", S(CFG, FIFO("flags")), "flags"),
    ("tpu --flags-file bad line", f"{L} --flags-file %D/flags --dry-run", S(CFG, W("flags", "--xla_x=1; touch %C\n")), "flags"),
    ("tpu --compiled FIFO", f"{L} --compiled %D/s.bin --dry-run", S(CFG, FIFO("s.bin")), FIFO_NAMES),
    ("tpu --compiled garbage", f"{L} --compiled %D/s.bin --dry-run", S(CFG, W("s.bin", bytes(99))), "--compiled"),
    ("tpu babysit local checkpoint", f"babysit tpu1 {P} --accelerator-type v4-8 --config %D/c.yaml --dry-run", CFG, "checkpoint.dir"),
    ("tpu setup --data injection", f"setup tpu1 {P} --data 'gs://bucket/a$(echo${{IFS}}pwned>%C)'", None, None, "ok"),
    ("tpu setup --python injection", f"setup tpu1 {P} --python '3.12;touch %C' --dry-run", None, "--python"),
    ("tpu setup --ref option", f"setup tpu1 {P} --ref=--output=%D/x --dry-run", None, "--ref"),
    ("tpu logs --worker injection", f"logs tpu1 {P} --job j --worker '0;touch %C'", None, "--worker"),
    ("tpu logs --output-dir option", f"logs tpu1 {P} --job j --output-dir=-rf --dry-run", None, "--output-dir")])

LONG = f"{TRAIN} train.steps=100000"
CASES += [Case("SIGINT during train", "signals", LONG, expect="sigint", sig=(signal.SIGINT, 15)),
          Case("SIGTERM during train", "signals", LONG, expect="sigterm", sig=(signal.SIGTERM, 15)),
          Case("SIGTERM during eval", "signals", f"{E} --data %D/a.txt", W("a.txt", "hello world " * 200000), expect="sigterm",
               sig=(signal.SIGTERM, 8))]
