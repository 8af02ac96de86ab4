"""Hugging Face Hub names as checkpoints: `load_pretrained("RWKV/<repo>")` and `convert`.

A checkpoint argument that is not an existing local path and looks like a Hub name is fetched
with `huggingface_hub` (optional: `pip install 'lwm_jax[hub]'`) into its usual cache:
  "owner/repo"            a model repository: `config.json`, the safetensors weights (and their
                          index) and the tokenizer files (`TOKENIZER_FILES`); read as "hf";
  "owner/repo/FILE.pth"   one file of a repository, e.g. an official RWKV-LM release
                          ("BlinkDL/rwkv-7-world/RWKV-x070-World-0.1B-v2.8-20241210-ctx4096.pth").
`HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=1`), read at each call, uses the cache only;
`HF_HUB_CACHE`, also read at each call, names the cache directory. Whatever goes wrong
(package missing, offline and not cached, no such repository, Hub unreachable) is one line
naming the checkpoint and what to do.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

WEIGHT_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "rwkv_vocab_*.txt", "generation_config.json")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_REPO = re.compile(rf"{_PART}/{_PART}")
_FILE = re.compile(rf"({_PART}/{_PART})/([A-Za-z0-9._-]+\.(?:pth|pt))")
INSTALL_HINT = "pip install 'lwm_jax[hub]' (huggingface_hub)"


def is_hub_name(path) -> bool:
    """True when `path` is a string naming a Hub repository (or one `.pth` file in it) and no
    local file or directory of that name exists."""
    if not isinstance(path, str) or os.path.exists(path) or ".." in path:
        return False
    return bool(_REPO.fullmatch(path) or _FILE.fullmatch(path))


def offline() -> bool:
    """Whether `HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE` is set to a true value now."""
    return any(os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _error_names(err: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(err).__mro__}


def _explain(name: str, err: Exception, is_offline: bool) -> ValueError:
    kinds = _error_names(err)
    where = f"checkpoint {name!r}: no such local path"
    if "LocalEntryNotFoundError" in kinds or "OfflineModeIsEnabled" in kinds:
        why = ("HF_HUB_OFFLINE is set and it is not in the Hugging Face cache" if is_offline
               else "it is not in the Hugging Face cache and the Hub cannot be reached")
        return ValueError(f"{where}; {why}: download it once online (or unset HF_HUB_OFFLINE), "
                          "or give a local directory / .pth file")
    if kinds & {"RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError",
                "EntryNotFoundError", "RemoteEntryNotFoundError"}:
        return ValueError(f"{where}, and the Hugging Face Hub has no accessible repository or "
                          "file of that name (private or gated ones need `hf auth login`); "
                          "check the name")
    if "HFValidationError" in kinds:
        return ValueError(f"{where}, and it is not a valid Hugging Face repository name")
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return ValueError(f"{where}; downloading it from the Hugging Face Hub failed ({first}); "
                      "check the network or give a local path")


def resolve(name: str) -> Path:
    """The local path of Hub checkpoint `name` (a snapshot directory, or the `.pth` file),
    downloaded into the Hugging Face cache when needed.

    Raises ImportError (one line) without `huggingface_hub`, ValueError (one line) for
    everything the download can run into.
    """
    try:
        import huggingface_hub
    except ImportError:
        raise ImportError(f"checkpoint {name!r}: no such local path; to download it from the "
                          f"Hugging Face Hub, {INSTALL_HINT}") from None
    is_offline = offline()
    common = {"local_files_only": is_offline, "cache_dir": os.environ.get("HF_HUB_CACHE") or None}
    file_match = _FILE.fullmatch(name)
    try:
        if file_match:
            repo, filename = file_match.groups()
            return Path(huggingface_hub.hf_hub_download(repo, filename, **common))
        return Path(huggingface_hub.snapshot_download(
            name, allow_patterns=list(WEIGHT_FILES + TOKENIZER_FILES), **common))
    except Exception as err:   # noqa: BLE001 -- every failure becomes one line (see _explain)
        raise _explain(name, err, is_offline) from None
