"""Figures and the report section of the observation experiments (SnapKV Figures 2-5).

The task calls `observation_figures` for each run directory; `python -m harness.report` calls `tables(runs, out,
options)` (`observation_section`), which redraws the figures from each run's results.json (no torch, no model) and
writes `observation.md|csv` and `observation/` into the table set. The section owns those names only and removes
them before writing.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless, deterministic
import matplotlib.pyplot as plt  # noqa: E402

from harness.tables import Tables, _fmt, _safe, clean, markdown_table, write_csv  # noqa: E402
from harness.results import finished  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


OBS_FILES = ("observation.md", "observation.csv")
OUTPUT_FILES, OUTPUT_DIRS = OBS_FILES, ("observation",)


def _fmt3(v) -> str:  # these tables show 3 decimals
    return _fmt(v, 3)


# ------------------------------------------------------------------------------------------ figures

def _layer_lines(ax, arrays: list, xs: list, chance: float | None) -> None:
    """One line per layer (colour = depth), x = window index: the paper's layout."""
    n = len(arrays)
    cmap = plt.get_cmap("viridis")
    for i, row in enumerate(arrays):
        if not row:
            continue
        pts = [(x, y) for x, y in zip(xs, row) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=cmap(i / max(1, n - 1)), lw=1.1, alpha=0.9)
    if chance is not None:
        ax.axhline(chance, color="gray", ls=":", lw=1, label=f"random selection ({chance:.3f})")
        ax.legend(fontsize=7, loc="lower right")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, max(1, n - 1)))
    ax.figure.colorbar(sm, ax=ax, label="layer")
    ax.set_ylim(0, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def observation_figures(summary: dict, folder: Path, *, title: str) -> list[Path]:
    """observation_fig2..5.png in `folder` from a run's summary; returns the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    p = summary.get("parameters") or {}
    chance = summary.get("chance")
    written = []
    fig2 = summary.get("fig2_hit_rate")
    if fig2 and any(fig2):
        n = len(next(r for r in fig2 if r))
        fig, ax = plt.subplots(figsize=(6.4, 4))
        _layer_lines(ax, fig2, list(range(1, n + 1)), chance)
        ax.set_xlabel(f"prompt window (of {p.get('window_tokens')} tokens; {n} = last, just before generation)")
        ax.set_ylabel("hit rate")
        ax.set_title(f"{title}\nFig. 2: each prompt window's selection vs what generation attends to", fontsize=9)
        written.append(_save(fig, folder / "observation_fig2.png"))
    fig3 = summary.get("fig3_hit_rate")
    if fig3 and any(fig3):
        m = len(next(r for r in fig3 if r))
        fig, ax = plt.subplots(figsize=(6.4, 4))
        _layer_lines(ax, fig3, list(range(1, m + 1)), chance)
        ax.set_xticks(range(1, m + 1))
        ax.set_xlabel(f"generation window (of {p.get('generation_window_tokens')} generated tokens)")
        ax.set_ylabel("hit rate")
        ax.set_title(f"{title}\nFig. 3: generation windows vs the last prompt window's selection", fontsize=9)
        written.append(_save(fig, folder / "observation_fig3.png"))
    fig4 = summary.get("fig4_hit_rate")
    if fig4:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        layers = list(range(len(fig4)))
        for name, arr in sorted((summary.get("fig4_pairs") or {}).items()):
            ax.plot(layers, [None if v is None else v for v in arr], lw=0.8, alpha=0.6, label=f"pair {name}")
        ax.plot(layers, fig4, color="black", lw=2, label="mean (last prompt windows)")
        gen = summary.get("fig4_generation_hit_rate")
        if gen:
            ax.plot(layers, gen, color="black", lw=1.5, ls="--", label="mean (whole responses)")
        if chance is not None:
            ax.axhline(chance, color="gray", ls=":", lw=1, label="random selection")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("layer")
        ax.set_ylabel("hit rate between selections")
        ax.set_title(f"{title}\nFig. 4: same document, different instructions", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, folder / "observation_fig4.png"))
    fig5 = summary.get("fig5_hit_rate") or {}
    if fig5:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for pos, arr in fig5.items():
            ax.plot(range(len(arr)), arr, marker="o", ms=3, label=f"instruction at the {'end' if pos == 'end' else 'beginning'}")
        if chance is not None:
            ax.axhline(chance, color="gray", ls=":", lw=1, label="random selection")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("layer")
        ax.set_ylabel("hit rate (last prompt window)")
        ax.set_title(f"{title}\nFig. 5: instruction position", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, folder / "observation_fig5.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ report sections

def observation_section(runs, out: Path) -> str:
    """observation.md|csv and observation/<run>/observation_fig*.png for every task=observation run; the
    Markdown (empty when there is none)."""
    out = Path(out)
    clean(out, OBS_FILES, ("observation",))
    rows = []
    for run in finished(runs, "observation"):
        s = run.data.get("summary") or {}
        p = s.get("parameters") or {}
        task = (run.data.get("config") or {}).get("task") or {}
        folder = out / "observation" / _safe(run.rel)
        figs = observation_figures(s, folder, title=f"{run.model.get('name', '?')} · {task.get('source')}")
        fig5 = s.get("fig5_mean") or {}
        rows.append({
            "model": run.model.get("name"), "source": str(task.get("source")) + (f":{task.get('dataset')}" if task.get("source") == "longbench" else ""),
            "preset": task.get("preset"), "window_tokens": p.get("window_tokens"), "prompt_windows": p.get("prompt_windows"),
            "generation": f"{p.get('generation_windows')}x{p.get('generation_window_tokens')}", "theta": p.get("theta"),
            "rate_p": p.get("rate_p"), "layers": s.get("layers"), "documents": s.get("documents"), "prompts": s.get("prompts"),
            "last_window_mean": s.get("last_window_mean"), "first_window_mean": s.get("first_window_mean"),
            "last_window_min": (s.get("last_window_range") or [None, None])[0],
            "last_window_max": (s.get("last_window_range") or [None, None])[1],
            "layers_best_at_last": s.get("layers_best_at_last_window"), "fig3_mean": s.get("fig3_mean"),
            "fig4_mean": s.get("fig4_mean"), "fig4_generation_mean": s.get("fig4_generation_mean"),
            "fig5_end": fig5.get("end"), "fig5_begin": fig5.get("begin"), "chance": s.get("chance"),
            "device": run.device, "figures": " ".join(str(f.relative_to(out)) for f in figs), "run": run.rel,
        })
        run.used_in.append("observation")
    if not rows:
        return ""
    fields = list(rows[0])
    write_csv(out / "observation.csv", rows, fields)
    headers = ["Model", "Source", "w / N / G", "θ / p", "Prompts", "Last window", "First window", "Last, layer range",
               "Layers best at last", "Fig. 3", "Fig. 4 (windows / responses)", "Fig. 5 (end / begin)", "Random"]
    body = [[r["model"], r["source"], f"{r['window_tokens']} / {r['prompt_windows']} / {r['generation']}",
             f"{r['theta']} / {r['rate_p']}", r["prompts"], _fmt3(r["last_window_mean"]), _fmt3(r["first_window_mean"]),
             f"{_fmt3(r['last_window_min'])}–{_fmt3(r['last_window_max'])}", f"{r['layers_best_at_last']} of {r['layers']}",
             _fmt3(r["fig3_mean"]), f"{_fmt3(r['fig4_mean'])} / {_fmt3(r['fig4_generation_mean'])}",
             f"{_fmt3(r['fig5_end'])} / {_fmt3(r['fig5_begin'])}", _fmt3(r["chance"])] for r in rows]
    lines = ["## Observation experiments (SnapKV Figures 2-5)", "", markdown_table(headers, body), "",
             "- Hit rate (the paper's Eq. 8): of the prefix positions a generated query attends to above θ, the share a "
             "window's top-p selection holds; means over layers, generated queries and prompts (per-layer arrays in "
             "results.json and the figures). Random: the expected hit rate of a random selection of the same size.",
             "- Last / first window: Fig. 2's hit rate of the last prompt window (just before generation) and of the "
             "earliest of the N; layers best at last: layers whose best window is the last. Fig. 3: generation windows "
             "vs the last prompt window. Fig. 4: overlap of the selections of different instructions on the same "
             "document. Fig. 5: the last window's hit rate with the instruction at the end / the beginning.", ""]
    for r in rows:
        lines.append(f"- `{r['run']}`: " + ", ".join(f"![{Path(f).stem}]({f})" for f in r["figures"].split()))
    md = "\n".join(lines) + "\n"
    (out / "observation.md").write_text(md, encoding="utf-8")
    return md


def report_sections(runs, out: Path) -> list[tuple[str, str]]:
    """[("observation.md", Markdown)] when there are observation runs, else []."""
    md = observation_section(runs, out)
    return [("observation.md", md)] if md else []


def tables(runs, out: Path, options) -> Tables:
    return Tables(report_sections(runs, out))
