"""The notebooks under notebooks/ execute headless, top to bottom, without a cell error.

Each runs in a fresh kernel (nbclient, the `python3` kernel of this interpreter) with a
temporary working directory; an exception in any cell, including the `assert`s that check the
claims the notebooks make, fails the test with the cell and its traceback. The executed copy is
not written back: notebooks are committed without outputs.

XLA:CPU's optimisation level (tests/conftest.py sets 0: compiling is faster, running slower)
follows what each notebook spends its time on (timings: benchmarks/RESULTS.md, "CPU test
suite"). quickstart mostly compiles and keeps level 0. precision_study mostly runs (40-step
training curves, WKV scans over 16384 tokens) and gets XLA:CPU's default level, the one a
user's kernel has. The level changes no result a notebook asserts: XLA:CPU uses no fast-math
at either level.
"""
from __future__ import annotations

from pathlib import Path

import pytest

# In [dev]; a GPU machine installed with [gpu] only may lack them: skip, do not stop collection.
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name,optimised", [
    pytest.param("quickstart.ipynb", False, id="quickstart.ipynb"),    # ~25 s on a 2-core CPU
    pytest.param("precision_study.ipynb", True, id="precision_study.ipynb",
                 marks=pytest.mark.slow),                              # ~1.5-2 min
])
def test_notebook_executes(name, optimised, tmp_path, subprocess_env):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells
               if cell.cell_type == "code"), f"{name} is committed with outputs; clear them"
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute(env=subprocess_env(optimised=optimised))
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{name}: a cell failed:\n{err}")
    errors = [out for cell in notebook.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
