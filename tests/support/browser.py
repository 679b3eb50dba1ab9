"""A real headless Chromium driven over the DevTools protocol (a websocket, with aiohttp).

`scripts/install-browser.sh` puts Debian's chromium under .cache/tools; CACHEWITNESS_CHROMIUM
names another binary. A page is opened with the console, the log, the network and runtime
exceptions watched, so a test sees every error the page causes and every request it makes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["BrowserPage", "chromium_binary", "open_page"]

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0  # first start on a loaded 2-core machine (measured 3-5 s idle)
CALL_TIMEOUT_S = 30.0


def chromium_binary() -> str | None:
    """CACHEWITNESS_CHROMIUM, else the installed wrapper, else `chromium` on PATH; None when none."""
    named = os.environ.get("CACHEWITNESS_CHROMIUM")
    if named:
        return named
    wrapper = REPO / ".cache" / "tools" / "bin" / "chromium"
    if wrapper.exists():
        return str(wrapper)
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class BrowserPage:
    """One page under DevTools control, and what it did."""

    ws: aiohttp.ClientWebSocketResponse
    console: list[dict[str, Any]] = field(default_factory=list)  # Runtime.consoleAPICalled
    exceptions: list[dict[str, Any]] = field(default_factory=list)  # Runtime.exceptionThrown
    log_entries: list[dict[str, Any]] = field(default_factory=list)  # Log.entryAdded (CSP, loads)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _events: dict[str, asyncio.Event] = field(default_factory=dict)

    def errors(self) -> list[str]:
        """Every console error, uncaught exception and error-level log entry, as text."""
        found = [
            f"console.{c.get('type')}: {c.get('args')}"
            for c in self.console
            if c.get("type") in ("error", "assert", "warning")
        ]
        found += [f"exception: {e.get('exceptionDetails')}" for e in self.exceptions]
        found += [
            f"log {e['entry'].get('level')}: {e['entry'].get('text')} ({e['entry'].get('url')})"
            for e in self.log_entries
            if e["entry"].get("level") in ("error", "warning")
        ]
        return found

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and wait (bounded) for its result; events that come meanwhile are kept."""
        call_id = next(self._ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        async with asyncio.timeout(CALL_TIMEOUT_S):
            while True:  # bounded by the timeout
                message = await self.ws.receive_json()
                if message.get("id") == call_id:
                    if "error" in message:
                        raise RuntimeError(f"{method}: {message['error']}")
                    return dict(message.get("result", {}))
                self._event(message)

    def _event(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        params = message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            self.console.append(params)
        elif method == "Runtime.exceptionThrown":
            self.exceptions.append(params)
        elif method == "Log.entryAdded":
            self.log_entries.append(params)
        elif method == "Network.requestWillBeSent":
            self.requests.append(str(params.get("request", {}).get("url")))
        if isinstance(method, str):
            self._events.setdefault(method, asyncio.Event()).set()

    async def wait_event(self, method: str) -> None:
        """Read events until `method` has come (bounded)."""
        async with asyncio.timeout(CALL_TIMEOUT_S):
            while not self._events.get(method, asyncio.Event()).is_set():
                self._event(await self.ws.receive_json())

    async def load(self, url: str) -> None:
        """Navigate to `url` and wait for its load event, then let late console messages arrive."""
        await self.call("Page.navigate", url=url)
        await self.wait_event("Page.loadEventFired")
        await self.evaluate("1")  # a round trip: events sent before it are read by now

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (returned by value)."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page."""
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


async def _devtools_port(profile: Path, process: asyncio.subprocess.Process) -> int:
    """The port chromium wrote into DevToolsActivePort (bounded wait; fails if it died)."""
    marker = profile / "DevToolsActivePort"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    while loop.time() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"chromium exited with {process.returncode} before DevTools started")
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(marker.read_text().splitlines()[0])
        await asyncio.sleep(0.05)
    raise RuntimeError(f"chromium wrote no DevToolsActivePort within {START_TIMEOUT_S:g} s")


async def _page_target(http: aiohttp.ClientSession, port: int) -> str:
    """The websocket URL of the browser's first page target."""
    async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
        targets = await response.json()
    for target in targets:
        if target.get("type") == "page":
            return str(target["webSocketDebuggerUrl"])
    raise RuntimeError(f"no page target among {targets}")


@contextlib.asynccontextmanager
async def open_page(binary: str, width: int = 1200, height: int = 900) -> AsyncIterator[BrowserPage]:
    """A fresh headless chromium (own profile, no network proxy) with one watched blank page."""
    with tempfile.TemporaryDirectory(prefix="cachewitness-chromium-") as profile_dir:
        profile = Path(profile_dir)
        process = await asyncio.create_subprocess_exec(
            *[
                binary,
                "--headless",
                "--no-sandbox",  # a container's root has no user namespace for the sandbox
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port = await _devtools_port(profile, process)
            async with aiohttp.ClientSession() as http:
                ws_url = await _page_target(http, port)
                async with http.ws_connect(ws_url, max_msg_size=64 * 1024 * 1024) as ws:
                    page = BrowserPage(ws)
                    for domain in ("Page", "Runtime", "Log", "Network"):
                        await page.call(f"{domain}.enable")
                    yield page
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await asyncio.wait_for(process.wait(), 10)
