"""`train(cfg)`: the whole training run, top to bottom.

config -> data (refused before anything is built) -> mesh -> abstract model (shapes +
logical axes) -> optimizer -> shardings -> restore-if-present (else initialise on the mesh) ->
loop (jitted step, metrics, validation, checkpoints, stop signals) -> final checkpoint +
loss-curve plot.

Run directory (`run_dir`, default `runs/<name>`): `config.yaml` (the resolved config),
`checkpoints/<step>/`, the trackers' files (`logging.trackers`: `metrics.jsonl`, `tb/`
TensorBoard when tensorboardX is installed, `wandb/`), `loss_curve.png`, and `profile/` with
`train.profile_steps`. Running the same command again resumes from the newest complete
checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from lwm_jax.diagnostics.nonfinite import describe, tap_stats
from lwm_jax.hardware import platform_of
from lwm_jax.precision.loss_scale import loss_scale_for
from lwm_jax.models.registry import DEFAULT_ARCH, get_arch
from lwm_jax.models.rwkv7.config import upgrade_saved_model
from lwm_jax.precision import parse_policy
from lwm_jax.runtime import RUNTIME_FIELDS
from lwm_jax.train import batches
from lwm_jax.train.checkpoint import Checkpointer, CheckpointWriteError, abstract_with_shardings
from lwm_jax.train.config import RunConfig, check_against_mesh, mesh_shape
from lwm_jax.train.distributed import is_primary
from lwm_jax.train.guard import SkipWatch
from lwm_jax.train.run_lock import RunDirLock, open_no_follow, refuse_links
from lwm_jax.train.metrics import MetricsLogger, plot_loss_curve
from lwm_jax.train.profiling import PROFILE_DIR, StepWindowProfiler
from lwm_jax.train.trackers import check_trackers, make_trackers
from lwm_jax.train.optimizer import lr_schedule, make_optimizer
from lwm_jax.train.preflight import compile_step
from lwm_jax.precision.fp8 import largest_amax
from lwm_jax.train.params import count_params, model_variables, split_model
from lwm_jax.train.sharding import (make_mesh, param_shardings, replicated, shard_like_params,
                                    tokens_sharding)
from lwm_jax.train.signals import StopRequest
from lwm_jax.user_input import load_yaml_file, short
from lwm_jax.train.step import TrainState, make_eval_step, make_train_step


@dataclasses.dataclass
class TrainResult:
    """What a `train` call ends with. `stopped_by`: signal name when a signal ended the run
    early, "non-finite" when `train.max_consecutive_skips` steps in a row were skipped, or
    "complete" when the run dir already held a finished run (nothing was done; `state` None);
    `diagnosis`: then, one line naming the first op that produced a non-finite value;
    `final_val_loss`: None without a validation split (or after a stop)."""

    run_dir: str
    step: int
    state: TrainState | None
    final_val_loss: float | None
    stopped_by: str | None
    diagnosis: str | None = None


@dataclasses.dataclass
class TrainProgram:
    """Everything `lwm-jax train` compiles for a config, before any data or checkpoint.

    Benchmarks and diagnostics build their step here so that they time and test exactly what
    `train` runs. `train_step(state, tokens) -> (state, metrics)` donates `state`;
    `eval_step(params, fp8_metas, tokens_BT1) -> loss` (`fp8_metas`: the state's `fp8`).
    """

    cfg: RunConfig
    policy: Any
    sizes: dict
    mesh: Any
    graphdef: Any
    axes: dict
    tx: Any
    lr_at: Any
    fresh_state: Any          # () -> TrainState (unsharded; used under jit by `init_state`)
    abstract_state: TrainState
    state_sh: Any             # TrainState of NamedShardings
    params_sh: Any
    train_step: Any
    eval_step: Any

    def init_state(self) -> TrainState:
        """A freshly initialised train state, placed on the mesh."""
        return _initial_state(self.fresh_state, self.state_sh)


def build_program(cfg: RunConfig, devices: list | None = None) -> TrainProgram:
    """Mesh, abstract model, optimizer, shardings and the jitted steps for `cfg`.

    `devices`: the devices to build the mesh of (default: every device JAX sees). Devices of a
    TPU topology description (`lwm_jax.aot.topology`) give a program that compiles for that
    topology on any host; the kernels follow the devices' platform (`lwm_jax.hardware`).
    """
    t = cfg.train
    policy = parse_policy(cfg.precision)
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(cfg.mesh, len(devices))
    check_against_mesh(cfg, sizes)
    mesh = make_mesh(sizes, devices)

    # Model shapes (nothing allocated yet), optimizer, shardings.
    model_cls = get_arch(cfg.arch).model_cls
    build = lambda: model_cls(cfg.model, policy, runtime=cfg.runtime, mesh=mesh,  # noqa: E731
                              rngs=nnx.Rngs(t.seed))
    abstract_model = nnx.eval_shape(build)
    graphdef, abstract_params, axes, _ = split_model(abstract_model)
    tx = make_optimizer(t, abstract_params, axes)
    lr_at = lr_schedule(t)

    def fresh_state() -> TrainState:
        _, params, _, fp8_metas = split_model(build())
        return TrainState(jnp.zeros([], jnp.int32), params, tx.init(params),
                          loss_scale_for(policy), jax.random.PRNGKey(t.seed), fp8_metas)

    abstract_state = jax.eval_shape(fresh_state)
    params_sh = param_shardings(abstract_params, axes, mesh)
    state_sh = dataclasses.replace(
        jax.tree.map(lambda _: replicated(mesh), abstract_state), params=params_sh,
        opt_state=shard_like_params(abstract_state.opt_state, abstract_params, params_sh, mesh))
    eod_id = batches.eod_id_for(cfg.data) if cfg.data.reset_at_document_boundary else None
    train_step = make_train_step(graphdef, tx, lr_at, grad_accum=t.grad_accum,
                                 use_l2wrap=t.l2wrap, mesh=mesh, state_shardings=state_sh,
                                 loss_chunk=t.loss_chunk, eod_id=eod_id)
    eval_step = make_eval_step(graphdef, mesh=mesh, params_shardings=params_sh,
                               loss_chunk=t.loss_chunk, eod_id=eod_id)
    return TrainProgram(cfg, policy, sizes, mesh, graphdef, axes, tx, lr_at, fresh_state,
                        abstract_state, state_sh, params_sh, train_step, eval_step)


def train(cfg: RunConfig, *, progress: bool = True, stop_after: int | None = None,
          compiled: str | None = None) -> TrainResult:
    """Train (or resume) the run described by `cfg`.

    stop_after: run at most this many optimizer steps in this call, then checkpoint and return
      (the schedule still spans `train.steps`; calling again continues).
    compiled: path of a train step saved by `lwm-jax compile --save` for this config and these
      devices, loaded instead of compiling (`lwm_jax.train.saved_step`; a mismatch is a one-line
      ValueError).
    """
    run_dir = cfg.resolved_run_dir
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as err:
        raise ValueError(f"run_dir: cannot create {run_dir} ({err.strerror}); choose a writable "
                         "run_dir") from None
    # One run per run dir (the lock is process 0's in a multi-process run); SIGTERM/SIGINT
    # handlers from the start, so a preemption during set-up or compilation still ends in a
    # clean stop (the loop sees the flag before step 1).
    with _locks(cfg, run_dir) if is_primary() else contextlib.nullcontext(), \
            StopRequest() as stop:
        refuse_links(run_dir)
        return _train_locked(cfg, run_dir, stop, progress, stop_after, compiled)


def _locks(cfg: RunConfig, run_dir: str) -> contextlib.ExitStack:
    """The run dir's lock, and `checkpoint.dir`'s when it is a local directory outside the
    run dir (two runs with their own run dirs must not share checkpoints)."""
    stack = contextlib.ExitStack()
    stack.enter_context(RunDirLock(run_dir))
    ckpt, run = cfg.checkpoint_dir, os.path.abspath(run_dir)
    local_elsewhere = "://" not in ckpt and os.path.commonpath(
        [os.path.abspath(ckpt), run]) != run
    if local_elsewhere:
        try:
            os.makedirs(ckpt, exist_ok=True)
        except OSError as err:
            stack.close()
            raise ValueError(f"checkpoint.dir: cannot create {ckpt} ({err.strerror}); choose a "
                             "writable checkpoint.dir") from None
        try:
            stack.enter_context(RunDirLock(ckpt, "checkpoint.dir"))
        except BaseException:
            stack.close()
            raise
    return stack


def _train_locked(cfg: RunConfig, run_dir: str, stop: StopRequest, progress: bool,
                  stop_after: int | None, compiled: str | None = None) -> TrainResult:
    t = cfg.train
    primary = is_primary()      # process 0 writes the run's records; every process computes
    say = tqdm.write if primary else (lambda _msg: None)
    _check_same_model(os.path.join(run_dir, "config.yaml"), cfg)
    for note in check_trackers(cfg.logging.trackers):     # wandb missing: refused here
        say(f"lwm-jax train: {note}")
    ckpt = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint)
    latest = ckpt.latest_step()
    if latest is not None and latest >= t.steps:
        ckpt.close()
        say(f"lwm-jax train: run {cfg.name!r} in {run_dir} is already complete (checkpoint "
                   f"at step {latest} of {t.steps}); nothing to do. Raise train.steps to train "
                   "further, or choose a new run_dir")
        return TrainResult(run_dir, latest, None, None, "complete")
    # Data first: a source that cannot be read or a validation split too small for one batch
    # is refused before the model is built and compiled (minutes for a large model).
    data = batches.train_data(cfg.data, cfg.model, t)
    if primary:
        fd = open_no_follow(os.path.join(run_dir, "config.yaml"),
                            os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(cfg.to_yaml())
    prog = build_program(cfg)
    policy, mesh, sizes = prog.policy, prog.mesh, prog.sizes
    abstract_state, state_sh = prog.abstract_state, prog.state_sh
    step_tokens_sh = tokens_sharding(mesh, with_accum_axis=t.grad_accum > 1)
    # Compile the step and refuse one that cannot fit before anything is allocated: initialising
    # a large model's state takes device memory and time that a refused run should not spend
    # (benchmarks/init_time.py times the init; figures in benchmarks/RESULTS-log.md).
    tokens_shape = batches.global_batch_shape(t.batch_size, t.ctx_len + 1, t.grad_accum)
    step_args = (abstract_with_shardings(abstract_state, state_sh),
                 jax.ShapeDtypeStruct(tokens_shape, jnp.int32, sharding=step_tokens_sh))
    if compiled is not None:            # compiled ahead of time (`lwm-jax compile --save`)
        from lwm_jax.train.saved_step import load_compiled
        compiled_step = load_compiled(compiled, prog.train_step.lower(*step_args),
                                      cfg, list(mesh.devices.flat))
        say(f"lwm-jax train: loaded the compiled train step from {compiled}")
    else:
        compiled_step = compile_step(cfg, prog.train_step, *step_args)   # samplers: int32

    # Restore the newest complete checkpoint, or initialise.
    if latest is None:
        t_init = time.perf_counter()    # minutes for multi-billion-parameter models on a GPU
        state, data_state = jax.block_until_ready(prog.init_state()), None
        init_s = time.perf_counter() - t_init
    else:
        state, data_state = ckpt.restore(latest, abstract_with_shardings(abstract_state, state_sh))

    sampler, val = data.sampler, data.val
    if data_state is not None:
        sampler.load_state_dict(data_state)
    n_eval = min(t.eval_batches, val.steps_per_epoch) if val is not None else 0

    eval_step = prog.eval_step
    eval_tokens_sh = tokens_sharding(mesh)
    V = cfg.model.vocab_size

    def evaluate(state) -> float:
        losses = [eval_step(state.params, state.fp8,
                            batches.to_global(val.batch_at(i), eval_tokens_sh, t.batch_size,
                                              vocab_size=V))
                  for i in range(n_eval)]
        return float(jnp.mean(jnp.stack(losses)))

    start = int(state.step)
    if sampler.step != start:
        raise ValueError(f"checkpoint {latest}: sampler step {sampler.step} != train step {start}")
    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    n_params = count_params(abstract_state.params)
    say(f"lwm-jax train: run {cfg.name!r} in {run_dir}: {n_params:,} params, "
               f"precision {policy.name}, mesh {sizes}, data {data.description}; "
               + (f"resumed at step {start}" if latest is not None
                  else f"fresh start (state initialised in {init_s:.1f} s)")
               + f", training to step {end} of {t.steps}")
    lg = cfg.logging
    trackers = (make_trackers(lg.trackers, run_dir, run_name=cfg.name,
                              wandb_project=lg.wandb_project, wandb_entity=lg.wandb_entity)
                if primary else [])
    model_flops = get_arch(cfg.arch).model_flops_per_token(cfg.model, t.ctx_len)
    logger = MetricsLogger(run_dir, n_params=n_params, tokens_per_step=t.batch_size * t.ctx_len,
                           total_steps=t.steps, start_step=start, progress=progress,
                           fp16=policy.loss_scale == "dynamic", write=primary, trackers=trackers,
                           model_flops_per_token=model_flops)
    logger.log_config(start, cfg.to_dict())
    profiler = StepWindowProfiler(t.profile_steps, os.path.join(run_dir, PROFILE_DIR),
                                  enabled=primary)
    val_loss, last_eval = None, None
    if val is not None and latest is None and t.eval_every > 0:
        val_loss, last_eval = evaluate(state), 0
        logger.log_eval(0, val_loss)

    step, stopped_by, logged, diagnosis = start, None, None, None
    watch = SkipWatch(t.max_consecutive_skips,
                      getattr(state.loss_scale, "min_scale", None))
    while step < end and stop.requested is None:
        tokens = batches.to_global(next(sampler), step_tokens_sh, t.batch_size, t.grad_accum,
                                   vocab_size=V)
        profiler.before(step)
        state, metrics = compiled_step(state, tokens)
        profiler.after(step, metrics)
        step += 1
        logger.advance(metrics=metrics)
        if watch.push(step, metrics, tokens):
            stopped_by = "non-finite"
            break
        if step == start + 1:             # the first run's one-time costs: time from here on
            jax.block_until_ready(metrics)
            logger.reset_timer(step)
        if step % t.log_every == 0 or step == end:
            logger.log_train(step, metrics)
            logged = step
        if val is not None and t.eval_every > 0 and step % t.eval_every == 0:
            val_loss, last_eval = evaluate(state), step
            logger.log_eval(step, val_loss)
            logger.reset_timer(step)          # tokens/s measures training steps only
        if cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0:
            with _metrics_kept(logger, step, metrics, logged):
                ckpt.save(step, state, sampler.state_dict())
    profiler.close()
    if stopped_by is None and watch.flush():
        stopped_by = "non-finite"
    stopped_by = stopped_by or stop.requested
    if step > start and logged != step:        # stopped early by a signal or divergence
        logger.log_train(step, metrics)
    if stopped_by == "non-finite":
        diagnosis = _diagnose(cfg, policy, model_variables(state.params, state.fp8), watch,
                              t.max_consecutive_skips)
        if state.fp8 is not None:
            diagnosis += f"; {largest_amax(jax.device_get(state.fp8))}"
    # Final checkpoint (also on a stop signal); the signal handlers stay installed until
    # it is on disk, so a second SIGTERM cannot interrupt the save.
    with _metrics_kept(logger, None, None, None):
        ckpt.save(step, state, sampler.state_dict())
        ckpt.close()

    if val is not None and stopped_by is None and last_eval != step:
        val_loss = evaluate(state)
        logger.log_eval(step, val_loss)
    logger.close()
    if primary and logger.path is not None:
        plot_loss_curve(logger.path, os.path.join(run_dir, "loss_curve.png"), title=cfg.name)
    if stopped_by == "non-finite":
        say(f"lwm-jax train: {diagnosis}; the last finite state is checkpointed at "
                   f"step {step} in {ckpt.directory}")
    elif stopped_by is not None:
        say(f"lwm-jax train: {stopped_by} received; checkpoint saved at step {step} in "
                   f"{ckpt.directory}; run the same command again to resume")
    return TrainResult(run_dir, step, state, val_loss, stopped_by, diagnosis)


@contextlib.contextmanager
def _metrics_kept(logger: MetricsLogger, step, metrics, logged):
    """On a failed checkpoint write, record the current step's metrics (when not yet logged)
    and close the metrics files before the error propagates: nothing trained goes unlogged."""
    try:
        yield
    except CheckpointWriteError:
        if step is not None and logged != step:
            logger.log_train(step, metrics)
        logger.close()
        raise


def _diagnose(cfg: RunConfig, policy, params, watch: SkipWatch, limit: int) -> str:
    """One line: why the run stopped and the first op with a non-finite value on the last
    skipped batch (a probed forward with the current, finite parameters and, under an FP8
    policy, the current scaling state: `params` is `model_variables`' merged dict)."""
    bad_step, tokens = watch.last_bad
    head = (f"stopped: {limit} steps in a row had a non-finite loss or gradient and were "
            f"skipped (parameters unchanged; last at step {bad_step})")
    try:
        inputs = tokens[0, :, :-1] if tokens.ndim == 3 else tokens[:, :-1]
        probe_model_fn = get_arch(cfg.arch).probe_model_fn
        stats = tap_stats(probe_model_fn(cfg.model, policy, cfg.runtime), params, inputs)
        return f"{head}; {describe(stats, int(inputs.shape[1]))}"
    except Exception as err:   # the stop and its checkpoint matter more than the diagnosis
        return f"{head}; the forward re-run that localises it failed ({type(err).__name__}: {err})"


def _check_same_model(saved_path: str, cfg: RunConfig) -> None:
    """Refuse to resume a run dir whose checkpoints hold another model family, shape or
    precision (the runtime may change between resumes; older saved configs kept its keys under
    `model:`, which are ignored here, and have no `arch`, which means rwkv7)."""
    if not os.path.isfile(saved_path) or not os.path.isdir(cfg.checkpoint_dir):
        return
    saved = load_yaml_file(saved_path) or {}
    if not isinstance(saved, dict):
        raise ValueError(f"{saved_path}: expected a mapping of config sections; fix or remove it")
    new = cfg.to_dict()
    for key in ("arch", "model", "precision"):
        old_value = saved.get(key, DEFAULT_ARCH if key == "arch" else None)
        if key == "model" and isinstance(old_value, dict):
            old_value = upgrade_saved_model(
                {k: v for k, v in old_value.items() if k not in RUNTIME_FIELDS})
        if old_value is not None and old_value != new[key]:
            if isinstance(old_value, dict):
                diff = sorted(k for k in new[key] if old_value.get(k) != new[key][k])
                what = ", ".join(f"model.{k}={short(old_value.get(k))}" for k in diff)
            else:
                what = f"{key}={short(old_value)}"
            raise ValueError(f"run_dir: {cfg.resolved_run_dir} holds checkpoints of a run with "
                             f"{what}; resume with the same settings or choose a new run_dir")


def _initial_state(fresh_state, state_sh) -> TrainState:
    """Run `fresh_state` and place the result on the mesh (`state_sh`'s).

    On GPU/TPU: one `jax.jit` with `out_shardings`, so every array is created directly in its
    shards, never whole on one device. On CPU the model is built op by op instead and then
    moved: inside one jitted program the batched LAPACK QRs of the orthogonal init can run at
    once (one per device on a multi-device CPU mesh), and jaxlib 0.10.2's CPU LAPACK kernels then
    deadlock the host thread pool; built op by op, `layers.init.orthogonal` waits for each QR.
    """
    if platform_of(jax.tree.leaves(state_sh)[0].mesh) == "cpu":
        return jax.device_put(fresh_state(), state_sh)
    return jax.jit(fresh_state, out_shardings=state_sh)()
