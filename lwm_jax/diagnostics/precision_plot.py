"""Heat maps of a precision report (a matplotlib `Figure` drawn by Agg: no display, and no
change to pyplot's global backend).

Three panels, log10 of the relative error: local error per layer x sub-op, end-to-end error
against the shadow per layer x sub-op, and the gradient's error per layer x parameter group.
Ops outside the layers (logits, loss, RoPE table, ...) and parameters outside the blocks
(embedding, head) sit in an extra row named `model`. Blank: not measured; a non-finite error is
drawn at the top of the colour scale and marked `inf`. A panel with no measured value (the
end-to-end and gradient panels of a report without a shadow) is left out. The title names the
model studied (`Report.model_source`).
"""
from __future__ import annotations

import math
import os
import textwrap

import numpy as np

from lwm_jax.diagnostics.precision_report import Report

FLOOR_LOG10 = -9.0     # errors below 1e-9 (including exact zeros) are drawn as 1e-9


def _grid(items, layers: int):
    """`(matrix [rows, cols] of log10 errors or NaN, row labels, column labels, inf mask)` from
    `(layer or None, column, value or None)` triples."""
    cols = list(dict.fromkeys(col for _, col, _ in items))
    has_model = any(layer is None for layer, _, _ in items)
    rows = [f"layer {i}" for i in range(layers)] + (["model"] if has_model else [])
    grid = np.full((len(rows), len(cols)), np.nan)
    inf = np.zeros_like(grid, dtype=bool)
    for layer, col, value in items:
        if value is None:
            continue
        r, c = (layers if layer is None else layer), cols.index(col)
        if not math.isfinite(value):
            inf[r, c] = True
            continue
        grid[r, c] = math.log10(max(value, 10.0**FLOOR_LOG10))
    return grid, rows, cols, inf


def plot_heatmap(report: Report, path: str | os.PathLike, title: str | None = None) -> str:
    """Write the three-panel heat map of `report` to `path` (PNG); returns the path. The default
    title names the model, policies, batch, worst offender and `report.model_source` (a map
    of a fresh initialisation reads very differently from a trained model's)."""
    from matplotlib.figure import Figure

    L = report.layers
    panels = [
        ("local error vs float64 (log10)",
         [(r.layer, r.subop, r.local_rel) for r in report.rows]),
        (f"end-to-end vs {report.shadow} shadow (log10)",
         [(r.layer, r.subop, r.e2e_rel) for r in report.rows]),
        (f"gradient vs {report.shadow} shadow (log10)",
         [(g.layer, g.group, g.rel) for g in report.grads]),
    ]
    panels = [(name, items) for name, items in panels           # shadow none: no e2e panel
              if any(value is not None for _, _, value in items)]
    grids = [_grid(items, L) for _, items in panels]
    finite = [g[0][np.isfinite(g[0])] for g in grids]
    top = max((float(v.max()) for v in finite if v.size), default=0.0)
    vmax = max(top, -1.0)
    fig = Figure(figsize=(5.2 * len(panels), 1.4 + 0.45 * (L + 1)))
    axes = fig.subplots(1, len(panels), squeeze=False)
    image = None
    for ax, (name, _), (grid, rows, cols, inf) in zip(axes[0], panels, grids):
        shown = np.where(inf, vmax, grid)
        image = ax.imshow(np.ma.masked_invalid(shown), cmap="viridis", vmin=FLOOR_LOG10,
                          vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_title(name, fontsize=9)
        for (i, j), flag in np.ndenumerate(inf):
            if flag:
                ax.text(j, i, "inf", ha="center", va="center", color="red", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="log10 relative error")
    worst = report.worst
    where = worst.subop if worst.layer is None else f"layer {worst.layer} {worst.subop}"
    source = textwrap.fill(f"model studied: {report.model_source}", 80 * len(panels))
    fig.suptitle(title or (f"{report.family} {report.model} | policy {report.policy} vs "
                           f"{report.shadow} | batch {report.batch} | worst: {where}\n"
                           f"{source}"), fontsize=8, y=1.0, va="bottom")   # above the panels
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return os.fspath(path)
