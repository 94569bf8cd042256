"""A real browser for the report tests: Debian's Chromium (/usr/bin/chromium, or $FORKRL_CHROMIUM) driven by
Playwright's Python package (its own browser download is never used).

    with open_page(tmp_path) as watch:
        page = watch.open(path_to_html)          # file:// URL
        ...                                       # page: a playwright Page
        watch.console_errors, watch.requests      # every console error / page error, every request made

Headless as root needs no sandbox, no GPU, and none of Chromium's own background traffic (the machine's
network is closed: each attempt would be a refused connection); the profile is a new empty folder under the
test's tmp dir. Every request that is not file:// is recorded and aborted, so nothing leaves the machine even
when a page tries.

When Chromium or the playwright package is missing the tests skip, except in CI (CI=true), where they fail:
scripts/test.sh installs Chromium there, as root, from the OS packages.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("FORKRL_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def _unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: the browser tests must run in CI (scripts/test.sh installs chromium as root)")
    pytest.skip(why)


@dataclass
class PageWatch:
    context: Any
    console: list[tuple[str, str]] = field(default_factory=list)  # (type, text) of every console message
    page_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the pages asked for
    blocked: list[str] = field(default_factory=list)  # the ones that were not file:// (aborted)

    @property
    def console_errors(self) -> list[str]:
        return [f"{t}: {text}" for t, text in self.console if t == "error"] + self.page_errors

    def open(self, path: Path, viewport: tuple[int, int] = (1400, 1000)) -> Any:
        page = self.context.new_page()
        page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
        page.on("console", lambda m: self.console.append((m.type, m.text)))
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        page.goto(Path(path).resolve().as_uri(), wait_until="load")
        return page


@contextlib.contextmanager
def open_page(tmp_path: Path) -> Iterator[PageWatch]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        _unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set FORKRL_CHROMIUM)")
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                       args=ARGS)
        watch = PageWatch(context)
        context.on("request", lambda r: watch.requests.append(r.url))

        def block(route: Any) -> None:
            watch.blocked.append(route.request.url)
            route.abort()

        context.route(re.compile(r"^(?!file:)"), block)
        try:
            yield watch
        finally:
            context.close()
