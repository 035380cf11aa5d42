"""The files ``iop up`` writes in its state folder, and the errors and look-ups it shares.

On first start: development certificates, ``control-plane.yaml`` (its ``join.ca_key`` the CA's
key, so that it can sign joining machines' certificates), ``node.yaml`` (mock models, or one
route per model of a ``--backend``), ``worker.yaml`` and ``edge.yaml`` with their ports (the
customary one, else a free one) and hosts (127.0.0.1 and the ``--listen`` addresses), the
console's admin certificate in ``edge.yaml`` (``console.admin_cert``: the CLI's), and the API
key ``local`` (an admin key: the console's every page). Later starts keep the files and only
set values in place (``set_value``: the hosts when ``--listen`` is given; an ``edge.yaml`` of an
older ``up`` gets its ``worker`` and ``console`` sections appended, a ``control-plane.yaml`` its
``join`` section, ``add_section``), the rest of each file as the user left it. Also here: the
small HTTP helpers the other ``up`` modules use.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from iop_cli.addresses import LOOPBACK, configured_hosts, ensure_sans, listen_hosts
from iop_cli.ggufs import servers_dir
from iop_cli.output import CliError
from iop_wire.certs import init_dir, tls_section

CONTROL_PLANE_PORT = 7400
EDGE_PORT = 8000
WORKER_PORT = 7402
_NODE_METRICS_PORT = 9464  # Prometheus' customary port for a node's metrics
_CONTROL_PLANE_METRICS_PORT = 9465
_WORKER_METRICS_PORT = 9466
HTTP_TIMEOUT = 5.0
_PORT_TRIES = 20  # a free port on 127.0.0.1 may be taken on a --listen address: another is tried
_CHOSEN_FROM = 20000
"""The lowest port chosen when a customary one is taken (up to the kernel's ephemeral range)."""
# Runs at once per model of a --backend (see backend_concurrency): what each kind of server takes.
OLLAMA_CONCURRENCY = 4  # OLLAMA_NUM_PARALLEL is not served over HTTP; 4 is its own default where memory allows
VLLM_CONCURRENCY = 256  # vLLM's max_num_seqs default
DEFAULT_CONCURRENCY = 64


# --- first start: certificates, configs, the API key --------------------------------------------------


def prepare(
    state: Path,
    port: int | None,
    backend: str | None,
    listen: Sequence[str] = (),
    *,
    served: list[dict[str, Any]] | None = None,
) -> None:
    """Write what is missing under ``state`` (certificates, configs, API key); CliError if it cannot start.

    ``listen``: the addresses of ``--listen``, set as the listen hosts (beside 127.0.0.1) and
    named in every certificate; ``served``: routes of models the node serves itself (``--model``),
    written into ``node.yaml`` in place of its routes."""
    edge = state / "edge.yaml"
    if port:  # before anything is written
        _check_free(port, _hosts(listen) if listen or not edge.exists() else configured_hosts(edge, "http"))
    state.mkdir(parents=True, exist_ok=True)
    certs = state / "certs"
    if not (certs / "ca.crt").exists():
        init_dir(certs, extra_sans=listen)
        print(f"minted a development CA and per-role certificates in {certs}")
    else:
        ensure_sans(certs, listen)
    routes = backend_routes(backend) if backend else served
    control_plane = _prepare_control_plane(state, listen)
    node = state / "node.yaml"
    if routes is not None or not node.exists():
        address = f"127.0.0.1:{control_plane}"
        written = node_config(state, node_id="local-node", address=address, tls=_tls(state, "node"), routes=routes)
        node.write_text(yaml.safe_dump(written, sort_keys=False))
        print(f"wrote {node} ({_routes_written(backend, routes)}; edit it to add routes)")
    worker = _prepare_worker(state, control_plane, listen)
    _prepare_edge(state, control_plane, port, worker, listen)
    for config in (node, state / "worker.yaml", state / "edge.yaml"):  # up points them at the control-plane it started
        if _yaml_node(config, ("control_plane", "address")) is None:
            raise CliError(
                f"{config} has no control_plane.address (written by an older 'iop up'?): "
                "add one, or remove the file to have it rewritten",
                2,
            )
    _ensure_key(state)


def _routes_written(backend: str | None, routes: list[dict[str, Any]] | None) -> str:
    if backend:
        return f"models of {backend}"
    if routes:
        return f"{', '.join(str(route['model']) for route in routes)} served by llama.cpp"
    return "mock models"


def _prepare_control_plane(state: Path, listen: Sequence[str]) -> int:
    config = state / "control-plane.yaml"
    port = _prepare_listener(
        config, CONTROL_PLANE_PORT, "the control-plane", lambda port: _control_plane_config(state, port, listen), listen
    )
    if not _has_section(config, "join"):  # an older up's file; a join section of the user's is kept
        add_section(config, "join", _join_section(state))
    return port


def _prepare_worker(state: Path, control_plane: int, listen: Sequence[str]) -> int:
    return _prepare_listener(
        state / "worker.yaml",
        WORKER_PORT,
        "the worker",
        lambda port: _worker_config(state, control_plane, port, listen),
        listen,
    )


def _prepare_listener(
    config: Path, default: int, who: str, write: Callable[[int], dict[str, object]], listen: Sequence[str]
) -> int:
    """The port of a service listening at ``listen.port``: its config written if missing (``default``,
    or a free port when that is taken), else read from it (``listen.host`` set to ``listen`` when
    given); CliError when the configured port is taken."""
    if not config.exists():
        port = _default_or_free(default, who, _hosts(listen))
        config.write_text(yaml.safe_dump(write(port), sort_keys=False))
        print(f"wrote {config}")
        return port
    if listen:
        set_value(config, ("listen", "host"), listen_hosts(listen))
    port = _port_of(config, ("listen", "port"), default)
    hosts = configured_hosts(config)
    if port and not _free(port, hosts):
        raise CliError(f"port {port} (listen.port of {config}) is in use on {', '.join(hosts)}", 2)
    return port


def _prepare_edge(state: Path, control_plane: int, port: int | None, worker: int, listen: Sequence[str]) -> None:
    config = state / "edge.yaml"
    if not config.exists():
        chosen = _default_or_free(EDGE_PORT, "the edge", _hosts(listen)) if port is None else port
        written = _edge_config(state, control_plane, chosen, worker, listen)
        config.write_text(yaml.safe_dump(written, sort_keys=False))
        print(f"wrote {config}")
        return
    if listen:
        set_value(config, ("http", "host"), listen_hosts(listen))
    if yaml_value(config, ("worker", "address")) is None:  # an older up's edge.yaml: no worker yet
        add_section(config, "worker", _worker_address(worker))
    if not _has_section(config, "console"):  # an older up's edge.yaml: no console admin certificate yet
        add_section(config, "console", _console(state))
    if port is not None:
        set_value(config, ("http", "port"), port)
    configured = _port_of(config, ("http", "port"), EDGE_PORT)
    hosts = configured_hosts(config, "http")
    if port is None and configured and not _free(configured, hosts):
        raise CliError(
            f"port {configured} (http.port of {config}) is in use on {', '.join(hosts)}; pass --port N, or 0 for any", 2
        )


def _hosts(listen: Sequence[str]) -> list[str]:
    hosts = listen_hosts(listen)
    return [hosts] if isinstance(hosts, str) else hosts


def _check_free(port: int, hosts: Sequence[str]) -> None:
    if not _free(port, hosts):
        raise CliError(f"port {port} is in use on {', '.join(hosts)}; pass another --port, or 0 for any free one", 2)


def _default_or_free(port: int, who: str, hosts: Sequence[str]) -> int:
    """``port`` if every host has it free, else a port that every host has free (printed), below the
    kernel's ephemeral range when it can.

    A port the kernel hands out for ``bind(0)`` comes from the range it also gives every outgoing
    connection: between this choice and the service's bind, another process's connection could
    take it ("127.0.0.1:32897 is in use", once in a CI run with other processes dialing). Below
    the range only another explicit choice collides, and ``iop up`` holds a lock for those.
    """
    chosen, floor = port, _ephemeral_floor()
    for _ in range(_PORT_TRIES):
        if _free(chosen, hosts):
            break
        if floor > _CHOSEN_FROM + _PORT_TRIES:
            chosen = random.randrange(_CHOSEN_FROM, floor)  # noqa: S311 - a port, not a secret
        else:  # a kernel that hands out nearly every port: take what it gives
            with socket.create_server((hosts[0], 0)) as probe:
                chosen = probe.getsockname()[1]
    if chosen != port:
        print(f"port {port} is in use: {who} takes port {chosen}")
    return chosen


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out by itself (Linux's default, 32768, where it cannot say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _tls(state: Path, role: str) -> dict[str, object]:
    return tls_section(state / "certs", role)


def _control_plane_config(state: Path, port: int, listen: Sequence[str]) -> dict[str, object]:
    return {
        "listen": {"host": listen_hosts(listen), "port": port},
        "tls": _tls(state, "control-plane"),
        "store_path": str((state / "control-plane.db").resolve()),
        "metrics": {
            "host": "127.0.0.1",
            "port": _CONTROL_PLANE_METRICS_PORT if _free(_CONTROL_PLANE_METRICS_PORT) else 0,
        },
        "join": _join_section(state),
    }


def _join_section(state: Path) -> dict[str, object]:
    """The control-plane signs joining machines' certificates with the CA's key (``iop join-token create``)."""
    return {"ca_key": str((state / "certs" / "ca.key").resolve())}


def node_config(
    state: Path,
    *,
    node_id: str,
    address: str,
    tls: dict[str, object],
    routes: list[dict[str, Any]] | None,
    server_name: str = "localhost",
) -> dict[str, object]:
    """A node's config: registered with the control-plane at ``address``, no listener of its own,
    its history in ``state``, ``routes`` (None: the mock models). With routes whose server the node
    runs (an ``engine``), their logs, pid files and working folders go to ``state``'s ``models``:
    the node's default is relative to where it was started, which two state folders may share."""
    engines = {"engines_dir": str(servers_dir(state))} if any("engine" in route for route in routes or ()) else {}
    return {
        "node_id": node_id,
        "listen": {"enabled": False},
        "control_plane": {"address": address, "server_name": server_name},
        "tls": tls,
        "store_path": str((state / "node-runs.db").resolve()),
        **engines,
        "metrics": {"host": "127.0.0.1", "port": _NODE_METRICS_PORT if _free(_NODE_METRICS_PORT) else 0},
        "routes": routes
        or [
            {"model": "mock-small", "adapter": "mock", "options": {"tokens": 64, "tokens_per_second": 200}},
            {"model": "mock-fast", "adapter": "mock", "max_concurrency": 64, "options": {"tokens": 256}},
        ],
    }


def _worker_config(state: Path, control_plane: int, port: int, listen: Sequence[str]) -> dict[str, object]:
    return {
        "listen": {"host": listen_hosts(listen), "port": port},
        "tls": _tls(state, "worker"),
        "control_plane": {"address": f"127.0.0.1:{control_plane}", "server_name": "localhost"},
        "store": {"path": str((state / "worker.db").resolve())},
        "metrics_port": _WORKER_METRICS_PORT if _free(_WORKER_METRICS_PORT) else 0,
    }


def _edge_config(state: Path, control_plane: int, port: int, worker: int, listen: Sequence[str]) -> dict[str, object]:
    return {
        "http": {"host": listen_hosts(listen), "port": port},
        "control_plane": {"address": f"127.0.0.1:{control_plane}", "server_name": "localhost"},
        "worker": _worker_address(worker),
        "tls": _tls(state, "edge"),
        "auth": "keys",
        "keys_path": str((state / "edge-keys.db").resolve()),
        "console": _console(state),
    }


def _console(state: Path) -> dict[str, object]:
    """The console's admin certificate: the one minted for the CLI (drain, undrain, remove; every caller's batches)."""
    admin = tls_section(state / "certs", "admin")
    return {"admin_cert": admin["cert"], "admin_key": admin["key"]}


def _worker_address(port: int) -> dict[str, object]:
    return {"address": f"127.0.0.1:{port}", "server_name": "localhost"}


def backend_routes(backend: str) -> list[dict[str, Any]]:
    """One route per model the backend lists, each with the concurrency it can take; CliError (exit 2) if it
    cannot be asked."""
    ollama = backend.startswith("ollama:")
    url = backend.removeprefix("ollama:")
    base = url.rstrip("/").removesuffix("/v1")
    try:
        listing = get_json(base + ("/api/tags" if ollama else "/v1/models"))
        models = listing["models"] if ollama else listing["data"]
        names = [m["name"] for m in models] if ollama else [m["id"] for m in models]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"cannot list the models of the backend at {url}: {reason(exc)}", 2) from None
    if not names:
        raise CliError(f"the backend at {url} serves no models", 2)
    concurrency, source = (OLLAMA_CONCURRENCY, "Ollama's default") if ollama else backend_concurrency(base, models)
    print(f"{url}: max_concurrency {concurrency} per model ({source})")
    adapter = "ollama" if ollama else "vllm"
    return [
        {"model": str(name), "adapter": adapter, "max_concurrency": concurrency, "options": {"base_url": base}}
        for name in names
    ]


def backend_concurrency(base: str, models: list[Any]) -> tuple[int, str]:
    """How many runs at once an OpenAI-compatible server at ``base`` takes, and where that figure came from.

    llama.cpp's server says it (``GET /props``: ``total_slots``; ``GET /slots``: one entry a slot);
    vLLM (its models are ``owned_by: vllm``) batches and queues itself, up to its ``max_num_seqs``
    (default 256); any other server gets ``DEFAULT_CONCURRENCY``, assumed to queue what it cannot run.
    """
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        slots = get_json(base + "/props")["total_slots"]
        if isinstance(slots, int) and slots > 0:
            return slots, "its /props total_slots"
    with contextlib.suppress(OSError, ValueError, TypeError):
        listed = get_json(base + "/slots")
        if isinstance(listed, list) and listed:
            return len(listed), "its /slots"
    if any(isinstance(model, dict) and model.get("owned_by") == "vllm" for model in models):
        return VLLM_CONCURRENCY, "vLLM batches up to max_num_seqs, default 256"
    return DEFAULT_CONCURRENCY, "no slot count served: the default for a server that queues itself"


def _ensure_key(state: Path) -> None:
    secret = state / "api-key"
    if secret.exists():
        return
    from iop_edge.keys import create_key  # the edge's key store: imported only on first start

    try:
        value = create_key((state / "edge-keys.db").resolve(), "local", admin=True)  # the console's every page
    except ValueError as exc:  # the key file holds a 'local' key whose secret was removed
        raise CliError(f"{secret} is missing: {exc} ('iop keys revoke local --dir {state}')") from None
    secret.touch(mode=0o600)
    secret.write_text(value + "\n")
    print(f"created the API key 'local' (kept in {secret})")


# --- YAML values set in place, the rest of the file as the user left it ------------------------------


def _yaml_node(config: Path, keys: tuple[str, str]) -> yaml.Node | None:
    """The node at ``keys`` (section, key) in ``config``: a scalar or a list; None if there is none."""
    try:
        tree = yaml.compose(config.read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return None
    for section, value in tree.value if isinstance(tree, yaml.MappingNode) else ():
        if section.value == keys[0] and isinstance(value, yaml.MappingNode):
            for key, found in value.value:
                if key.value == keys[1] and isinstance(found, yaml.ScalarNode | yaml.SequenceNode):
                    return found
    return None


def yaml_value(config: Path, keys: tuple[str, str]) -> str | None:
    """The scalar at ``keys`` (section, key) in ``config``, as written; None if there is none (or a list)."""
    node = _yaml_node(config, keys)
    return str(node.value) if isinstance(node, yaml.ScalarNode) else None


def _written(node: yaml.Node) -> str | list[str]:
    """A scalar's or a list of scalars' value, as written."""
    return [str(item.value) for item in node.value] if isinstance(node, yaml.SequenceNode) else str(node.value)


def _port_of(config: Path, keys: tuple[str, str], default: int) -> int:
    """The port set at ``keys`` (``default`` when unset); 0 when it is no number: the service will say so."""
    value = yaml_value(config, keys)
    if value is None:
        return default
    return int(value) if value.isdigit() else 0


def set_value(config: Path, keys: tuple[str, str], value: int | str | list[str]) -> None:
    """Write ``value`` at ``keys`` into ``config``, the rest untouched; CliError if there is no such key."""
    node = _yaml_node(config, keys)
    name = ".".join(keys)
    if node is None:
        raise CliError(f"{config} has no {name} to set to {value}: add one, or remove the file to have it rewritten", 2)
    before = _written(node)
    if before != (value if isinstance(value, list) else str(value)):
        text = config.read_text()
        start, end = node.start_mark.index, node.end_mark.index
        end = start + len(text[start:end].rstrip())  # a block sequence ends at the next key: keep its line break
        config.write_text(text[:start] + _as_yaml(value, node) + text[end:])
        print(f"{config}: {name} {_shown(before)} -> {_shown(value)}")


def _as_yaml(value: int | str | list[str], replaced: yaml.Node) -> str:
    """``value`` written where ``replaced`` was: a block sequence (``iop up --listen``'s first write)
    stays one, its items at its column (a flow value there would sit at its key's indentation);
    anything else as JSON, which is YAML in flow style."""
    if isinstance(replaced, yaml.SequenceNode) and not replaced.flow_style and not isinstance(value, int):
        items = value if isinstance(value, list) else [value]
        return ("\n" + " " * replaced.start_mark.column).join(f"- {json.dumps(item)}" for item in items)
    return str(value) if isinstance(value, int) else json.dumps(value)


def _shown(value: int | str | list[str]) -> str:
    return ", ".join(value) if isinstance(value, list) else str(value)


def _has_section(config: Path, section: str) -> bool:
    try:
        data = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and section in data


def add_section(config: Path, section: str, values: dict[str, object]) -> None:
    """Append ``section`` with ``values`` to ``config``, the rest untouched; CliError if it has one already."""
    try:
        tree = yaml.compose(config.read_text(), Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise CliError(f"{config} is not YAML: {str(exc).splitlines()[0]}", 2) from None
    if isinstance(tree, yaml.MappingNode) and any(key.value == section for key, _ in tree.value):
        raise CliError(f"{config} has a {section} section without {section}.address: add one, or remove it", 2)
    text = config.read_text()
    block = yaml.safe_dump({section: values}, sort_keys=False)
    config.write_text(text + ("" if not text or text.endswith("\n") else "\n") + block)
    print(f"{config}: added {section} ({', '.join(f'{k} {v}' for k, v in values.items())})")


# --- small helpers -------------------------------------------------------------------------------------


def get_json(url: str, key: str | None = None) -> Any:
    """``GET url`` (with ``key`` as bearer token), its JSON body parsed."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})  # noqa: S310 - http(s) URLs only
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as answer:  # noqa: S310 - see above
        return json.loads(answer.read())


def reason(exc: BaseException) -> str:
    """A failure to connect or read, in a few words for a one-line message."""
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return str(getattr(exc.reason, "strerror", None) or exc.reason)
    return str(getattr(exc, "strerror", None) or exc) or type(exc).__name__


def _free(port: int, hosts: Sequence[str] = (LOOPBACK,)) -> bool:
    """Whether a server could listen on ``port`` at every one of ``hosts`` (servers reuse addresses:
    TIME_WAIT does not count)."""
    try:
        with contextlib.ExitStack() as held:
            for host in hosts:
                held.enter_context(socket.create_server((host, port)))  # SO_REUSEADDR, as the services
    except OSError:
        return False
    return True
