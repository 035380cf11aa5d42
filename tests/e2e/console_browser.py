"""Driving the console in Debian's chromium with Python playwright: the launch, and the page checks
the browser test and the render benchmark share (text contrast, screenshots).

No browser is downloaded: playwright drives ``/usr/bin/chromium`` (Debian's ``chromium`` package).
Both are skipped naming what is missing, and failed in CI (where ``IOP_BACKENDS_REQUIRED=1``).
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts" / "console"
"""Screenshots of every page, kept after the run (``.artifacts/`` is ignored by git)."""


def _missing(reason: str) -> NoReturn:
    """Skip (a module's tests when called at import), or fail in CI where nothing may be missing."""
    if os.environ.get("IOP_BACKENDS_REQUIRED") == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def sync_api() -> ModuleType:
    """``playwright.sync_api``; skipped (failed in CI) when playwright is not installed."""
    try:
        return importlib.import_module("playwright.sync_api")
    except ImportError as exc:
        missing = str(exc)
    _missing(f"playwright is not installed ({missing})")  # outside the except: no chained traceback


def chromium_path() -> str:
    """Debian's chromium; the test is skipped (failed in CI) when it is not installed."""
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found is None:
        _missing("chromium is not installed (Debian: apt-get install chromium)")
    return found


def launch(playwright: Any) -> Any:
    """A headless chromium (playwright's ``Browser``)."""
    return playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)


# Every element with text of its own, visible: its text colour against the first opaque background
# found walking up (semi-transparent ones blended on the way), WCAG's ratio, and whether the text is
# large (24 px, or 18.66 px bold), which needs 3 instead of 4.5. SVG text is coloured by `fill`.
CONTRAST_JS = """
() => {
  const parse = (c) => {
    const m = c.match(/rgba?\\(([^)]+)\\)/);
    if (!m) return null;
    const p = m[1].split(/[ ,/]+/).filter(Boolean).map(Number);
    return { r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1 };
  };
  const lum = ({ r, g, b }) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const over = (top, below) => ({
    r: top.r * top.a + below.r * (1 - top.a), g: top.g * top.a + below.g * (1 - top.a),
    b: top.b * top.a + below.b * (1 - top.a), a: 1,
  });
  const background = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c.a > 0) { layers.push(c); if (c.a >= 1) break; }
    }
    let bg = { r: 255, g: 255, b: 255, a: 1 };
    for (const layer of layers.reverse()) bg = over(layer, bg);
    return bg;
  };
  const out = [];
  for (const el of document.querySelectorAll("body *")) {
    const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.data.trim());
    if (!own) continue;
    const style = getComputedStyle(el);
    if (style.visibility !== "visible" || !el.getClientRects().length) continue;
    if (el.closest(".visually-hidden")) continue;
    const isSvg = el instanceof SVGElement;
    const fg = parse(isSvg ? style.fill : style.color);
    if (!fg) continue;
    const bg = background(isSvg ? el.closest("svg").parentElement : el);
    const l1 = lum(over(fg, bg)), l2 = lum(bg);
    const ratio = (Math.max(l1, l2) + 0.05) / (Math.min(l1, l2) + 0.05);
    const size = parseFloat(style.fontSize), bold = Number(style.fontWeight) >= 700;
    out.push({
      text: el.textContent.trim().slice(0, 40), tag: el.tagName, ratio: Math.round(ratio * 100) / 100,
      large: size >= 24 || (size >= 18.66 && bold),
    });
  }
  return out;
}
"""


def low_contrast(page: Any) -> list[dict[str, Any]]:
    """The visible text elements of the page below WCAG AA (4.5:1, 3:1 for large text)."""
    found: list[dict[str, Any]] = page.evaluate(CONTRAST_JS)
    assert found, "no text was measured"
    return [item for item in found if item["ratio"] < (3.0 if item["large"] else 4.5)]


def screenshot(page: Any, name: str) -> Path:
    """Save the page as ``.artifacts/console/<name>.png``."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path


def keep_failed_page(page: Any, name: str) -> Path:
    """Save a failed test's page: ``failed-<name>.png`` (all of it) and ``failed-<name>.txt`` (its
    address, then its text). Best effort: a page that cannot answer any more leaves what it could."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"failed-{name}.png"
    text = ARTIFACTS / f"failed-{name}.txt"
    try:
        text.write_text(f"{page.url}\n\n{page.inner_text('body')}\n")
        page.screenshot(path=str(path), full_page=True, timeout=5_000)
    except Exception as exc:  # noqa: BLE001 -- the test already failed: keep its own error, note this one
        with text.open("a") as out:
            out.write(f"\n(the page could not be saved: {exc})\n")
    return path
