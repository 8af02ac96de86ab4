"""lm-evaluation-harness (`lm_eval`, an optional dependency: `pip install 'lwm_jax[eval]'`) on
our models: `LwmLM` implements lm-eval's `LM` interface over a `HarnessModel`, and `run_tasks`
runs named tasks (`lambada_openai`, `piqa`, `hellaswag`, `arc_easy`, `mmlu`, ... or local task
YAML files) through `lm_eval.simple_evaluate`.

    from lwm_jax.eval.lm_eval_adapter import run_tasks
    out = run_tasks(HarnessModel(model, tok), ["lambada_openai", "piqa"])
    out["results"]["piqa"]["acc,none"]

This module imports `lm_eval` when it is imported; without it the import is a one-line
ImportError naming the install command. Task files are data unless the user trusts them:
`find_task_code` tells whether a task directory would make lm-eval run Python (the CLI refuses
such a directory without `--allow-task-code`), and `sandboxed_templates` renders the tasks'
Jinja templates in a sandbox (`run_tasks`' default; the CLI sandboxes whenever `--include-path`
is given without `--allow-task-code`).
"""
from __future__ import annotations

import contextlib
import difflib
import math
import os
import stat
from pathlib import Path
from typing import Iterator, Sequence

import yaml

from lwm_jax.eval.harness import HarnessModel
from lwm_jax.user_input import one_line, quote_path

INSTALL_HINT = "lm-eval tasks need the lm_eval package: pip install 'lwm_jax[eval]'"
try:
    from lm_eval.api.model import LM
except ImportError:
    raise ImportError(INSTALL_HINT) from None

# Errors raised while lm-eval fetches a task's data (offline, unknown dataset, hub down):
# reported as one line about the task data rather than as a crash.
_DATA_ERROR_MODULES = ("datasets", "huggingface_hub", "requests", "httpx", "httpx2", "fsspec",
                       "aiohttp", "urllib3")


class LwmLM(LM):
    """lm-eval `LM` whose requests are answered by a `HarnessModel` (batched, in our JAX
    models). Results are also handed to lm-eval's cache hook (`use_cache`)."""

    def __init__(self, harness: HarnessModel):
        super().__init__()
        self.harness = harness

    @property
    def tokenizer_name(self) -> str:
        return self.harness.tokenizer.name

    def _answer(self, kind: str, requests, results):
        for req, res in zip(requests, results):
            self.cache_hook.add_partial(kind, req.args, res)
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        args = [tuple(req.args) for req in requests]
        return self._answer("loglikelihood", requests, self.harness.loglikelihood(args))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        args = [req.args[0] for req in requests]
        return self._answer("loglikelihood_rolling", requests,
                            self.harness.loglikelihood_rolling(args))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [tuple(req.args) for req in requests]
        return self._answer("generate_until", requests, self.harness.generate_until(args))


# YAML tags lm-eval turns into Python: `!function module.name` imports `module.py` beside the
# YAML file (lm_eval/tasks/_yaml_loader.py); `!!python/...` names objects when PyYAML lacks
# libyaml and lm-eval falls back to yaml.FullLoader.
_CODE_TAGS = ("!function", "tag:yaml.org,2002:python/")
# lm-eval's YAML parser (the same choice as lm_eval/tasks/_yaml_loader.py): what it can parse,
# this parses too, so no file it loads escapes the check.
_SAFE_BASE = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader


class _TagKeepingLoader(_SAFE_BASE):  # type: ignore[misc,valid-type]
    """A safe loader that builds every tagged node as plain data, so a task file's `include:`
    can be read without running anything the tags name."""


def _plain(loader, _suffix, node):
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_scalar(node)


_TagKeepingLoader.add_multi_constructor("", _plain)


def _each_once(root, children) -> Iterator:
    """Every node reachable from `root` through `children(node)`, depth first, each once (nodes
    shared through YAML aliases are not walked again), without recursion: how deep a task file
    nests is up to whoever wrote it."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(children(node))


def _node_children(node):
    """The key and value nodes of a composed YAML mapping node, or the items of a sequence node,
    in the order that pops them first to last."""
    if isinstance(node, yaml.MappingNode):
        return [n for pair in reversed(node.value) for n in reversed(pair)]
    if isinstance(node, yaml.SequenceNode):
        return reversed(node.value)
    return ()


def _data_children(node):
    """The values of a parsed YAML mapping, or the items of a list."""
    if isinstance(node, dict):
        return node.values()
    return node if isinstance(node, list) else ()


def _code_tag(root) -> str | None:
    """The first code-running tag (`_CODE_TAGS`) in a composed YAML node graph, or None."""
    for node in _each_once(root, _node_children):
        if node.tag.startswith(_CODE_TAGS):
            return node.tag
    return None


def _registered_metrics() -> set:
    """Names of the metrics lm-eval has registered (its own Python); any other metric name
    makes lm-eval call `evaluate.load(name)`, which imports Python from a path or the Hub."""
    import lm_eval.api.metrics  # noqa: F401 -- registers lm-eval's metrics
    from lm_eval.api import registry
    reg = getattr(registry, "metric_registry", None)
    if reg is None:
        reg = getattr(registry, "METRIC_REGISTRY", {})
    return {name for name in reg if isinstance(name, str)}


def _metric_code(data) -> str | None:
    """Why a task YAML's parsed data would load a metric through Hugging Face `evaluate` (an
    unregistered metric name, or `hf_evaluate: true`), or None. Every `metric_list` anywhere in
    the document is checked (a group may define its tasks inline)."""
    known = None
    for node in _each_once(data, _data_children):
        metrics = node.get("metric_list") if isinstance(node, dict) else None
        for entry in metrics if isinstance(metrics, list) else ():
            if not isinstance(entry, dict):
                continue
            name = entry.get("metric")
            if entry.get("hf_evaluate") is True:
                return (f"metric {str(name)[:80]!r} has hf_evaluate: true, which loads "
                        "Python through Hugging Face evaluate")
            if isinstance(name, str):
                known = _registered_metrics() if known is None else known
                if name not in known:
                    return (f"metric {name[:80]!r} is not one lm-eval registers, so lm-eval "
                            "would load it as Python through Hugging Face evaluate")
    return None


def _read_task_yaml(path: Path) -> tuple[str | None, list[Path]]:
    """`(why it runs code or None, files named by its top-level include:)` of one task YAML
    file: a code tag, or a metric lm-eval would load through `evaluate` (`_metric_code`).
    Includes resolve as lm-eval resolves them: relative to the real file's directory.

    Raises ValueError (one line) when the file cannot be read or parsed: an unreadable file
    cannot be shown to be free of code, so it is refused rather than skipped."""
    real = path.resolve()
    try:
        with open(real, "rb") as fh:
            loader = _TagKeepingLoader(fh)
            try:
                node = loader.get_single_node()
                tag = _code_tag(node) if node is not None else None
                data = loader.construct_document(node) if node is not None and tag is None \
                    else None
            finally:
                loader.dispose()
    except (OSError, yaml.YAMLError, RecursionError, ValueError, TypeError) as err:
        raise ValueError(f"--include-path: {quote_path(path)} could not be checked for task "
                         f"code ({one_line(err, 160)}); fix or remove it, or pass "
                         "--allow-task-code if you trust the directory") from None
    if tag is None:
        metric = _metric_code(data)
        if metric is not None:
            return metric, []
    else:
        tag = f"has a {tag} tag, which imports Python"
    includes = data.get("include") if isinstance(data, dict) else None
    names = includes if isinstance(includes, list) else [includes]
    return tag, [real.parent / n for n in names if isinstance(n, str)]


def _yaml_code(path: Path, seen: set) -> str | None:
    """Why `path` (a task YAML) would run Python, following its includes, or None."""
    stack = [(path, None)]
    while stack:
        file, parent = stack.pop()
        if file.exists() and not file.is_file() and not file.is_dir():
            raise ValueError(f"--include-path: {quote_path(file)} is not a regular file (a "
                             "FIFO, device or socket); remove it")
        if file.resolve() in seen or not file.is_file():
            continue           # a missing include or dangling link: lm-eval fails, nothing runs
        seen.add(file.resolve())
        tag, includes = _read_task_yaml(file)
        if tag is not None:
            via = f" (included by {quote_path(parent)})" if parent is not None else ""
            return f"{quote_path(file)}{via} {tag}"
        stack.extend((inc, file) for inc in reversed(includes))
    return None


def find_task_code(include_path) -> str | None:
    """Why lm-eval would run Python from `include_path` (a directory or a list of them), or
    None: the first file, in sorted path order, that is a `.py` file or a task YAML carrying
    a `!function` (or `!!python/`) tag or a `metric_list` metric that lm-eval would load
    through Hugging Face `evaluate` (a name it has not registered, or `hf_evaluate: true`),
    itself or in a file it includes. Directories are
    searched recursively as lm-eval searches them (`**/*.yaml`). Raises ValueError (one line)
    for a task YAML that cannot be parsed or a `*.yaml` that is not a regular file.

    Python is one way in; the other, prompt templates (rendered by lm-eval with an
    unsandboxed Jinja environment, which can reach Python objects), is closed by
    `sandboxed_templates`."""
    roots = [include_path] if isinstance(include_path, (str, os.PathLike)) else include_path
    seen: set = set()
    for root in map(Path, roots or ()):
        files = sorted((*root.glob("**/*.py"), *root.glob("**/*.yaml")), key=Path.as_posix)
        check_regular_task_files(root)
        for file in files:
            why = (f"{quote_path(file)} is Python" if file.suffix == ".py"
                   else _yaml_code(file, seen))
            if why:
                return why
    return None


def check_regular_task_files(include_path) -> None:
    """ValueError (one line) for a `*.yaml` / `*.yml` under `include_path` (a directory or a list
    of them) that is not a regular file (a FIFO, device or socket): lm-eval's indexer opens
    every one and would block on a FIFO. Links are followed; a dangling one is left to lm-eval."""
    roots = [include_path] if isinstance(include_path, (str, os.PathLike)) else include_path
    for root in map(Path, roots or ()):
        for file in sorted((*root.glob("**/*.yaml"), *root.glob("**/*.yml")), key=Path.as_posix):
            try:
                mode = file.stat().st_mode
            except OSError:
                continue
            if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
                raise ValueError(f"--include-path: {quote_path(file)} is not a regular file (a "
                                 "FIFO, device or socket); remove it")


def check_task_code(include_path, allow: bool = False) -> None:
    """Refuse, unless `allow` (`--allow-task-code`), an include path from which lm-eval would
    run Python (`find_task_code`): ValueError, one line naming the file. Call it before
    `task_manager` reads the directory: loading a task imports its `!function` modules."""
    if not include_path:
        return
    check_regular_task_files(include_path)
    if allow:
        return
    why = find_task_code(include_path)
    if why:
        raise ValueError(f"--include-path: {why}; pass --allow-task-code if you trust the "
                         "directory and its code")


# Settings of a jinja2 Environment that shape how a template renders, each stored under the
# name of its constructor argument: the sandbox is built with the same values.
_ENV_SETTINGS = ("block_start_string", "block_end_string", "variable_start_string",
                 "variable_end_string", "comment_start_string", "comment_end_string",
                 "line_statement_prefix", "line_comment_prefix", "trim_blocks", "lstrip_blocks",
                 "newline_sequence", "keep_trailing_newline", "undefined", "finalize",
                 "autoescape", "loader", "optimized")
_PROBE = "{{ ''.__class__ }}"      # renders only where attribute access is unchecked


def _sandbox_like(env):
    """A `jinja2.sandbox.SandboxedEnvironment` with `env`'s syntax, undefined handling and
    extensions, and `env`'s filters, tests and globals wherever the sandbox has none of that
    name (so the sandbox keeps its own `range` and lm-eval keeps its `regex_replace`)."""
    from jinja2.sandbox import SandboxedEnvironment
    box = SandboxedEnvironment(extensions=list(env.extensions),
                               **{name: getattr(env, name) for name in _ENV_SETTINGS})
    for ours, theirs in ((box.filters, env.filters), (box.tests, env.tests),
                         (box.globals, env.globals)):
        for name, value in theirs.items():
            ours.setdefault(name, value)
    return box


@contextlib.contextmanager
def sandboxed_templates() -> Iterator[None]:
    """While open, lm-eval renders every task template (`doc_to_text`, `doc_to_target`,
    `doc_to_choice`, `description`, `gen_prefix`, ...) in a Jinja sandbox.

    lm-eval compiles them all with one module-level, unsandboxed `jinja2.Environment`
    (`lm_eval.utils.env`, read by `lm_eval.utils.apply_template` at each call), through which a
    template reaches Python objects and runs code: `{{ cycler.__init__.__globals__.os.system(
    ...) }}`. That environment is replaced here by `jinja2.sandbox.SandboxedEnvironment` with
    the same settings, and restored on exit.

    Why a sandbox rather than refusing templates that spell a dunder attribute: the sandbox
    checks each attribute access and call on the actual object while rendering, so it also
    stops names built at run time (`attr('_' * 2 ~ 'class' ~ '_' * 2)`), subscripts
    (`x['__class__']`), and private or unsafe attributes that a text scan would have to
    enumerate; a template that reaches for one raises `jinja2.exceptions.SecurityError`.
    lm-eval's own templates only read document fields and call plain methods, which the
    sandbox allows, so they render unchanged.

    Raises ValueError (one line) when this lm_eval renders templates some other way (no
    module-level environment, or the probe `{{ ''.__class__ }}` still renders): then templates
    cannot be sandboxed and the caller must trust the task files."""
    import jinja2
    from jinja2.exceptions import SecurityError
    from lm_eval import utils as lm_utils
    original = getattr(lm_utils, "env", None)
    if not isinstance(original, jinja2.Environment) or not callable(
            getattr(lm_utils, "apply_template", None)):
        raise ValueError("--include-path: this lm_eval version renders task templates in a way "
                         "that cannot be sandboxed; pass --allow-task-code if you trust the "
                         "directory's templates")
    lm_utils.env = _sandbox_like(original)
    try:
        try:
            lm_utils.apply_template(_PROBE, {})
        except SecurityError:
            pass
        else:
            raise ValueError("--include-path: this lm_eval version's templates escape the Jinja "
                             "sandbox; pass --allow-task-code if you trust the directory's "
                             "templates")
        yield
    finally:
        lm_utils.env = original


def task_manager(include_path=None, names: Sequence[str] | None = None):
    """lm-eval's `TaskManager` over its built-in tasks and the task YAML files under
    `include_path` (a directory or a list of them). When every one of `names` is a plain task
    (not a group or tag) defined under `include_path`, only those files are indexed: indexing
    lm-eval's ~15k built-in task files takes seconds."""
    from lm_eval.tasks import TaskManager
    if include_path and names:
        local = TaskManager(include_path=include_path, include_defaults=False)
        plain = set(getattr(local, "all_subtasks", ()))
        if all(n.strip() in plain for n in names if n.strip()):
            return local
    return TaskManager(include_path=include_path)


def check_task_names(names: Sequence[str], manager) -> list[str]:
    """The names, stripped, each known to `manager`; ValueError (one line, with the closest
    known names) otherwise."""
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError("--tasks: no task named; give e.g. --tasks lambada_openai,piqa")
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else \
                "; see `lm_eval --tasks list` or add --include-path DIR for your own YAML tasks"
            raise ValueError(f"--tasks: {name!r} is not an lm-eval task{hint}")
    return names


def _fewshot_pool(manager, names) -> str:
    """` (N available)`: the fewest few-shot documents among `names`' tasks, or "" when that
    cannot be told without fetching anything more."""
    import warnings
    counts = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # load_task_or_group's deprecation notice
            tasks = [t for name in names for t in _leaf_tasks(manager.load_task_or_group([name]))]
        for task in tasks:
            docs = task.fewshot_docs() if hasattr(task, "fewshot_docs") else None
            if docs is None:
                return ""
            counts.append(len(docs))
    except Exception:   # noqa: BLE001 -- only a hint: the message stands without it
        return ""
    return f" (its few-shot pool holds {min(counts)})" if counts else ""


def _leaf_tasks(tree) -> list:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        else:
            out.append(node)
    return out


def _finite_or_none(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def run_tasks(harness: HarnessModel, tasks: Sequence[str], *, num_fewshot: int | None = None,
              limit: int | None = None, include_path=None, bootstrap_iters: int = 100000,
              manager=None, sandbox: bool = True) -> dict:
    """Run lm-eval `tasks` on `harness` -> `{"results": {task: {metric: value}}, "n_shot":
    {task: n}, "versions": {task: v}, "n_truncated": int}`.

    `sandbox`: render the tasks' templates in a Jinja sandbox (`sandboxed_templates`; lm-eval's
    own templates render the same in it); False only for task files you trust (the CLI turns
    it off without `--include-path` and with `--allow-task-code`). Metric values stay as
    lm-eval computes them, except that a non-finite standard error (e.g. one example) becomes
    None. Raises ValueError (one line) for an unknown task, a bad `num_fewshot` / `limit`, a
    template the sandbox stops, and when a task's data cannot be loaded (offline, say).
    """
    import lm_eval
    from jinja2.exceptions import SecurityError, TemplateError
    if num_fewshot is not None and (not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise ValueError(f"--num-fewshot: must be an integer >= 0, got {num_fewshot!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit: must be an integer >= 1, got {limit!r}")
    manager = manager or task_manager(include_path, tasks)
    names = check_task_names(tasks, manager)
    try:
        with sandboxed_templates() if sandbox else contextlib.nullcontext():
            out = lm_eval.simple_evaluate(model=LwmLM(harness), tasks=names,
                                          num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, log_samples=False,
                                          bootstrap_iters=bootstrap_iters)
    except SecurityError as err:
        raise ValueError(f"--include-path: a template of --tasks {','.join(names)} reaches for "
                         f"Python internals ({one_line(str(err), 120)}), which the template "
                         "sandbox refuses; pass --allow-task-code if you trust the directory and "
                         "its templates") from None
    except TemplateError as err:    # a typo'd field, an Undefined subscripted, bad syntax
        raise ValueError(f"--tasks {','.join(names)}: a template of the task fails to render "
                         f"({type(err).__name__}: {one_line(str(err), 160)}); fix doc_to_text/"
                         "doc_to_target/doc_to_choice in the task YAML" +
                         ("; --include-path templates render in a sandbox that leaves Python "
                          "internals undefined" if sandbox else "")) from None
    except ValueError as err:
        if "Sample larger than population" not in str(err):
            raise
        raise ValueError(f"--num-fewshot: {num_fewshot} is more than the few-shot examples "
                         f"--tasks {','.join(names)} has{_fewshot_pool(manager, names)}; give a "
                         "smaller --num-fewshot") from None
    except Exception as err:   # noqa: BLE001 -- only data-loading failures are rephrased
        if type(err).__module__.split(".")[0] not in _DATA_ERROR_MODULES and \
                not isinstance(err, ConnectionError):
            raise
        raise ValueError(f"--tasks: the task data could not be loaded ({one_line(str(err), 200)}"
                         "); lm-eval fetches datasets from the Hugging Face Hub: run once online "
                         "(the cache is reused offline) or use local task YAML files "
                         "(--include-path)") from None
    results = {task: {k: _finite_or_none(v) if "_stderr" in k else v for k, v in metrics.items()}
               for task, metrics in out["results"].items()}
    return {"results": results, "n_shot": dict(out.get("n-shot", {})),
            "versions": dict(out.get("versions", {})), "n_truncated": harness.n_truncated}
