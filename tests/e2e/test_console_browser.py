"""The console in a real browser: Debian's chromium driven by playwright against ``iop up``
(control-plane, node, worker, edge as processes) with a second node joined by ``iop join``.

An admin key made with ``iop keys create --admin`` signs in; the tests see both nodes, drain one,
chat in the playground while the answer streams (tokens/s shown as it grows), find that run in
Runs by its id and exactly its tokens in Usage, create and revoke a key, cancel a batch made with
the official SDK and download its output and error files, and measure the contrast of every
visible text on every page and of its dialogs, toasts and opened parts. Each page's main controls
are used with the keyboard alone (Tab, Enter, Escape; no click), the focus visible and kept after
each action. Every test fails on an error in the browser's console. Screenshots go to
``.artifacts/console/`` (the README's picture is ``overview.png``); a failed test leaves
``failed-<test>.png`` and ``.txt`` (the page's text) there.

The up node also serves ``mock-slow`` (20 tokens/s; added by ``iop nodes reload``) so that an
answer is seen growing and a batch is still running when it is cancelled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import yaml

from .conftest import wait_for
from .console_browser import keep_failed_page, launch, low_contrast, screenshot, sync_api

playwright_api = sync_api()  # skipped without playwright, failed in CI

pytestmark = pytest.mark.timeout(120)  # the module's platform and browser start inside the first test's time

IOP = [sys.executable, "-m", "iop_cli.main"]
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY", "IOP_CONTROL_PLANE")}
SLOW = {"model": "mock-slow", "adapter": "mock", "options": {"tokens": 400, "tokens_per_second": 20}}
PAGES = ("overview", "nodes", "runs", "usage", "keys", "batches", "playground")
LOADED = {
    "overview": "#models tr",
    "nodes": "#rows th",
    "runs": "#rows tr",
    "usage": "#total-completion",
    "keys": "#rows th",
    "batches": "#rows tr",
    "playground": "#p-model option",
}
"""What each page shows once its data came."""
STREAMING = re.compile(r"≈\d+ tokens · ≈[\d,.]+ tokens/s$")
"""The playground's figures while an answer streams: its chunks counted as tokens."""


def _iop(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=timeout, check=False, env=ENV)


@dataclass
class Platform:
    """``iop up``'s state folder, its edge and an admin key."""

    state: Path
    url: str
    """The edge's base, ``http://127.0.0.1:PORT``."""
    admin_name: str
    admin_key: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.admin_key, max_retries=0, timeout=30)


def _up_with_a_slow_model(state: Path) -> None:
    """``iop up``, then ``mock-slow`` added to its node's routes (``iop nodes reload``)."""
    started = _iop("up", "--dir", str(state), "--port", "0")
    assert started.returncode == 0, started.stdout + started.stderr
    node = state / "node.yaml"
    config = yaml.safe_load(node.read_text())
    config["routes"].append(SLOW)
    node.write_text(yaml.safe_dump(config, sort_keys=False))
    reloaded = _iop("nodes", "reload", "local-node", "--dir", str(state))
    assert reloaded.returncode == 0, reloaded.stdout + reloaded.stderr


def _join_second_node(state: Path, machine: Path) -> None:
    """``iop join`` of ``node-b`` (the mock models) from a state folder of its own."""
    token = _iop("join-token", "create", "--dir", str(state))
    assert token.returncode == 0, token.stderr
    join_args = token.stdout.split()[2:]
    joined = _iop("join", *join_args, "--name", "node-b", "--dir", str(machine))
    assert joined.returncode == 0, joined.stdout + joined.stderr


def _models(platform: Platform) -> set[str]:
    """The models the edge serves now (none while it cannot tell)."""
    answer = httpx.get(
        f"{platform.url}/v1/models", headers={"authorization": f"Bearer {platform.admin_key}"}, timeout=5
    )
    return {model["id"] for model in answer.json()["data"]} if answer.status_code == 200 else set()


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("console")
    state, machine = root / "state", root / "machine"
    try:
        _up_with_a_slow_model(state)
        _join_second_node(state, machine)
        created = _iop("keys", "create", "console-admin", "--admin", "--dir", str(state))
        assert created.returncode == 0, created.stderr
        secret = re.search(r"\bsk-\S+", created.stdout)
        assert secret, created.stdout
        port = json.loads((state / "edge.ready").read_text())["port"]
        platform = Platform(state, f"http://127.0.0.1:{port}", "console-admin", secret.group(0))
        wait_for(lambda: "mock-slow" in _models(platform), 30, 0.2, "the edge serving mock-slow")
        yield platform
    finally:
        if machine.exists():
            _iop("down", "--dir", str(machine))
        _iop("down", "--dir", str(state))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as driver:
        started = launch(driver)
        yield started
        started.close()


@dataclass
class Console:
    """One browser tab on the console, and what its console said."""

    page: Any
    platform: Platform
    errors: list[str]

    def open(self, name: str) -> Any:
        self.page.goto(f"{self.platform.url}/console#/{name}")
        self.page.locator("h1").filter(has_text=re.compile(name, re.IGNORECASE)).wait_for()
        return self.page

    def sign_in(self, key: str | None = None) -> None:
        self.page.goto(f"{self.platform.url}/console")
        self.page.get_by_label("API key").fill(key or self.platform.admin_key)
        self.page.get_by_role("button", name="Sign in").click()
        self.page.get_by_role("navigation", name="Pages").wait_for()


@pytest.fixture
def console(browser: Any, platform: Platform, request: pytest.FixtureRequest) -> Iterator[Console]:
    """A fresh tab (its own sessionStorage); the test fails on any error the page logged, and a
    failed test leaves its page in ``.artifacts/console/failed-<test>.*``."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=platform.url)
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    tab = Console(page, platform, errors)
    failed_before = request.session.testsfailed  # the test's own failure is counted before this teardown
    yield tab
    if request.session.testsfailed > failed_before or tab.errors:
        keep_failed_page(page, request.node.name)
    context.close()
    assert not tab.errors, tab.errors


def test_a_wrong_key_is_refused_and_an_admin_key_sees_every_page(console: Console) -> None:
    page = console.page
    page.goto(f"{console.platform.url}/console")
    page.get_by_label("API key").fill("sk-not-a-key")
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("alert").filter(has_text="Wrong key").wait_for()
    console.errors.clear()  # chromium logs the refused call (401) as a console error: expected here
    console.sign_in()
    nav = page.get_by_role("navigation", name="Pages")
    assert [link.inner_text() for link in nav.get_by_role("link").all()] == [p.title() for p in PAGES]
    assert "console-admin (admin)" in page.locator("#who-name").inner_text()


def test_a_key_that_is_not_admin_sees_no_admin_pages(console: Console) -> None:
    created = _iop("keys", "create", "console-user", "--dir", str(console.platform.state))
    assert created.returncode == 0, created.stderr
    secret = re.search(r"\bsk-\S+", created.stdout)
    assert secret
    wait_for(lambda: _me(console.platform, secret.group(0)) == 200, 10, 0.2, "the edge reading the new key")
    console.sign_in(secret.group(0))
    nav = console.page.get_by_role("navigation", name="Pages")
    visible = [link.inner_text() for link in nav.get_by_role("link").all() if link.is_visible()]
    assert visible == ["Overview", "Runs", "Usage", "Batches", "Playground"]
    console.page.locator(".figure h3").filter(has_text="Completion tokens").wait_for()  # its own usage today
    console.page.goto(f"{console.platform.url}/console#/nodes")  # an admin page by address: Overview instead
    console.page.locator("h1").filter(has_text="Overview").wait_for()
    console.page.get_by_role("button", name="Sign out").click()
    console.page.get_by_label("API key").wait_for()


def _me(platform: Platform, key: str) -> int:
    """The status of ``GET /console/api/me`` with ``key``."""
    return httpx.get(
        f"{platform.url}/console/api/me", headers={"authorization": f"Bearer {key}"}, timeout=5
    ).status_code


def test_overview_and_nodes_show_both_nodes_and_a_drain(console: Console) -> None:
    console.sign_in()
    page = console.open("overview")
    page.locator(".pill.ready").filter(has_text="2 ready").wait_for()
    page = console.open("nodes")
    rows = page.locator("#rows tr")
    rows.filter(has_text="local-node").wait_for()
    rows.filter(has_text="node-b").wait_for()
    node_b = rows.filter(has_text="node-b")
    node_b.get_by_role("button", name="Drain").click()
    dialog = page.get_by_role("dialog")
    assert "node-b" in dialog.inner_text()
    dialog.get_by_role("button", name="Drain").click()
    node_b.locator(".pill.draining").wait_for()  # the list reloaded, then the live stream keeps it
    node_b.get_by_role("button", name="Undrain").click()
    page.get_by_role("dialog").get_by_role("button", name="Undrain").click()
    node_b.locator(".pill.ready").wait_for()


def test_the_live_stream_reconnects_with_backoff(console: Console) -> None:
    refused: list[str] = []

    def cut(route: Any) -> None:  # the network drops the first two connections to the live stream
        if len(refused) < 2:
            refused.append(route.request.url)
            route.abort("connectionreset")
        else:
            route.continue_()

    console.page.route("**/console/api/live", cut)
    console.sign_in()
    page = console.open("overview")
    status = page.locator("#live-status")
    status.filter(has_text="retrying in 1 s").wait_for()
    status.filter(has_text="retrying in 2 s").wait_for()  # the wait doubled
    status.filter(has_text=re.compile("^live$")).wait_for()
    assert len(refused) == 2
    assert all("ERR_CONNECTION_RESET" in error for error in console.errors), console.errors
    console.errors.clear()  # chromium logs each cut connection: expected here


def test_playground_streams_then_the_run_is_in_runs_and_its_tokens_in_usage(console: Console) -> None:
    console.sign_in()
    before = _usage_totals(console)
    page = console.open("playground")
    page.get_by_label("Model").select_option("mock-slow")
    page.get_by_label("Max tokens").fill("30")
    page.get_by_label("Message").fill("Tell me something.")
    # Every length the answer had and every figure shown, as the page changed them.
    page.evaluate(
        """() => {
          window.lengths = [];
          window.figures = [];
          new MutationObserver(() => {
            const text = document.querySelector('.message.assistant .text');
            if (text) window.lengths.push(text.textContent.length);
          }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
          const stats = document.getElementById('stats');
          new MutationObserver(() => window.figures.push(stats.textContent))
            .observe(stats, {subtree: true, childList: true, characterData: true});
        }"""
    )
    page.get_by_role("button", name="Send").click()
    page.locator("#stats").filter(has_text="length").wait_for()  # the finish reason shows last
    lengths = [n for n in page.evaluate("window.lengths") if n > 0]
    final = page.evaluate("document.querySelector('.message.assistant .text').textContent.length")
    assert lengths == sorted(lengths) and lengths[-1] == final
    assert len(set(lengths)) >= 10, lengths  # 30 tokens arrived in many pieces, not at once
    figures = page.evaluate("window.figures")
    assert sum(1 for text in figures if STREAMING.search(text)) >= 5, figures  # tokens/s shown while it grew
    stats = page.locator("#stats").inner_text()
    shown = re.search(r"TTFT \d[\d,]* ms · 30 tokens · [\d,.]+ tokens/s · (\d+) prompt tokens · length", stats)
    assert shown, stats
    prompt = int(shown.group(1))
    run_id = page.locator("#run-id").inner_text()
    assert run_id

    grown = (before[0] + prompt, before[1] + 30)
    wait_for(lambda: _usage_totals(console) == grown, 15, 0.5, f"usage counting exactly the run's tokens {grown}")
    # The ledger writes a run's row in the transaction that adds its usage: the run is in Runs now.
    _find_the_run_with_the_keyboard(console, run_id)
    _export_usage_with_the_keyboard(console)


def _find_the_run_with_the_keyboard(console: Console, run_id: str) -> None:
    """Runs: "until" a minute before the run hides it; then filters typed, Show and the run's
    timeline opened with the keyboard alone."""
    page = console.page
    earlier = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() - 120))
    page.goto(f"{console.platform.url}/console#/runs?model=mock-slow&until={earlier}")
    page.locator("#summary").filter(has_text="Page 1").wait_for()
    assert page.get_by_label("Until (UTC)").input_value() == earlier
    assert run_id not in page.locator("#rows").inner_text()
    page = console.open("runs")
    page.locator("#rows tr").first.wait_for()
    _tab_to(page, "#r-model")
    page.keyboard.type("mock-slow")
    _tab_to(page, "#r-caller")
    page.keyboard.type(console.platform.admin_name)
    _tab_to(page, "#filter button[type=submit]")
    page.keyboard.press("Enter")
    row = page.locator("#rows tr").filter(has_text=run_id)
    row.wait_for()
    assert "mock-slow" in row.inner_text() and "completed" in row.inner_text() and "30" in row.inner_text()
    _tab_to(page, f'button[data-run="{run_id}"]')
    page.keyboard.press("Enter")
    page.locator("tr.detail svg.timeline").wait_for()
    assert row.locator("button[data-run]").get_attribute("aria-expanded") == "true"
    _assert_focused(page, f'button[data-run="{run_id}"]')  # still where it was, to close it again


def _export_usage_with_the_keyboard(console: Console) -> None:
    """Usage: range and grouping changed, Show, and Export CSV with the keyboard alone."""
    page = console.open("usage")
    page.locator("#total-completion").wait_for()
    _tab_to(page, "#u-range")
    page.keyboard.press("ArrowDown")  # last 7 days (by day)
    assert page.get_by_label("Range").input_value() == "7d"
    _tab_to(page, "#u-group")
    page.keyboard.press("End")  # key and model
    assert page.get_by_label("Rows per").input_value() == "key,model"
    _tab_to(page, "#filter button[type=submit]")
    page.keyboard.press("Enter")
    page.locator("#summary").filter(has_text="by day").wait_for()
    _tab_to(page, "#csv")
    with page.expect_download() as downloading:
        page.keyboard.press("Enter")
    csv = Path(downloading.value.path()).read_text().splitlines()
    assert downloading.value.suggested_filename.startswith("iop-usage-day-")
    assert csv[0] == "start,key,model,requests,prompt_tokens,completion_tokens,cached_tokens,failed"
    assert any(f",{console.platform.admin_name},mock-slow," in line for line in csv[1:])
    page.locator(".toast").filter(has_text="Saved").wait_for()
    _assert_focused(page, "#csv")


def test_the_playground_streams_and_stops_from_the_keyboard_alone(console: Console) -> None:
    console.sign_in()
    page = console.open("playground")
    page.locator("#p-model option").first.wait_for(state="attached")
    _tab_to(page, "#p-model")
    page.keyboard.type("mock-sl")  # the closed select picks the option typed
    assert page.get_by_label("Model").input_value() == "mock-slow"
    _tab_to(page, "#p-max")
    page.keyboard.press("Control+A")
    page.keyboard.type("400")  # 20 s at 20 tokens/s
    _tab_to(page, "#p-message")
    page.keyboard.type("A long one, please.")
    page.keyboard.press("Control+Enter")
    page.wait_for_function("() => document.querySelector('.message.assistant .text')?.textContent.length > 0")
    _tab_to(page, "#stop")
    page.keyboard.press("Enter")
    page.locator("#stats").filter(has_text="stopped").wait_for()
    assert page.get_by_role("button", name="Send").is_enabled()
    assert not page.get_by_role("button", name="Stop").is_enabled()
    _assert_focused(page, "#p-message")  # ready for the next message


def _usage_totals(console: Console) -> tuple[int, int]:
    """The Usage page's prompt and completion tokens of the last 24 hours for the admin key and
    ``mock-slow`` (the page opened afresh)."""
    page = console.page
    page.goto(f"{console.platform.url}/console#/usage?key={console.platform.admin_name}&model=mock-slow")
    page.locator("h1").filter(has_text="Usage").wait_for()
    page.locator("#total-completion").wait_for()
    prompt, completion = (
        page.locator(f"#total-{kind}").inner_text().replace(",", "") for kind in ("prompt", "completion")
    )
    return int(prompt), int(completion)


def test_a_key_is_created_with_its_secret_shown_once_then_revoked_from_the_keyboard(console: Console) -> None:
    console.sign_in()
    page = console.open("keys")
    _tab_to(page, "#k-name")
    page.keyboard.type("made-in-console")
    page.keyboard.press("Tab")
    page.keyboard.type("60")  # requests per minute
    _tab_to(page, "#create button[type=submit]")
    page.keyboard.press("Enter")
    page.locator("#secret-value").wait_for()
    secret = page.locator("#secret-value").input_value()
    assert secret.startswith("sk-")
    _assert_focused(page, "#copy")  # the secret's copy button has the focus
    page.keyboard.press("Enter")
    page.locator(".toast").filter(has_text="Secret copied").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == secret
    row = page.locator("#rows tr").filter(has_text="made-in-console")
    assert "active" in row.inner_text() and "60" in row.inner_text()
    assert secret not in page.locator("#keys-table").inner_text()
    _tab_to(page, 'button[data-revoke="made-in-console"]')
    page.keyboard.press("Enter")
    page.get_by_role("dialog").wait_for()
    _assert_focused(page, "#confirm-cancel")
    page.keyboard.press("Tab")
    _assert_focused(page, "#confirm-ok")
    page.keyboard.press("Enter")
    row.filter(has_text="revoked").wait_for()
    _assert_focused(page, 'tr[data-row="made-in-console"] th')  # the key's row, not lost to <body>


def _batch(client: openai.OpenAI, model: str, lines: int, failing: str | None = None) -> Any:
    """A batch of ``lines`` chats, and with ``failing`` one more line of that custom_id that
    cannot become a run (a lone surrogate is no UTF-8: it goes to the error file)."""
    body = {"model": model, "messages": [{"role": "user", "content": "go"}]}
    bodies = [(f"line-{n}", body) for n in range(lines)]
    if failing:
        bodies.append((failing, {"model": model, "messages": [{"role": "user", "content": "a\ud800b"}]}))
    text = "".join(
        json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": line}) + "\n"
        for custom_id, line in bodies
    )
    uploaded = client.files.create(file=(f"{model}.jsonl", text.encode()), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_a_running_batch_is_cancelled_and_a_finished_ones_files_downloaded_from_the_keyboard(
    console: Console,
) -> None:
    client = console.platform.client()
    done = _batch(client, "mock-small", 2, failing="the-bad-line")
    batch = _batch(client, "mock-slow", 20)
    wait_for(lambda: client.batches.retrieve(done.id).status == "completed", 30, 0.2, "the small batch completed")
    console.sign_in()
    page = console.open("batches")
    row = page.locator("#rows tr").filter(has_text=batch.id)
    _tab_to(page, f'button[data-cancel="{batch.id}"]')
    page.keyboard.press("Enter")
    page.get_by_role("dialog").wait_for()
    _assert_focused(page, "#confirm-cancel")  # "Keep it"
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")  # "Cancel batch"
    row.locator(".pill").filter(has_text=re.compile("cancell")).wait_for()
    wait_for(
        lambda: client.batches.retrieve(batch.id).status in ("cancelling", "cancelled"), 10, 0.2, "the batch cancelled"
    )
    _assert_focused(page, f'tr[data-row="{batch.id}"] th')  # its Cancel button is gone: the row keeps the focus
    files = {}
    for kind in ("output", "errors"):
        _tab_to(page, f'button[data-name="{done.id}-{kind}.jsonl"]')
        with page.expect_download() as downloading:
            page.keyboard.press("Enter")
        files[kind] = [json.loads(line) for line in Path(downloading.value.path()).read_text().splitlines()]
    assert sorted(line["custom_id"] for line in files["output"]) == ["line-0", "line-1"]
    assert [line["custom_id"] for line in files["errors"]] == ["the-bad-line"]
    assert files["errors"][0]["response"]["status_code"] == 400
    client.close()


def test_the_nav_and_a_button_work_from_the_keyboard_alone(console: Console) -> None:
    page = console.page
    page.goto(f"{console.platform.url}/console")
    page.keyboard.type(console.platform.admin_key)  # the key field has the focus
    page.keyboard.press("Enter")
    page.get_by_role("navigation", name="Pages").wait_for()
    _tab_to(page, "a", "Nodes")
    page.keyboard.press("Enter")
    page.locator("h1").filter(has_text="Nodes").wait_for()
    page.locator("#rows button").first.wait_for()
    _tab_to(page, "button", "Drain")
    page.keyboard.press("Enter")
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    assert page.evaluate("document.activeElement.id") == "confirm-cancel"  # the safe choice has the focus
    page.keyboard.press("Escape")
    dialog.wait_for(state="hidden")
    assert page.evaluate("document.activeElement.textContent") == "Drain"  # back where it was
    assert "draining" not in page.locator("#rows").inner_text()


def _tab_to(page: Any, selector: str, text: str | None = None, limit: int = 80) -> None:
    """Press Tab until the focused element matches ``selector`` (and reads ``text``), its focus
    visible."""
    for _ in range(limit):
        page.keyboard.press("Tab")
        focused = page.evaluate(
            "([css, text]) => { const e = document.activeElement;"
            " return e.matches(css) && (text === null || e.textContent.trim() === text); }",
            [selector, text],
        )
        if focused:
            _assert_focused(page, selector)
            return
    raise AssertionError(f"no {selector} {text or ''} within {limit} tabs")


def _assert_focused(page: Any, selector: str) -> None:
    """The focus is on ``selector`` and shown (``:focus-visible``, the outline keyboard users see)."""
    state = page.evaluate(
        "(css) => { const e = document.activeElement;"
        " return [e.matches(css), e.matches(':focus-visible'), e.outerHTML.slice(0, 120)]; }",
        selector,
    )
    assert state[:2] == [True, True], (selector, state)


def test_every_page_renders_with_readable_contrast(console: Console) -> None:
    client = console.platform.client()
    for n in range(5):  # some traffic for the figures (and the README's picture)
        client.chat.completions.create(model="mock-small", messages=[{"role": "user", "content": f"hello {n}"}])
    client.close()
    console.sign_in()
    for name in PAGES:
        page = console.open(name)
        page.locator(LOADED[name]).first.wait_for(state="attached")
        _readable(page, name)
    _opened_parts_are_readable(console)


def _readable(page: Any, name: str) -> None:
    failing = low_contrast(page)
    assert not failing, (name, failing)
    screenshot(page, name)


def _opened_parts_are_readable(console: Console) -> None:
    """What shows only after an action: the key's secret box, the confirm dialog, a run's timeline,
    an error toast and a streamed answer."""
    page = console.open("keys")
    page.get_by_label("Name").fill("contrast-key")
    page.get_by_role("button", name="Create").click()
    page.locator("#secret-value").wait_for()
    _readable(page, "keys-secret")
    page.locator('button[data-revoke="contrast-key"]').click()
    page.get_by_role("dialog").wait_for()
    _readable(page, "confirm-dialog")
    page.keyboard.press("Escape")
    page = console.open("runs")
    page.locator("#rows button[data-run]").first.click()
    page.locator("tr.detail svg.timeline").wait_for()
    _readable(page, "runs-timeline")
    page.goto(f"{console.platform.url}/console#/usage?range=custom&start=2026-01-02T00:00&end=2026-01-01T00:00")
    page.locator(".toast.error").filter(has_text="start must be before end").wait_for()
    _readable(page, "error-toast")
    assert all("400" in error for error in console.errors), console.errors
    console.errors.clear()  # chromium logs the refused call (400) as a console error: expected here
    page = console.open("playground")
    page.get_by_label("Model").select_option("mock-small")
    page.get_by_label("Message").fill("Say something.")
    page.get_by_role("button", name="Send").click()
    page.locator("#stats").filter(has_text=re.compile("stop|length")).wait_for()
    _readable(page, "playground-answer")
