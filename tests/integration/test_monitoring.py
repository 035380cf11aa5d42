"""services/monitoring: the alert rules and the Grafana dashboard, against promtool and the real services.

promtool (Debian's ``prometheus`` package) checks the rules and runs their unit tests
(``alerts_test.yml``: node-down, error-rate, queue and time-to-first-token alerts fired from
synthetic series), and parses the dashboard's queries as recording rules. Then every metric name
the queries use is looked up in what ``iop up``'s control-plane, node, worker and edge serve on
/metrics after one chat request: a panel or an alert on a name no service exports would show
nothing and never fire.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

MONITORING = Path(__file__).resolve().parents[2] / "services" / "monitoring"
ALERTS = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
IOP = [sys.executable, "-m", "iop_cli.main"]
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY")}
SERVICES = ("control-plane", "node", "worker", "edge")
"""In the order ``iop up`` prints their metrics URLs."""
PROMETHEUS_OWN = frozenset({"up"})
"""Series Prometheus makes itself for every scrape target (no service exports them)."""

# -- the names a PromQL expression reads ---------------------------------------------------------

_TOKENS = re.compile(
    r"""
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<matchers>\{[^}]*\})                       # label matchers: label names and values
    | (?P<range>\[[^\]]*\])                         # ranges and subqueries: [5m], [$__rate_interval]
    | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?[smhdwy]*)
    | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<other>\S)
    """,
    re.VERBOSE,
)
_AGGREGATIONS = frozenset(
    {
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    }
)  # fmt: skip
_LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
"""Keywords followed by a parenthesised list of label names."""
_KEYWORDS = _AGGREGATIONS | _LABEL_LISTS | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: identifiers that are not a function (followed by ``(``), a
    keyword, a label inside braces or a ``by (...)`` list, a string, a number or a range."""
    tokens = [(match.lastgroup, match.group()) for match in _TOKENS.finditer(expr)]
    names: set[str] = set()
    skip_to = 0
    for at, (kind, text) in enumerate(tokens):
        if at < skip_to or kind != "name":
            continue
        following = tokens[at + 1][1] if at + 1 < len(tokens) else ""
        if text in _LABEL_LISTS and following == "(":
            skip_to = next(end for end in range(at, len(tokens)) if tokens[end][1] == ")") + 1
        elif text not in _KEYWORDS and following != "(":
            names.add(text)
    return names


def test_the_name_parser_finds_metrics_and_only_metrics() -> None:
    expr = (
        'sum by (job, model) (rate(iop_a_total{status=~"5..", model="up"}[5m])) / on (job) group_left (model)'
        " max without (le) (iop_b) > bool 0.5e1"
        " unless histogram_quantile(0.95, sum(rate(iop_c_bucket[$__rate_interval])) by (le)) offset 5m and up"
        ' or label_replace(iop_d, "model", "(no model)", "model", "")'
    )
    assert metric_names(expr) == {"iop_a_total", "iop_b", "iop_c_bucket", "up", "iop_d"}


# -- the files -----------------------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels() -> Iterator[dict[str, Any]]:
    for panel in _dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in _panels() for target in panel.get("targets", [])]


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def variable_metrics() -> set[str]:
    """The metrics the dashboard's variables take their values from (``label_values(metric, label)``)."""
    queries = [variable.get("definition", "") for variable in _dashboard()["templating"]["list"]]
    return {match for query in queries for match in re.findall(r"label_values\(\s*(\w+)\s*,", query)}


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = "promtool not installed (Debian: prometheus)"
        if os.environ.get("IOP_BACKENDS_REQUIRED") == "1":
            pytest.fail(f"IOP_BACKENDS_REQUIRED=1 but {reason}")
        pytest.skip(reason)
    return found


def _promtool_run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    command = [_promtool(), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, cwd=MONITORING)


def test_promtool_checks_the_alert_rules() -> None:
    result = _promtool_run("check", "rules", ALERTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in result.stdout


def test_promtool_unit_tests_fire_the_alerts_from_synthetic_series() -> None:
    result = _promtool_run("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        test["alertname"]
        for case in yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
        for test in case.get("alert_rule_test", [])
    }
    assert {
        "IopNodeUnavailable",
        "IopNodeMetricsDown",
        "IopEdgeErrorRate",
        "IopRunsFailing",
        "IopQueueGrowing",
        "IopTimeToFirstTokenHigh",
    } <= tested


def test_promtool_parses_the_dashboard_queries(tmp_path: Path) -> None:
    """Each panel query, its Grafana variables given values, written as a recording rule promtool checks."""
    values = {"$__rate_interval": "5m", "$model": ".*"}
    rules = []
    for number, expr in enumerate(dashboard_exprs()):
        for variable, value in values.items():
            expr = expr.replace(variable, value)  # noqa: PLW2901 - the query as Grafana sends it
        assert "$" not in expr, f"a variable this test does not know: {expr}"
        rules.append({"record": f"iop:dashboard_query_{number}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool_run("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(rules) >= 40


def test_the_dashboard_takes_its_datasource_from_a_variable() -> None:
    """No hard-coded datasource UID: every panel and query names ``${datasource}``, a datasource variable."""
    dashboard = _dashboard()
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    wanted = {"type": "prometheus", "uid": "${datasource}"}
    queried = [panel for panel in _panels() if panel["type"] != "row"]
    assert len(queried) >= 30
    for panel in queried:
        assert panel["datasource"] == wanted, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(target["datasource"] == wanted for target in panel["targets"]), panel["title"]
    uids = re.findall(r'"uid":\s*("[^"]*"|null)', DASHBOARD.read_text())
    assert set(uids) == {'"${datasource}"'}


# -- against the services --------------------------------------------------------------------------


def _iop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=120, check=False, env=ENV)


def _printed(output: str, label: str) -> str:
    return next(line.removeprefix(f"{label}: ") for line in output.splitlines() if line.startswith(f"{label}: "))


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``iop up``'s four services (the node with its mock models): what it printed."""
    state = tmp_path_factory.mktemp("monitoring") / "state"
    started = _iop("up", "--dir", str(state), "--port", "0")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield started.stdout
    finally:
        _iop("down", "--dir", str(state))


def _families(url: str) -> list[Metric]:
    """What the /metrics endpoint at ``url`` serves, parsed."""
    with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 - our own services on loopback
        return list(text_string_to_metric_families(answer.read().decode()))


def _exported(url: str) -> set[str]:
    """The names PromQL can select from what ``url`` serves: each sample's, and each family's by its type
    (a counter family ``x`` is ``x_total``; a histogram ``x`` is ``x_bucket``, ``x_count``, ``x_sum``), so
    a labelled metric with no child yet counts too."""
    exported: set[str] = set()
    for family in _families(url):
        names = {sample.name for sample in family.samples}
        match family.type:
            case "counter":
                names |= {f"{family.name}_total", f"{family.name}_created"}
            case "histogram":
                names |= {f"{family.name}_{suffix}" for suffix in ("bucket", "count", "sum", "created")}
            case "summary":
                names |= {family.name, f"{family.name}_count", f"{family.name}_sum", f"{family.name}_created"}
            case _:
                names.add(family.name)
        exported |= names
    return exported


def _samples(url: str, name: str) -> list[dict[str, str]]:
    """The label sets of the samples named ``name`` at ``url``."""
    return [sample.labels for family in _families(url) for sample in family.samples if sample.name == name]


def _after_a_chat(printed: str) -> dict[str, str]:
    """Each service's metrics URL, once one chat request went through and the node counted its run."""
    from openai import OpenAI

    urls = dict(zip(SERVICES, re.findall(r"metrics (http://127\.0\.0\.1:\d+/metrics)", printed), strict=True))
    with OpenAI(base_url=_printed(printed, "base URL"), api_key=_printed(printed, "API key"), max_retries=0) as client:
        answer = client.chat.completions.create(model="mock-small", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    deadline = time.monotonic() + 10
    while {"model": "mock-small", "status": "completed"} not in _samples(urls["node"], "iop_node_runs_total"):
        assert time.monotonic() < deadline, "the node never counted the run"
        time.sleep(0.05)
    assert {"route": "chat.completions", "model": "mock-small", "status": "200"} in _samples(
        urls["edge"], "iop_edge_requests_total"
    )
    return urls


def test_every_metric_the_dashboard_and_alerts_use_is_exported(platform: str) -> None:
    used = {name for expr in dashboard_exprs() + rule_exprs() for name in metric_names(expr)} | variable_metrics()
    assert len(used) >= 35, sorted(used)  # the parser found the names: the check below is not vacuous
    exported = {service: _exported(url) for service, url in _after_a_chat(platform).items()}
    everywhere = set().union(*exported.values())
    missing = []
    for name in sorted(used - PROMETHEUS_OWN):
        # A service's own metrics must come from that service; the wire's from any of them.
        service = next((s for s in SERVICES if name.startswith(f"iop_{s.replace('-', '_')}_")), None)
        if name not in (everywhere if service is None else exported[service]):
            missing.append(name)
    assert not missing, f"used by the dashboard or the alerts but exported by no service: {missing}"
