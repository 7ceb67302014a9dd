"""Pictures: the needle heatmap in the original test's style, and line plots for the benchmark."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless, deterministic
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402

# The original needle test's colours: red -> yellow -> green.
NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


def needle_heatmap(rows: list[dict], path: Path, *, title: str, score_key: str = "score") -> Path | None:
    if not rows:
        return None
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = [[float("nan")] * len(lengths) for _ in depths]
    for r in rows:
        grid[depths.index(r["depth"])][lengths.index(r["length"])] = float(r[score_key])
    mean = sum(float(r[score_key]) for r in rows) / len(rows)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(lengths) + 3), max(3.5, 0.4 * len(depths) + 2)))
    im = ax.imshow(grid, cmap=NEEDLE_CMAP, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_k(n) for n in lengths], rotation=45 if len(lengths) > 8 else 0)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("Token Limit")
    ax.set_ylabel("Depth Percent")
    ax.set_title(f"{title}\nmean {score_key} {mean:.3f} over {len(rows)} cells", fontsize=10)
    if len(lengths) * len(depths) <= 120:
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="black")
    fig.colorbar(im, ax=ax, label=score_key)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def line_plot(series: dict[str, list[tuple[float, float]]], path: Path, *, title: str, xlabel: str, ylabel: str,
              logx: bool = False) -> Path:
    """One line per label; `series[label]` is a list of (x, y)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in sorted(series.items()):
        points = sorted(p for p in points if p[1] is not None)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _k(n: int) -> str:
    return f"{n / 1024:g}K" if n % 256 == 0 and n >= 1024 else str(n)
