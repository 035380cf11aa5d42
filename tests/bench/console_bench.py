"""The console's pages with a large fleet and a long history, in Debian's chromium.

An ``iop control-plane`` with 1,000 registered nodes (the simulator of ``fleet_bench.py``: each
node its own certificate and mTLS connection, in this process) and a ledger of 100,000 runs over
the last 30 days (four keys, the fleet's models and nodes; written before the control-plane
starts, through its store's own write path, ``AuditStore.run_ended``, which also keeps the usage
rollups), an ``iop edge`` in front, and chromium driven by playwright. Each row opens the page
afresh in a new tab (signed in: the key and who it is in sessionStorage, as a sign-in leaves
them; the page checks the key again beside its data) and reads the page's own performance
marks: from the navigation's start to the frame after the first rows were put in the DOM
(``iop:<page>:painted``; a page puts 100 rows at once, then the rest in the next frame), with when
the API's answer had arrived and when every row was in (``iop:<page>:complete``).

- Runs: ``#/runs?limit=500``, the newest 500 runs of 100,000 (the API's largest page).
- Usage: ``#/usage?range=30d&bucket=hour``, 30 days by hour per key and model (chart and table).
- Nodes: ``#/nodes``, 1,000 rows.

Then the usage APIs the page and OpenAI's clients call, timed from a client process: 30 days by
hour per key and model (``/console/api/usage``, what the Usage page reads) and OpenAI's
``/v1/organization/usage/completions`` by day.

Target: under 1 s each. Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
import yaml
from control_plane_bench import IOP, _wait_ready
from edge_bench import _until_ready
from fleet_bench import MODELS, NODES, SimNode, _all_registered, _mint, _quiet_resets, _start_cp
from playwright.async_api import Browser, async_playwright
from table import print_table

from iop_control_plane.ledger import Attempt, LedgerEntry
from iop_control_plane.store import AuditStore
from iop_edge.keys import create_key
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir, tls_section
from iop_wire.logs import configure

RUNS = int(os.environ.get("IOP_CONSOLE_RUNS", "100000"))
"""Runs in the ledger (``IOP_CONSOLE_RUNS`` sets another count for a quick look)."""
DAYS = 30
KEYS = ("team-a", "team-b", "team-c", "batch")
TIMES = 5
"""Loads of each page; the table shows the median and the slowest."""
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PAGES = {
    "runs": ("#/runs?limit=500", "#rows tr"),
    "usage": ("#/usage?range=30d&bucket=hour", "#rows tr"),
    "nodes": ("#/nodes", "#rows tr"),
}
"""Page -> its address after /console, and the rows it renders (counted to check it is all there)."""
ASKS = 20
"""Requests timed per usage API row."""
_ASK = """
import json, sys, time, urllib.request
url, key, times = sys.argv[1], sys.argv[2], int(sys.argv[3])
took, size = [], 0
for _ in range(times + 1):  # the first warms the path, untimed
    began = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"authorization": f"Bearer {key}"})) as answer:
        body = json.loads(answer.read())
    took.append((time.perf_counter() - began) * 1e3)
    size = len(body.get("rows") or [r for bucket in body.get("data", []) for r in bucket["results"]])
print(json.dumps({"took": took[1:], "rows": size}))
"""
"""Times ``times`` GETs of a URL from a process of its own (not this one's loop, busy with 1,000 nodes)."""


async def _seed_ledger(path: Path) -> None:
    """RUNS runs spread over the last DAYS days, written as the control-plane's ledger writes them."""
    store = AuditStore(path, backlog=RUNS + 1, max_runs=RUNS * 2)
    await store.open()
    pick = random.Random(24)
    now, span = time.time(), DAYS * 86400
    for n in range(RUNS):
        index = pick.randrange(NODES)
        model = "fast" if n % 2 else f"m{index % MODELS}"
        entry = LedgerEntry(f"run-{n:07d}", "edge-1", "c0ffee", KEYS[n % len(KEYS)], model)
        entry.received_at = now - span * (RUNS - n) / RUNS
        duration = pick.uniform(0.2, 4.0)
        entry.received = time.monotonic() - duration
        entry.first_output = entry.received + pick.uniform(0.01, 0.3)
        outcome = "completed" if n % 50 else "failed"
        entry.attempts.append(
            Attempt(f"node-{index:04d}", model, entry.received, outcome=outcome, ended=entry.received + duration)
        )
        usage = pb.Usage(prompt_tokens=pick.randrange(20, 2000), completion_tokens=pick.randrange(10, 800))
        if outcome == "completed":
            entry.ending(pb.RunEvent(complete=pb.RunComplete(finish_reason=pb.FINISH_REASON_STOP, usage=usage)))
        else:
            error = pb.Error(code=pb.ERROR_CODE_NODE_LOST, message="the node was lost", usage=usage)
            entry.ending(pb.RunEvent(error=error))
        store.run_ended(entry)
        if n % 1000 == 999:
            await asyncio.sleep(0)  # the writer commits as it goes
    await store.aclose()


def _start_edge(state: Path, cp_port: int) -> tuple[subprocess.Popen[bytes], int, str]:
    """An ``iop edge`` on the control-plane, and an admin key."""
    edge = {
        "http": {"port": 0},
        "control_plane": {"address": f"127.0.0.1:{cp_port}", "server_name": "localhost"},
        "tls": tls_section(state / "certs", "edge"),
        "auth": "keys",
        "keys_path": str(state / "keys.db"),
        "log_level": "warning",
    }
    (state / "edge.yaml").write_text(yaml.safe_dump(edge))
    key = create_key(state / "keys.db", "bench", admin=True)
    ready = state / "edge.ready"
    command = [*IOP, "edge", "--config", str(state / "edge.yaml"), "--ready-file", str(ready)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port = int(_wait_ready(ready, process)["port"])
    _until_ready(port)
    return process, port, key


_MARKS = """name => {
  const mark = (what) => performance.getEntriesByName(`iop:${name}:${what}`)[0]?.startTime ?? null;
  const api = performance.getEntriesByType("resource").filter((r) => r.name.includes(`/console/api/${name}`));
  return {
    painted: mark("painted"), dom: mark("dom"), complete: mark("complete"),
    api: api.length ? api[api.length - 1].responseEnd : null,
  };
}"""


async def _load(browser: Browser, base: str, key: str, name: str) -> dict[str, Any]:
    """Open the page in a new tab; its marks (ms from the navigation's start) and rows rendered."""
    address, rows = PAGES[name]
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    who = json.dumps({"key": "bench", "admin": True, "auth": "keys", "edge": "bench"})
    signed_in = f"sessionStorage.setItem('iop.console.key', {json.dumps(key)});"
    await context.add_init_script(f"{signed_in} sessionStorage.setItem('iop.console.me', {json.dumps(who)})")
    page = await context.new_page()
    try:
        await page.goto(f"{base}/console{address}")
        # Polled with evaluate (wait_for_function's predicate is an eval, which the page's CSP forbids);
        # the marks, not this loop, time the page.
        painted = "name => ['painted', 'complete'].every(m => performance.getEntriesByName(`iop:${name}:${m}`).length)"
        deadline = time.monotonic() + 60
        while not await page.evaluate(painted, name):
            if time.monotonic() > deadline:
                said = await page.locator("main, #toasts").all_inner_texts()
                raise RuntimeError(f"the {name} page did not render in 60 s: {said}")
            await asyncio.sleep(0.05)
        marks: dict[str, Any] = await page.evaluate(_MARKS, name)
        marks["rows"] = await page.locator(rows).count()
        return marks
    finally:
        await context.close()


def _ask(base: str, key: str, path: str, what: str) -> tuple[str, str]:
    """A usage API row: p50 / p95 of ASKS answers, JSON read, from a client process."""
    command = [sys.executable, "-c", _ASK, f"{base}{path}", key, str(ASKS)]
    answered = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    took = answered["took"]
    p95 = statistics.quantiles(took, n=20)[-1]
    return f"{what} ({answered['rows']:,} rows), p50 / p95 of {ASKS}", f"{statistics.median(took):.0f} / {p95:.0f} ms"


def _row(what: str, loads: list[dict[str, Any]]) -> tuple[str, str]:
    painted = [load["painted"] for load in loads]
    middle = sorted(loads, key=lambda load: load["painted"])[len(loads) // 2]
    return (
        f"{what}: navigation -> first rows painted, median of {len(loads)} (slowest); in the median: the API's"
        f" answer in, all {middle['rows']:,} rows in the DOM",
        f"{statistics.median(painted):.0f} ms ({max(painted):.0f}); {middle['api']:.0f}, {middle['complete']:.0f} ms",
    )


async def _rows(state: Path) -> list[tuple[str, str]]:
    asyncio.get_running_loop().set_exception_handler(_quiet_resets)
    began = time.perf_counter()
    await _seed_ledger(state / "cp.db")
    seeded = time.perf_counter() - began
    cp, info = _start_cp(state, 0)
    processes = [cp]
    fleet = [SimNode(index, int(info["port"]), state / "certs") for index in range(NODES)]
    try:
        since = time.perf_counter()
        for node in fleet:
            node.link.start()
        await _all_registered(fleet, since)
        edge, port, key = await asyncio.to_thread(_start_edge, state, int(info["port"]))
        processes.append(edge)
        base = f"http://127.0.0.1:{port}"
        rows = [(f"ledger seeded: {RUNS:,} runs over {DAYS} days (AuditStore.run_ended)", f"{seeded:.1f} s")]
        async with async_playwright() as driver:
            browser = await driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            what = {
                "runs": f"Runs page, 500 newest of {RUNS:,} runs",
                "usage": f"Usage page, {DAYS} days by hour, {len(KEYS)} keys x {MODELS + 1} models",
                "nodes": f"Nodes page, {NODES:,} nodes",
            }
            for name in PAGES:
                await _load(browser, base, key, name)  # warm: the modules cached, as for someone coming back
                loads = [await _load(browser, base, key, name) for _ in range(TIMES)]
                rows.append(_row(what[name], loads))
            await browser.close()
        end = int(time.time())
        start = end - DAYS * 86400
        usage = f"/console/api/usage?bucket=hour&start={start}&end={end}"
        openai = f"/v1/organization/usage/completions?start_time={start}&bucket_width=1d&limit=31"
        openai += "&group_by=api_key_id&group_by=model"
        for path, what in (
            (usage, f"GET /console/api/usage, {DAYS} days by hour by key and model"),
            (openai, f"GET /v1/organization/usage/completions, {DAYS} days by day by key and model"),
        ):
            rows.append(await asyncio.to_thread(_ask, base, key, path, what))
        return rows
    finally:
        for node in fleet:
            await node.stop()
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


def main() -> None:
    configure("error")
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        init_dir(state / "certs")
        _mint(state / "certs")
        rows = uvloop.run(_rows(state))
    print(f"{NODES:,} simulated nodes and chromium on 2 shared cores; the pages' own performance marks")
    print_table(rows)


if __name__ == "__main__":
    main()
