"""The web chat page in headless Chromium, driven over the DevTools protocol (a tiny CDP client on
the `websockets` package): load the page, send a message, see the streamed answer and its
TTFT/tok/s, stop a long answer, keep the conversation; a page of another origin is refused.
A screenshot is saved ($EDGEINFER_SCREENSHOT_DIR, else the test's tmp dir). Skipped without
/usr/bin/chromium; .ci/run installs it (apt-get install chromium chromium-driver)."""

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from echo_engine import EchoEngine
from websockets.asyncio.client import connect as ws_connect

from transport.server import Server, ServerConfig

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOKEN = "browser-test-token-0123456789"

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed")]


class Page:
    """Just enough CDP: call a method and wait for its answer; evaluate JavaScript."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params):
        call_id = next(self.ids)
        await self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == call_id:
                assert "error" not in message, message
                return message["result"]

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 20.0):
        deadline = asyncio.get_running_loop().time() + timeout_s
        # Until navigation commits, the old page (about:blank) lacks the elements: not yet, not an error.
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return false; }} }})()"
        while True:
            value = await self.js(guarded)
            if value:
                return value
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for: {expression}"
            await asyncio.sleep(0.1)


async def launch_chromium(profile: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
         "--remote-debugging-port=0", "--window-size=1000,800", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while loop.time() < deadline:
        line = await asyncio.to_thread(proc.stderr.readline)
        match = re.search(r"DevTools listening on (ws://127\.0\.0\.1:(\d+)/\S+)", line)
        if match:
            return proc, match.group(2)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("chromium did not start its DevTools endpoint")


async def page_ws_url(devtools_port: str) -> str:
    def fetch() -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{devtools_port}/json/list", timeout=10) as response:
            return json.loads(response.read())

    return next(t["webSocketDebuggerUrl"] for t in await asyncio.to_thread(fetch) if t["type"] == "page")


async def serve_html(html: str) -> asyncio.Server:
    """A one-page HTTP server on a free loopback port: the 'other site' in a hijack attempt."""
    body = html.encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


def test_chat_page_streams_stops_and_refuses_foreign_pages(tmp_path):
    shots = Path(os.environ.get("EDGEINFER_SCREENSHOT_DIR", tmp_path))

    async def main():
        engine = EchoEngine(token_delay_s=0.01)
        config = ServerConfig(token=TOKEN, port=0)
        async with Server(engine, config, "echo") as server:
            proc, devtools_port = await launch_chromium(tmp_path / "profile")
            try:
                async with ws_connect(await page_ws_url(devtools_port), max_size=None) as ws:
                    page = Page(ws)
                    await page.call("Page.enable")
                    base = f"http://127.0.0.1:{server.port}/"
                    await page.call("Page.navigate", url=f"{base}#token={TOKEN}")
                    await page.wait_for("document.getElementById('conn-state').textContent.startsWith('connected')")
                    assert await page.js("location.hash") == ""  # the token left the address bar

                    await page.js("document.getElementById('input').value = 'hello from chromium';"
                                  "document.getElementById('max-tokens').value = '12';"
                                  "document.getElementById('send').click()")
                    await page.wait_for("document.querySelector('.msg.assistant')?.dataset.state === 'length'")
                    answer = await page.js("document.querySelector('.msg.assistant .body').textContent")
                    assert answer == "hello from chromium hello from chromium hello from chromium hello from chromium"
                    stats = await page.js("document.getElementById('stats').textContent")
                    assert re.match(r"TTFT \d+ ms · [\d.]+ tok/s · 12 tokens", stats), stats

                    # A long answer, stopped with the Stop button: the stream ends, the text stays.
                    await page.js("document.getElementById('input').value = 'tell me more';"
                                  "document.getElementById('max-tokens').value = '2000';"
                                  "document.getElementById('send').click()")
                    await page.wait_for("document.querySelectorAll('.msg.assistant')[1]?.textContent.length > 20")
                    await page.js("document.getElementById('stop').click()")
                    await page.wait_for("document.querySelectorAll('.msg.assistant')[1].dataset.state === 'cancelled'")
                    await asyncio.sleep(0.1)
                    assert engine._running == 0 and engine.num_free_blocks == engine.num_blocks
                    shot = await page.call("Page.captureScreenshot", format="png")
                    (shots / "chat_page.png").write_bytes(base64.b64decode(shot["data"]))

                    # The conversation is kept: the next request carries all four earlier turns.
                    await page.js("document.getElementById('input').value = 'third';"
                                  "document.getElementById('max-tokens').value = '2';"
                                  "document.getElementById('send').click()")
                    await page.wait_for("document.querySelectorAll('.msg.assistant')[2]?.dataset.state === 'length'")
                    assert await page.js("conversation.length") == 6

                    # A page of another origin (another local web server here) cannot use the socket.
                    script = (f"<script>const w = new WebSocket('ws://127.0.0.1:{server.port}/ws');"
                              "w.onopen = () => document.title = 'open';"
                              "w.onerror = () => document.title = 'refused';</script>")
                    foreign = await serve_html(script)
                    foreign_port = foreign.sockets[0].getsockname()[1]
                    await page.call("Page.navigate", url=f"http://127.0.0.1:{foreign_port}/")
                    assert await page.wait_for("document.title") == "refused"
                    assert server.counters["refused_origin"] == 1
                    foreign.close()
            finally:
                proc.kill()
                proc.wait()

    asyncio.run(asyncio.wait_for(main(), 120))
    assert (shots / "chat_page.png").stat().st_size > 5000
