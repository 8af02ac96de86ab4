"""The GPU test command (`python -m pytest -m "gpu or gpu_path"`) selects what it says: every
file in `conftest.GPU_PATH_FILES` exists (a renamed file would silently leave the selection),
and every file with a test marked `gpu` is selected by it."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    """tests/conftest.py by its path (a bare `import conftest` may find a folder's conftest)."""
    spec = importlib.util.spec_from_file_location("_root_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPU_PATH_FILES = _root_conftest().GPU_PATH_FILES


def test_every_gpu_path_file_exists():
    missing = [f for f in GPU_PATH_FILES if not (ROOT / f).is_file()]
    assert not missing, f"GPU_PATH_FILES names files that do not exist: {missing}"


def _marks_gpu(path: Path) -> bool:
    """A `pytest.mark.gpu` anywhere in the file (a decorator or `pytestmark`)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr == "gpu" and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
            return True
    return False


def test_gpu_marked_files_are_known():
    """A file with `gpu` tests and other tests too must list itself in GPU_PATH_FILES, or its
    other tests would miss the GPU command; files whose tests are all `gpu` may stay out."""
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not _marks_gpu(path) or rel in GPU_PATH_FILES:
            continue
        source = path.read_text(encoding="utf-8")
        assert "pytestmark" in source and "mark.gpu" in source.split("pytestmark", 1)[1][:80], \
            f"{rel} has gpu-marked tests beside others: add it to tests/conftest.py GPU_PATH_FILES"
