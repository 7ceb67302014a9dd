"""Pictures: the needle heatmap in the original test's style (and any score over length x position), and line plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless, deterministic
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402

# The original needle test's colours: red -> yellow -> green.
NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


def grid_heatmap(rows: list[dict], path: Path, *, title: str, score_key: str = "score", y_key: str = "depth",
                 xlabel: str = "Token Limit", ylabel: str = "Depth Percent", what: str | None = None) -> Path | None:
    """Score per (y, length) cell, red -> yellow -> green; several records of one cell (samples) are averaged."""
    if not rows:
        return None
    lengths = sorted({r["length"] for r in rows})
    ys = sorted({r[y_key] for r in rows})
    cells: dict[tuple, list[float]] = {}
    for r in rows:
        cells.setdefault((r[y_key], r["length"]), []).append(float(r[score_key]))
    grid = [[sum(cells[(y, n)]) / len(cells[(y, n)]) if (y, n) in cells else float("nan") for n in lengths] for y in ys]
    mean = sum(float(r[score_key]) for r in rows) / len(rows)
    fig, ax = plt.subplots(figsize=(max(6.5, 0.55 * len(lengths) + 3), max(3.5, 0.4 * len(ys) + 2)))
    im = ax.imshow(grid, cmap=NEEDLE_CMAP, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_k(n) for n in lengths], rotation=45 if len(lengths) > 8 else 0)
    ax.set_yticks(range(len(ys)), [f"{d:g}" for d in ys])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\nmean {what or score_key} {mean:.3f} over {len(rows)} record(s)", fontsize=10)
    if len(lengths) * len(ys) <= 150:
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="black")
    fig.colorbar(im, ax=ax, label=what or score_key)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def needle_heatmap(rows: list[dict], path: Path, *, title: str, score_key: str = "score") -> Path | None:
    """The original needle test's heatmap: depth x length."""
    return grid_heatmap(rows, path, title=title, score_key=score_key)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", ":", "-.")


def series_styles(n: int) -> list[dict]:
    """`n` distinct line styles: colours of tab10 (tab20 past 10 series), each with its own marker, and past
    20 series a line style as well, so no two series share colour, marker and line style."""
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    colours = cmap.N
    return [{"color": cmap(i % colours), "marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[(i // colours) % len(LINESTYLES)]}
            for i in range(n)]


def line_figure(series: dict[str, list[tuple[float, float]]], *, title: str, xlabel: str, ylabel: str, logx: bool = False):
    """The figure of `line_plot` (not saved): one line per label, each its own colour and marker, the legend
    to the right of the axes (never over the data)."""
    drawn = {label: sorted(p for p in points if p[1] is not None) for label, points in sorted(series.items())}
    drawn = {label: points for label, points in drawn.items() if points}
    fig, ax = plt.subplots(figsize=(6 + (3.5 if drawn else 0), max(4.0, 0.22 * len(drawn) + 1)))
    for (label, points), style in zip(drawn.items(), series_styles(len(drawn))):
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label, markersize=5, **style)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    return fig


def line_plot(series: dict[str, list[tuple[float, float]]], path: Path, *, title: str, xlabel: str, ylabel: str,
              logx: bool = False) -> Path:
    """One line per label; `series[label]` is a list of (x, y). See `line_figure`."""
    fig = line_figure(series, title=title, xlabel=xlabel, ylabel=ylabel, logx=logx)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _k(n: int) -> str:
    return f"{n / 1024:g}K" if n % 256 == 0 and n >= 1024 else str(n)
