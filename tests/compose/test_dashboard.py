"""Static checks of the compose stack's Prometheus and Grafana (no Docker engine, no network).

The Grafana dashboard queries only metrics that docs/metrics.md documents, every panel reads the
provisioned Prometheus datasource, Grafana's dashboard provider points at where the compose file
mounts compose/grafana/dashboards, and Prometheus scrapes every kvmesh service of the compose file.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
PROMETHEUS = COMPOSE_DIR / "prometheus" / "prometheus.yml"
GRAFANA = COMPOSE_DIR / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "kvmesh.yml"
DASHBOARD = GRAFANA / "dashboards" / "kvmesh.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

#: The services whose consumers export ``kvmesh_<service>_consumer_*``.
CONSUMER_SERVICES = ("worker", "scheduler", "kvmanager", "intake")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_DOC_ROW = re.compile(r"^\|\s*`(kvmesh_[a-z0-9_<>]+)`\s*\|\s*([a-z]+)\s*\|")
_NAME_MATCHER = re.compile(r'__name__\s*(=~|=)\s*"((?:[^"\\]|\\.)*)"')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'")
_METRIC = re.compile(r"(?<![A-Za-z0-9_:])kvmesh_[A-Za-z0-9_:]+")


def _yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a mapping"
    return data


def documented_metrics() -> dict[str, str]:
    """Metric name → type from the tables of docs/metrics.md, ``<service>`` rows expanded."""
    out: dict[str, str] = {}
    for line in METRICS_DOC.read_text().splitlines():
        m = _DOC_ROW.match(line.strip())
        if m is None:
            continue
        name, kind = m.groups()
        if "<service>" in name:
            out.update({name.replace("<service>", s): kind for s in CONSUMER_SERVICES})
        else:
            assert "<" not in name, f"unexpected placeholder in {name}"
            out[name] = kind
    return out


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those nested in (collapsed) rows included."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(_panels(panel))
    return out


def _exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every query target of every panel."""
    return [
        (str(panel.get("title")), str(target["expr"]))
        for panel in _panels(dashboard)
        for target in panel.get("targets") or []
        if "expr" in target
    ]


def metric_problems(dashboard: dict[str, Any], known: dict[str, str]) -> list[str]:
    """What in ``dashboard``'s queries names a metric that ``known`` (name → type) lacks."""
    problems: list[str] = []
    for title, expr in _exprs(dashboard):
        rest = expr
        for op, pattern in _NAME_MATCHER.findall(expr):
            if op == "=~":
                regex = re.compile(pattern.encode().decode("unicode_escape"))
                if not any(regex.fullmatch(name) for name in known):  # PromQL regexes are anchored
                    problems.append(f"{title}: __name__=~{pattern!r} matches no documented metric")
            elif pattern not in known:
                problems.append(f"{title}: __name__={pattern!r} is not documented")
        rest = _STRING.sub('""', _NAME_MATCHER.sub("", rest))  # label values are not metric names
        for token in _METRIC.findall(rest):
            name = token
            for suffix in HISTOGRAM_SUFFIXES:
                base = token.removesuffix(suffix)
                if base != token and known.get(base) == "histogram":
                    name = base
                    break
            if name not in known:
                problems.append(f"{title}: {token} is not documented")
    return problems


def _dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def _datasource_uid() -> str:
    sources = _yaml(DATASOURCES)["datasources"]
    assert len(sources) == 1
    assert sources[0]["type"] == "prometheus"
    assert sources[0]["url"] == "http://prometheus:9090"
    return str(sources[0]["uid"])


def _kvmesh_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if (svc.get("command") or [None])[0] == "kvmesh"
    }


def _mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """Container path → host path (resolved against compose/) of ``svc``'s bind mounts."""
    out: dict[str, Path] = {}
    for volume in svc.get("volumes") or []:
        host, container, *_ = str(volume).split(":")
        out[container] = (COMPOSE_DIR / host).resolve()
    return out


def test_doc_parsing_finds_every_table() -> None:
    known = documented_metrics()
    assert known["kvmesh_worker_ttft_seconds"] == "histogram"
    assert known["kvmesh_scheduler_decisions_total"] == "counter"
    assert known["kvmesh_kvmanager_directory_blocks"] == "gauge"
    assert known["kvmesh_intake_ttft_ms"] == "histogram"
    for service in CONSUMER_SERVICES:
        assert known[f"kvmesh_{service}_consumer_lag_records"] == "gauge"
    assert not any("<" in name for name in known)


def test_dashboard_queries_only_documented_metrics() -> None:
    dashboard = _dashboard()
    exprs = _exprs(dashboard)
    assert len(exprs) >= 10
    assert metric_problems(dashboard, documented_metrics()) == []
    # The panels the dashboard is for.
    used = " ".join(expr for _, expr in exprs)
    for name in (
        "kvmesh_worker_ttft_seconds_bucket",
        "kvmesh_worker_prompt_tokens_total",
        "kvmesh_worker_prefix_hit_blocks_total",
        "kvmesh_worker_prefix_lookup_blocks_total",
        "kvmesh_scheduler_ttft_prediction_error_seconds_bucket",
        "kvmesh_scheduler_predicted_hit_tokens_total",
        "kvmesh_scheduler_achieved_hit_tokens_total",
        "kvmesh_scheduler_completed_prompt_tokens_total",
        "kvmesh_worker_queue_depth",
        "kvmesh_worker_tier_used_blocks",
        "_consumer_lag_records",
        "kvmesh_worker_fetch_fallbacks_total",
        "kvmesh_scheduler_decisions_total",
    ):
        assert name in used, f"no panel queries {name}"


def test_checker_rejects_unknown_metrics() -> None:
    known = documented_metrics()
    dashboard = _dashboard()
    assert metric_problems(dashboard, known) == []

    made_up = copy.deepcopy(dashboard)
    panel = next(p for p in _panels(made_up) if p.get("targets"))
    panel["targets"][0]["expr"] = "sum(rate(kvmesh_worker_made_up_total[5m]))"
    assert metric_problems(made_up, known) == [
        f"{panel['title']}: kvmesh_worker_made_up_total is not documented"
    ]

    def problems(expr: str) -> list[str]:
        return metric_problems({"panels": [{"title": "t", "targets": [{"expr": expr}]}]}, known)

    assert problems('{__name__=~"kvmesh_.*_consumer_lag_records"}') == []
    assert problems('{__name__=~"kvmesh_.*_consumer_nope"}') != []
    assert problems('{__name__="kvmesh_worker_nope"}') != []
    assert problems("kvmesh_worker_ttft_seconds_sum / kvmesh_worker_ttft_seconds_count") == []
    assert problems("kvmesh_worker_queue_depth_bucket") != []  # a gauge has no buckets
    assert problems('kvmesh_worker_queue_depth{instance="kvmesh_not_a_metric"}') == []


def test_every_panel_reads_the_provisioned_datasource() -> None:
    uid = _datasource_uid()
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] == "kvmesh"
    assert int(dashboard["schemaVersion"]) >= 36
    panels = [p for p in _panels(dashboard) if p.get("type") != "row"]
    assert panels
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are not unique"
    for panel in panels:
        title = panel.get("title")
        assert panel["type"] == "timeseries", title
        assert panel.get("datasource", {}).get("uid") == uid, f"{title}: datasource is not {uid}"
        assert panel.get("targets"), f"{title} has no queries"
        for target in panel["targets"]:
            assert target.get("datasource", {}).get("uid", uid) == uid, f"{title}: {target}"


def test_dashboard_provider_path_is_the_mounted_dashboards_dir() -> None:
    grafana = _yaml(COMPOSE)["services"]["grafana"]
    assert str(grafana["image"]).startswith("grafana/grafana")
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == (GRAFANA / "provisioning").resolve()
    providers = _yaml(PROVIDERS)["providers"]
    assert providers
    for provider in providers:
        path = str(provider["options"]["path"])
        assert path in mounts, f"provider path {path} is not mounted into grafana"
        assert mounts[path] == DASHBOARD.parent.resolve()
        assert PurePosixPath(path).is_absolute()
    env = grafana["environment"]
    assert str(env["GF_SECURITY_ADMIN_PASSWORD"]).startswith("${")


def test_prometheus_scrapes_every_kvmesh_service() -> None:
    compose = _yaml(COMPOSE)
    prometheus = compose["services"]["prometheus"]
    assert str(prometheus["image"]).startswith("prom/prometheus")
    assert _mounts(prometheus)["/etc/prometheus/prometheus.yml"] == PROMETHEUS.resolve()
    config = _yaml(PROMETHEUS)
    assert config["global"]["scrape_interval"] == "5s"
    targets = {
        str(target)
        for job in config["scrape_configs"]
        for static in job.get("static_configs") or []
        for target in static["targets"]
    }
    services = _kvmesh_services(compose)
    assert len(services) >= 5
    for name, svc in services.items():
        command = svc["command"][1]
        env = {str(k): str(v) for k, v in (svc.get("environment") or {}).items()}
        prefix = f"KVMESH_{command.upper()}_"
        if command == "intake":  # /metrics beside the API
            port = env[f"{prefix}PORT"]
        else:
            port = env[f"{prefix}METRICS_PORT"]
            assert env[f"{prefix}METRICS_HOST"] == "0.0.0.0", f"{name} serves metrics on loopback only"
        assert f"{name}:{port}" in targets, f"prometheus does not scrape {name}:{port}"
