"""A fleet of 1,000 nodes on one control-plane: registration, steady CPU, scheduling, listing, memory.

``iop control-plane`` runs as its own process (identity rule on: a node certificate registers
only its own CN). This process (uvloop) simulates the nodes: each has its own certificate
(CN = its id, OU node, minted here from the bench's CA), its own mTLS connection, and the node's
own dialer (``iop_wire.KeepConnected``, jittered backoff at the node's defaults); it registers and
sends ``node.status`` as the node's ``Registration`` does: when its load changed (at once:
status_step 1) and every ``status_refresh`` (10 s) regardless, and the wire sends heartbeats
every heartbeat interval (1 s, the node's default). A simulated node
serves the model ``fast`` with one token per run (start, delta, complete), in this process.

Rows: registration of every node after a control-plane restart (SIGTERM, then a new process on
the same port); the control-plane's steady CPU with the fleet connected and idle; the
scheduling decision time, from the control-plane's own ``iop_control_plane_decision_seconds``
while runs are placed; ``iop nodes ls`` wall time (the CLI as an operator runs it) and the
``nodes.list`` round trip; the control-plane's RSS per node; and an ``iop edge`` in front,
non-streaming requests sent at a steady rate (open loop; ``SENT``): the edge's, the
control-plane's and its ledger writer's CPU per request above the idle fleet's, and that cost
at 1,500 requests/s. CPU is read from /proc. Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml
from control_plane_bench import IOP, _wait_ready, stop
from edge_bench import _rss_mb, _until_ready
from node_bench import _CLK_TCK, _cpu_seconds, _request
from table import print_table

from iop_edge.keys import create_key
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.settings import ControlPlaneSettings
from iop_wire import Handler, KeepConnected, TlsConfig
from iop_wire.certs import Authority, init_dir, tls_section
from iop_wire.connection import Connection
from iop_wire.dialer import Backoff, Target
from iop_wire.endpoint import dial
from iop_wire.errors import IopError
from iop_wire.logs import configure
from iop_wire.runs import EventSink
from iop_wire.settings import ConnectionSettings
from iop_wire.tls import Role

NODES = int(os.environ.get("IOP_FLEET_NODES", "1000"))
"""Simulated nodes (``IOP_FLEET_NODES`` sets another count for a quick look)."""
INTERVAL = 1.0
"""The node's default heartbeat interval (``heartbeat_interval``)."""
STATUS_REFRESH = ControlPlaneSettings().status_refresh
"""The node's default period of ``node.status`` while its load does not change."""
CAPACITY = 64
MODELS = 20
"""Each node serves ``fast`` and one of these, as a fleet serving several models does."""
STEADY_SECONDS = 2 * STATUS_REFRESH
PLACED_RUNS, PLACING = 3000, 32
RATE, RATE_SECONDS = 1500, 6.0
"""The rate the edge and ledger cost is stated at."""
SENT = int(os.environ.get("IOP_FLEET_RATE", "300"))
"""Requests/s actually sent: on 2 cores shared with the 1,000 simulated nodes and the client,
1,500/s is out of reach (the client and the nodes alone take a core), so the cost per request
is measured at this rate and stated at RATE (``IOP_FLEET_RATE=1500`` on a larger host)."""
IDLE_SECONDS = 3.0
STEADY_ONLY = os.environ.get("IOP_FLEET_STEADY_ONLY") == "1"
"""Only register the fleet and measure the steady CPU (about a minute; with ``IOP_FLEET_PROFILE``,
a profile of the control-plane mostly at rest)."""
LS_TIMES = 5
_ids = itertools.count()


class SimNode:
    """One simulated node: its own certificate and connection, registering and reporting as a node does."""

    def __init__(self, index: int, port: int, certs: Path) -> None:
        self.node_id = f"node-{index:04d}"
        tls = TlsConfig(
            enabled=True,
            cert=certs / f"{self.node_id}.crt",
            key=certs / f"{self.node_id}.key",
            ca=certs / "ca.crt",
        )
        config = ConnectionSettings().config(heartbeat_interval=INTERVAL)
        target = Target(
            "127.0.0.1",
            port,
            tls=tls,
            server_hostname="localhost",
            expect_roles={Role.CONTROL_PLANE},
            connection=config,
        )
        self.models = ("fast", f"m{index % MODELS}")
        self.link = KeepConnected(target, self._register, handler=Handler(run=self._run), backoff=Backoff())
        self.registered_at = 0.0
        self.refused = 0
        self.busy = 0
        self.reports = 0
        self._changed = asyncio.Event()
        self._reporter: asyncio.Task[None] | None = None

    def status(self) -> pb.NodeStatus:
        loads = [
            pb.ModelLoad(model=model, in_flight=self.busy if model == "fast" else 0, capacity=CAPACITY, available=True)
            for model in self.models
        ]
        return pb.NodeStatus(node_id=self.node_id, models=loads, in_flight=self.busy, capacity=CAPACITY * 2)

    def _capabilities(self) -> pb.CapabilityResponse:
        models = [
            pb.ModelInfo(name=model, kinds=[pb.RUN_KIND_CHAT], available=True, max_concurrency=CAPACITY)
            for model in self.models
        ]
        return pb.CapabilityResponse(
            node_id=self.node_id, max_concurrency=CAPACITY * 2, adapters=[pb.AdapterInfo(name="mock", models=models)]
        )

    async def _register(self, connection: Connection) -> None:
        register = pb.NodeRegister(node_id=self.node_id, capabilities=self._capabilities(), status=self.status())
        try:
            await connection.request(pb.Envelope(node_register=register))
        except IopError:
            self.refused += 1
            raise
        self.registered_at = time.perf_counter()
        if self._reporter is not None:
            self._reporter.cancel()
        self._reporter = asyncio.create_task(self._report(connection))

    async def _report(self, connection: Connection) -> None:
        """As the node's Registration does: a status at once on a load change, else every STATUS_REFRESH."""
        loop = asyncio.get_running_loop()
        sent, sent_at = None, 0.0
        with contextlib.suppress(IopError):
            while not connection.closed:
                status = self.status()
                if status != sent or loop.time() - sent_at >= STATUS_REFRESH:
                    await connection.send(pb.Envelope(node_status=status))
                    self.reports += 1
                    sent, sent_at = status, loop.time()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), INTERVAL)
                self._changed.clear()

    async def _run(self, request: pb.RunRequest, sink: EventSink) -> None:
        self.busy += 1
        self._changed.set()
        try:
            await sink.start(node_id=self.node_id, model=request.model, adapter="mock")
            await sink.delta("hello")
            await sink.complete(pb.FINISH_REASON_STOP, pb.Usage(prompt_tokens=1, completion_tokens=1))
        finally:
            self.busy -= 1
            self._changed.set()

    async def stop(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        await self.link.stop()


def _mint(certs: Path) -> None:
    """A certificate per node from the CA ``init_dir`` wrote: CN the node's id, OU node."""
    authority = Authority.load(certs / "ca.crt", certs / "ca.key")
    for index in range(NODES):
        name = f"node-{index:04d}"
        authority.issue(name, Role.NODE, sans=(name,)).write(certs, name)


def _cp_config(state: Path, port: int) -> Path:
    data = {
        "listen": {
            "port": port,
            # 1,000 machines come from 1,000 addresses; here all from 127.0.0.1, so the per-address
            # handshake bound (16, against one host flooding) is raised to the overall one (64).
            "max_handshakes_per_address": 64,
        },
        "tls": tls_section(state / "certs", "control-plane"),
        "identity": {"shared_node_certificate": False},
        "store_path": str(state / "cp.db"),
        "metrics": {"port": 0},
        "queue_size": 4096,
        "log_level": "warning",
    }
    path = state / "cp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start_cp(state: Path, port: int) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    ready = state / "cp.ready"
    ready.unlink(missing_ok=True)
    iop = IOP
    if profile := os.environ.get("IOP_FLEET_PROFILE"):  # cProfile the control-plane into this file
        iop = [sys.executable, "-m", "cProfile", "-o", profile, "-m", "iop_cli.main"]
    command = [*iop, "control-plane", "--config", str(_cp_config(state, port)), "--ready-file", str(ready)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, _wait_ready(ready, process)


def _metrics(port: int) -> dict[str, float]:
    """The control-plane's /metrics, as {name{labels}: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _refused_at_accept(metrics: dict[str, float]) -> int:
    """Connections the listener closed at accept or the preface for a limit (the dialer retries them)."""
    kinds = ("connections", "handshakes", "handshakes_per_address", "connections_per_peer")
    return int(sum(metrics.get(f'iop_wire_limit_hits_total{{limit="{kind}"}}', 0) for kind in kinds))


def _decision_p(metrics: dict[str, float], q: float) -> tuple[float, int]:
    """The ``q`` quantile of iop_control_plane_decision_seconds (linear within its bucket, us), and the count."""
    prefix = "iop_control_plane_decision_seconds_bucket{le="
    buckets = sorted(
        (float(name[len(prefix) + 1 : -2]), count) for name, count in metrics.items() if name.startswith(prefix)
    )
    total = int(buckets[-1][1])
    wanted, below, low = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= wanted:
            inside = (wanted - below) / (count - below) if count > below else 1.0
            return (low + (bound - low) * inside) * 1e6, total
        below, low = count, bound
    return float("inf"), total


def _writer_cpu(pid: int) -> float:
    """CPU seconds of the process's threads other than its event loop's: the audit store's
    writer (its SQLite commits run in the loop's executor; nothing else uses it meanwhile)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if task.name != str(pid):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def _progress(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


async def _all_registered(fleet: list[SimNode], since: float, timeout: float = 120.0) -> float:
    """Seconds from ``since`` until every node registered after it."""
    deadline = time.perf_counter() + timeout
    shown = time.perf_counter()
    while missing := sum(node.registered_at <= since for node in fleet):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{missing} nodes did not register within {timeout} s")
        if time.perf_counter() - shown > 5:
            shown = time.perf_counter()
            _progress(f"{NODES - missing} registered")
        await asyncio.sleep(0.05)
    return max(node.registered_at for node in fleet) - since


async def _ready_count(admin: Connection) -> int:
    listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
    return sum(node.state == pb.NODE_STATE_READY for node in listed.nodes)


async def _steady(cp_pid: int, fleet: list[SimNode]) -> tuple[float, float, float]:
    """Control-plane and this process's CPU (% of one core) and node.status sent per second, over
    STEADY_SECONDS with the fleet idle."""
    reports = sum(node.reports for node in fleet)
    started, cp, own = time.perf_counter(), _cpu_seconds(cp_pid), time.process_time()
    await asyncio.sleep(STEADY_SECONDS)
    elapsed = time.perf_counter() - started
    cpu = (_cpu_seconds(cp_pid) - cp) / elapsed * 100
    return cpu, (time.process_time() - own) / elapsed * 100, (sum(node.reports for node in fleet) - reports) / elapsed


async def _steady_row(cp_pid: int, fleet: list[SimNode]) -> tuple[str, str]:
    cp_cpu, own_cpu, reports = await _steady(cp_pid, fleet)
    return (
        f"control-plane CPU with {NODES:,} idle nodes (a heartbeat every {INTERVAL:g} s, node.status every"
        f" {STATUS_REFRESH:g} s each: {reports:,.0f} node.status/s sent), load {_load()}",
        f"{cp_cpu:.1f}% of a core (the {NODES:,} simulated nodes: {own_cpu:.0f}%)",
    )


async def _placing(edge: Connection) -> list[float]:
    """Place PLACED_RUNS one-token runs, PLACING at a time; each run's round trip (ms)."""
    times: list[float] = []

    async def one() -> None:
        for _ in range(PLACED_RUNS // PLACING):
            began = time.perf_counter()
            stream = await edge.open_run(_request(f"p{next(_ids)}", "fast", 1))
            async for _ in stream:
                pass
            times.append((time.perf_counter() - began) * 1000)

    await asyncio.gather(*(one() for _ in range(PLACING)))
    return times


async def _nodes_list_ms(admin: Connection) -> float:
    began = time.perf_counter()
    await admin.request(pb.Envelope(nodes_list=pb.NodesList()))
    return (time.perf_counter() - began) * 1000


def _nodes_ls_ms(port: int, certs: Path) -> float:
    command = [*IOP, "nodes", "ls", "--control-plane", f"127.0.0.1:{port}", "--certs", str(certs)]
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - began) * 1000


async def _at_rate(
    url: str, key: str, pids: dict[str, int], reports: Callable[[], int]
) -> tuple[float, dict[str, float], int, float]:
    """Non-streaming requests sent at RATE/s for RATE_SECONDS: (answered/s, CPU % of a core by part, errors,
    node.status the fleet sent per answered request above its idle rate)."""
    body = b'{"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    answered, errors = 0, 0
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal answered, errors
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    answered += response.status == 200
                    if response.status != 200:
                        errors += 1
                        if errors == 1:
                            _progress(f"edge answered {response.status}: {(await response.read())[:300]!r}")
            except asyncio.CancelledError:
                errors += 1
            except aiohttp.ClientError as exc:
                errors += 1
                if errors == 1:
                    _progress(f"edge request failed: {exc!r}")

        async def paced(seconds: float) -> None:
            tasks: set[asyncio.Task[None]] = set()
            began = time.perf_counter()
            for sent in range(int(SENT * seconds)):
                delay = began + sent / SENT - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:  # what is not answered 10 s after the last was sent counts as an error
                _, late = await asyncio.wait(tasks, timeout=10)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)

        await paced(1.0)  # warm up: connections open, code paths hot
        answered = errors = 0
        sent = reports()
        idle = await _shares(pids, asyncio.sleep(IDLE_SECONDS))
        idle_reports, sent = reports() - sent, reports()
        busy = await _shares(pids, paced(RATE_SECONDS))
        busy_reports = reports() - sent
    above = {name: busy[name] - idle[name] for name in busy}  # the fleet's heartbeats and reports excluded
    # A node reports its load when it changes: each run sends up to two node.status (start, end),
    # which the CPU above idle includes (the idle fleet sends one per node every STATUS_REFRESH).
    status_per_request = (busy_reports - idle_reports * busy["elapsed"] / idle["elapsed"]) / max(answered, 1)
    return answered / busy["elapsed"], above, errors, status_per_request


async def _shares(pids: dict[str, int], work: Awaitable[None]) -> dict[str, float]:
    """CPU of each part while ``work`` runs, % of a core (and ``elapsed``, seconds)."""
    before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    before["ledger"], before["bench"] = _writer_cpu(pids["control-plane"]), time.process_time()
    began = time.perf_counter()
    await work
    elapsed = time.perf_counter() - began
    after = {name: _cpu_seconds(pid) for name, pid in pids.items()}
    after["ledger"], after["bench"] = _writer_cpu(pids["control-plane"]), time.process_time()
    shares = {name: (after[name] - before[name]) / elapsed * 100 for name in after}
    return shares | {"elapsed": elapsed}


def _quiet_resets(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Drop uvloop's "never retrieved" report of a handshake the listener reset at accept (the
    dialer saw it and redials); anything else goes to the default handler."""
    if not isinstance(context.get("exception"), ConnectionResetError):
        loop.default_exception_handler(context)


async def _fleet_rows(state: Path) -> list[tuple[str, str]]:  # noqa: PLR0915 - one scenario, in order
    asyncio.get_running_loop().set_exception_handler(_quiet_resets)
    certs = state / "certs"
    rows: list[tuple[str, str]] = []
    cp, info = _start_cp(state, 0)
    port, processes = int(info["port"]), [cp]
    idle_rss = _rss_mb(cp.pid)
    fleet = [SimNode(index, port, certs) for index in range(NODES)]
    admin_tls = TlsConfig(enabled=True, cert=certs / "admin.crt", key=certs / "admin.key", ca=certs / "ca.crt")
    edge_tls = TlsConfig(enabled=True, cert=certs / "edge.crt", key=certs / "edge.key", ca=certs / "ca.crt")
    try:
        _progress("first registration")
        began = time.perf_counter()
        for node in fleet:
            node.link.start()
        first = await _all_registered(fleet, began)
        rows.append(
            (f"first registration of {NODES:,} nodes (control-plane up, all dialing at once)", f"{first:.1f} s")
        )
        if STEADY_ONLY:
            await asyncio.sleep(3 * INTERVAL)
            return [*rows, await _steady_row(cp.pid, fleet)]

        _progress("restart")
        # Restart: the nodes see the close and redial with backoff; the new process takes the same port.
        cp.send_signal(signal.SIGTERM)
        cp.wait(timeout=30)
        began = time.perf_counter()
        cp, info = _start_cp(state, port)
        processes = [cp]
        up = time.perf_counter() - began
        took = await _all_registered(fleet, began)
        await asyncio.sleep(2 * INTERVAL)
        metrics = _metrics(int(info["metrics_port"]))
        refused = sum(node.refused for node in fleet)
        at_accept = _refused_at_accept(metrics)
        async with dial("127.0.0.1", port, tls=admin_tls, server_hostname="localhost") as admin:
            ready = await _ready_count(admin)
            rows.append(
                (
                    f"registration of all {NODES:,} after a control-plane restart (new process started -> all"
                    f" registered; its start took {up:.1f} s); node.register refused; connections closed at"
                    " accept for a limit (redialed)",
                    f"{took:.1f} s; {refused} refused; {at_accept} closed ({ready:,} ready)",
                ),
            )
            _progress("steady CPU")
            await asyncio.sleep(3 * INTERVAL)
            rows.append(await _steady_row(cp.pid, fleet))
            rss = _rss_mb(cp.pid)
            rows.append(
                (
                    f"control-plane RSS idle / with {NODES:,} nodes: per node",
                    f"{idle_rss:.0f} / {rss:.0f} MB: {(rss - idle_rss) * 1024 / NODES:.0f} KB",
                )
            )
            _progress("nodes ls")
            listed = [await _nodes_list_ms(admin) for _ in range(20)]
            # In a thread: the fleet's heartbeats go on meanwhile (a CLI run taking 3 s on a loaded
            # host would otherwise have the control-plane drop every simulated node as silent).
            ls = [await asyncio.to_thread(_nodes_ls_ms, port, certs) for _ in range(LS_TIMES)]
            rows.append(
                (
                    f"`iop nodes ls` with {NODES:,} nodes, wall time (the CLI process), median of {LS_TIMES};"
                    " nodes.list round trip, median / max of 20",
                    f"{statistics.median(ls):.0f} ms; {statistics.median(listed):.1f} / {max(listed):.1f} ms",
                )
            )
        _progress("scheduling")
        async with dial("127.0.0.1", port, tls=edge_tls, server_hostname="localhost") as edge:
            await _placing(edge)  # warm up
            before = _metrics(int(info["metrics_port"]))
            trips = sorted(await _placing(edge))
            metrics = _metrics(int(info["metrics_port"]))
        p50, count = _decision_p(metrics, 0.5)
        p99, _ = _decision_p(metrics, 0.99)
        _, earlier = _decision_p(before, 0.5)
        rows.append(
            (
                f"scheduling decision with {NODES:,} nodes (the control-plane's iop_control_plane_decision_seconds,"
                f" {count:,} decisions, {count - earlier:,} in the timed pass), p50 / p99",
                f"{p50:.1f} / {p99:.1f} us",
            )
        )
        rows.append(
            (
                f"a one-token run placed through the control-plane, {PLACING} at a time, p50 / p99 round trip",
                f"{trips[len(trips) // 2]:.2f} / {trips[int(len(trips) * 0.99)]:.2f} ms",
            )
        )
        _progress("edge at rate")
        rows += await _edge_rows(state, port, cp.pid, processes, lambda: sum(node.reports for node in fleet))
    finally:
        await asyncio.gather(*(node.stop() for node in fleet), return_exceptions=True)
        stop(processes)
    return rows


async def _edge_rows(
    state: Path, cp_port: int, cp_pid: int, processes: list[subprocess.Popen[bytes]], reports: Callable[[], int]
) -> list[tuple[str, str]]:
    certs = state / "certs"
    edge = {
        "http": {"port": 0, "max_in_flight": 8192},
        "control_plane": {"address": f"127.0.0.1:{cp_port}", "server_name": "localhost"},
        "tls": tls_section(certs, "edge"),
        "auth": "keys",
        "keys_path": str(state / "keys.db"),
        "log_level": "warning",
    }
    (state / "edge.yaml").write_text(yaml.safe_dump(edge))
    key = create_key(state / "keys.db", "bench")
    ready = state / "edge.ready"
    command = [*IOP, "edge", "--config", str(state / "edge.yaml"), "--ready-file", str(ready)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: ASYNC220 - set-up, not timed
    processes.append(process)
    port = int(_wait_ready(ready, process)["port"])
    await asyncio.to_thread(_until_ready, port)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    rate, cpu, errors, status_per_request = await _at_rate(
        url, key, {"edge": process.pid, "control-plane": cp_pid}, reports
    )
    per = {name: share / 100 / rate * 1e6 for name, share in cpu.items() if name != "elapsed"}  # us per request
    at_rate = {name: us * RATE / 1e4 for name, us in per.items()}
    return [
        (
            f"edge + ledger, non-streaming requests (1 token each) sent at {SENT:,}/s over {NODES:,} nodes:"
            f" answered/s (errors); load {_load()}",
            f"{rate:,.0f}/s ({errors})",
        ),
        (
            "  CPU per request above idle: edge, control-plane (of which its ledger writer), this process"
            f" (client + nodes); the control-plane's includes the {status_per_request:.2f} node.status a"
            " request made the nodes send (a load change is reported at once)",
            f"{per['edge']:.0f}, {per['control-plane']:.0f} ({per['ledger']:.0f}), {per['bench']:.0f} us",
        ),
        (
            f"  the same at {RATE:,} requests/s, % of a core",
            f"{at_rate['edge']:.0f}%, {at_rate['control-plane']:.0f}% ({at_rate['ledger']:.1f}%),"
            f" {at_rate['bench']:.0f}%",
        ),
    ]


def main() -> None:
    configure("error")
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        init_dir(state / "certs")
        _mint(state / "certs")
        rows = uvloop.run(_fleet_rows(state))
    print(f"{NODES:,} simulated nodes in one process (pid {os.getpid()}), 2 cores shared by all")
    print_table(rows)


if __name__ == "__main__":
    main()
