"""Open a report.html in headless Chromium: how long it takes to draw, the console's errors, screenshots.

    python -m harness.report.browser <report.html> [--screenshot page.png] [--item item.png]

Needs Debian's `chromium` and `chromium-driver` (scripts/setup.sh installs them where apt is available) and
selenium (the `test` extra). The browser test (tests/test_report_html.py) and the committed screenshots use it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)
WIDTH, HEIGHT = 1400, 1000


def missing() -> str | None:
    """Why no headless browser can run here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if not any(shutil.which(b) for b in BROWSERS):
        return "no Chromium (apt-get install chromium chromium-driver; scripts/setup.sh does where apt is available)"
    if not any(shutil.which(d) for d in DRIVERS):
        return "no chromedriver (apt-get install chromium-driver)"
    return None


def start(width: int = WIDTH, height: int = HEIGHT):
    """A headless Chromium driven through chromedriver, with the browser's console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=next(shutil.which(d) for d in DRIVERS if shutil.which(d)))
    return webdriver.Chrome(options=options, service=service)


def open_page(driver, path: Path, timeout: float = 60.0) -> float:
    """Load the page and wait until its script has drawn it (body[data-ready]); returns the seconds it took."""
    from selenium.webdriver.support.ui import WebDriverWait

    t0 = time.perf_counter()
    driver.get(Path(path).resolve().as_uri())
    WebDriverWait(driver, timeout).until(lambda d: d.execute_script("return document.body.getAttribute('data-ready')") == "1")
    return time.perf_counter() - t0


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def save_png(driver, target: Path) -> None:
    """The window as a 256-colour PNG (a page of text and flat colours: a third of the size, as readable)."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(target, optimize=True)


def full_screenshot(driver, target: Path, max_height: int = 12000) -> None:
    """The whole page (up to max_height pixels) as one PNG."""
    height = min(max_height, int(driver.execute_script("return document.documentElement.scrollHeight")))
    driver.set_window_size(WIDTH, height)
    save_png(driver, target)
    driver.set_window_size(WIDTH, HEIGHT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.report.browser", description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("--screenshot", type=Path, help="the whole page as PNG")
    parser.add_argument("--item", type=Path, help="the item view of the first heatmap cell, task score or table row, as PNG")
    args = parser.parse_args(argv)
    why = missing()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    driver = start()
    try:
        seconds = open_page(driver, args.page)
        size = args.page.stat().st_size
        print(f"{args.page}: {size / 2**20:.2f} MiB, drawn in {seconds:.2f} s (headless Chromium, file:// load included)")
        if args.screenshot:
            full_screenshot(driver, args.screenshot)
        if args.item:
            driver.execute_script("""const c = document.querySelector('.heat .cell') || document.querySelector('td.cellitems')
                                               || document.querySelector('main section:not(#overview) tr.clickable');
                                     c.dispatchEvent(new MouseEvent('click', {bubbles: true}));
                                     const a = document.querySelector('#drawer a[data-item]'); if (a) a.click();""")
            for _ in range(3):  # the whole drawer (its height settles as the window grows)
                height = int(driver.execute_script("return document.getElementById('drawer').scrollHeight"))
                driver.set_window_size(WIDTH, min(2000, max(HEIGHT, height + 140)))  # long lists: their top
            save_png(driver, args.item)
        errors = console_errors(driver)
        for e in errors:
            print(f"console error: {e}", file=sys.stderr)
        return 1 if errors else 0
    finally:
        driver.quit()


if __name__ == "__main__":
    sys.exit(main())
