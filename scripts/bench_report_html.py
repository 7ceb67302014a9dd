"""How big report.html gets and how long it takes to build and to open, at the shape of a large run.

    python scripts/bench_report_html.py <runs folder> [--copies 5] [--work /tmp/report_scale]

Copies every run under <runs folder> into --work with each RULER sample (or needle cell) repeated --copies times
under new sample indices: a 1-sample-a-task RULER grid of 46 settings becomes the committed grid's shape (5
samples a task, 55 a setting). The copies are a size and speed test only: their scores are the originals'
repeated, never results (the folder is a scratch folder). Then builds the page (`harness.report.html`), and opens
it in headless Chromium (harness/report/browser.py): prints runs, records, items, file size, build and draw times.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def scale(src: Path, dst: Path, copies: int) -> int:
    """Copy the runs with every record repeated `copies` times (RULER: index + k * samples); returns the records."""
    if dst.exists():
        shutil.rmtree(dst)
    total = 0
    for path in sorted(src.rglob("results.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = [r for r in data.get("rows") or [] if isinstance(r, dict)]
        if data.get("task") == "ruler":
            samples = int((data.get("config") or {}).get("task", {}).get("samples") or 1)
            data["rows"] = [{**r, "index": int(r["index"]) + k * samples} for k in range(copies) for r in rows]
            data["config"]["task"]["samples"] = samples * copies
        elif data.get("task") == "needle":  # more lengths: the grid grows, each copy at its own length
            data["rows"] = [{**r, "length": int(r["length"]) + k} for k in range(copies) for r in rows]
        total += len(data.get("rows") or [])
        target = dst / path.parent.relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        (target / "results.json").write_text(json.dumps(data), encoding="utf-8")
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--copies", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/report_scale"))
    args = parser.parse_args(argv)
    from harness.results import collect
    from harness.report.browser import missing, open_page, start
    from harness.report.html import page_data, render

    runs_dir = args.work / "runs"
    records = scale(args.folder, runs_dir, args.copies)
    runs, _ = collect(runs_dir)
    t0 = time.perf_counter()
    data, _ = page_data(runs, runs_dir)
    page = args.work / "report.html"
    page.write_text(render(data), encoding="utf-8")
    built = time.perf_counter() - t0
    print(f"{len(runs)} runs, {records} records, {len(data['items'])} items: report.html {page.stat().st_size / 2**20:.2f} MiB, "
          f"built in {built:.1f} s")
    why = missing()
    if why:
        print(f"not opened: {why}")
        return 0
    driver = start()
    try:
        first = open_page(driver, page)
        again = open_page(driver, page)
        print(f"drawn in headless Chromium in {first:.2f} s (again: {again:.2f} s), file:// load and JSON parse included")
        t0 = time.perf_counter()
        driver.execute_script("document.querySelector('td.cellitems, .heat .cell').dispatchEvent(new MouseEvent('click', {bubbles: true}));"
                              "document.querySelector('#drawer a[data-item]').click();")
        rows = driver.execute_script("return document.querySelectorAll('#drawer table.items tbody tr').length")
        print(f"an item with {rows} settings opened in {time.perf_counter() - t0:.2f} s")
    finally:
        driver.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
