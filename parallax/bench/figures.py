"""The benchmark's figures: file-name-safe names, and fresh Agg figures (no pyplot state), for
every module that draws one (plots, projection, partitions_report, cache_report)."""
from __future__ import annotations

import re
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def slug(name: str) -> str:
    """A name in the form a file name may take."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def figure() -> tuple[Figure, Any]:
    """A fresh figure rendered with Agg whatever pyplot's backend, and its axes."""
    fig = Figure(figsize=(6.4, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def figure_row(columns: int, width: float = 12.8) -> tuple[Figure, Any]:
    """A fresh Agg figure of `columns` axes side by side, and those axes."""
    fig = Figure(figsize=(width, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, columns)
