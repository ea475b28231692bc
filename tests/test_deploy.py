"""deploy/: every artifact is checked by the tool its users run it with.

promtool checks and unit-tests the rules, kubectl renders the kustomize
overlays and kubernetes-validate checks every manifest, systemd-analyze
verifies the unit; the dashboard and the configuration reference are
generated and must match; every series they use is a documented one.
`make test` installs promtool (Debian's prometheus package) and sets
KVTIER_REQUIRE_TOOLS=1, so a missing tool fails there instead of skipping.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier import configdoc
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"
K8S = DEPLOY / "kubernetes"
OVERLAYS = [K8S / "base", K8S / "overlays" / "s3", K8S / "overlays" / "peers"]


def tool(name: str) -> str:
    found = shutil.which(name) or next(
        (str(p) for p in [ROOT / ".tools" / "usr" / "bin" / name] if p.exists()), None
    )
    if found is None:
        if os.environ.get("KVTIER_REQUIRE_TOOLS"):
            raise AssertionError(f"{name} is not installed (make test installs it)")
        pytest.skip(f"{name} not installed; `make test` installs it")
    return found


def run(*cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


# -- Prometheus


def test_promtool_checks_the_rules_and_the_scrape_config() -> None:
    promtool = tool("promtool")
    out = run(promtool, "check", "rules", str(PROM / "kvtier-rules.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    out = run(promtool, "check", "config", str(PROM / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_fires_in_the_rule_unit_tests() -> None:
    promtool = tool("promtool")
    out = run(promtool, "test", "rules", "kvtier-rules.test.yml", cwd=PROM)
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = _alerts()
    tested = set(re.findall(r"alertname: (\w+)", (PROM / "kvtier-rules.test.yml").read_text()))
    assert set(alerts) == tested, f"alerts without a unit test: {set(alerts) - tested}"


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROM / "kvtier-rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in _rules() if "alert" in r}


def test_every_alert_has_its_runbook() -> None:
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    for name, rule in _alerts().items():
        assert rule["annotations"]["runbook_url"] == f"docs/runbooks.md#{name.lower()}"
        assert f"\n## {name}\n" in runbooks, f"{name} has no section in docs/runbooks.md"


# -- series


def _documented() -> set[str]:
    rows = re.findall(r"^\| `(kvtier_\w+)` \|", (ROOT / "docs" / "metrics.md").read_text(), re.M)
    return set(rows)


def _series(text: str) -> set[str]:
    used = set(re.findall(r"\bkvtier_[a-z0-9_]+", text))
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}


def test_the_rules_and_the_dashboard_use_only_served_series() -> None:
    # docs/metrics.md lists exactly what the daemon serves (tests/test_metrics.py)
    documented = _documented()
    recorded = {r["record"] for r in _rules() if "record" in r}
    dashboard = (DEPLOY / "grafana" / "kvtier.json").read_text()
    for name, text in (
        ("rules", (PROM / "kvtier-rules.yml").read_text()),
        ("dashboard", dashboard),
    ):
        unknown = _series(text) - documented
        assert not unknown, f"the {name} use series the daemon does not serve: {unknown}"
    used_records = set(re.findall(r"kvtier:[a-z0-9_:]+", dashboard))
    assert used_records <= recorded, used_records - recorded


def test_the_dashboard_is_generated_from_its_code() -> None:
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import dashboard  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    assert (DEPLOY / "grafana" / "kvtier.json").read_text() == dashboard.render(), (
        "deploy/grafana/kvtier.json is stale: run python deploy/grafana/dashboard.py"
    )


# -- configuration


def test_the_configuration_reference_is_current() -> None:
    assert configdoc.missing() == [], "settings without a #: comment in kvtier/config.py"
    page = (ROOT / "docs" / "configuration-reference.md").read_text()
    assert page == configdoc.render(), (
        "docs/configuration-reference.md is stale: "
        "run kvtier config reference > docs/configuration-reference.md"
    )


def test_every_config_example_passes_config_check() -> None:
    examples = [DEPLOY / "kvtier.toml", *sorted(K8S.rglob("*.toml"))]
    assert len(examples) >= 4
    # the peers overlay takes its token and address from the environment
    env = {**os.environ, "KVTIER_PEER__TOKEN": "t", "KVTIER_PEER__ADVERTISE": "10.1.2.3:7480"}
    for path in examples:
        out = run(sys.executable, "-m", "kvtier", "config", "check", str(path), env=env)
        assert out.returncode == 0, f"{path}: {out.stderr}"


# -- Kubernetes


def _rendered(directory: Path) -> list[dict[str, Any]]:
    out = run(tool("kubectl"), "kustomize", str(directory))
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def test_the_kustomize_overlays_render_and_validate() -> None:
    import kubernetes_validate  # type: ignore[import-untyped]

    for directory in OVERLAYS:
        docs = _rendered(directory)
        kinds = {d["kind"] for d in docs}
        assert {"Deployment", "ConfigMap", "PodDisruptionBudget", "PodMonitor"} <= kinds
        for doc in docs:
            if doc["kind"] == "PodMonitor":  # a CRD: no schema ships with Kubernetes
                assert doc["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
                continue
            kubernetes_validate.validate(doc, "1.32.0", strict=True)


def _sidecar(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (kvtier,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert isinstance(kvtier, dict)
    return kvtier


def test_kvtier_runs_as_a_native_sidecar_with_real_probes() -> None:
    docs = _rendered(K8S / "base")
    kvtier = _sidecar(docs)
    assert kvtier["restartPolicy"] == "Always"
    assert kvtier["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert kvtier["livenessProbe"]["httpGet"]["path"] == "/healthz"
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    toml = config["data"]["kvtier.toml"]
    ram = int(re.search(r'capacity = "(\d+)GiB"', toml).group(1))  # type: ignore[union-attr]
    limit = int(kvtier["resources"]["limits"]["memory"].removesuffix("Gi"))
    assert limit > ram, "the container's memory limit must exceed ram.capacity"
    peers = _rendered(K8S / "overlays" / "peers")
    (service,) = [d for d in peers if d["kind"] == "Service"]
    assert service["spec"]["clusterIP"] == "None"
    env = {e["name"]: e for e in _sidecar(peers)["env"]}
    assert env["KVTIER_PEER__TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "kvtier-peer-token"


# -- systemd and the container image


def test_the_systemd_unit_verifies() -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not available here")
    unit = (DEPLOY / "systemd" / "kvtier.service").read_text()
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit
    for setting in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes",
                    "PrivateTmp=yes", "ReadWritePaths=/var/cache/kvtier", "LimitNOFILE=",
                    "RuntimeDirectory=kvtier"):  # fmt: skip
        assert setting in unit, setting
    # verify with this machine's kvtier as ExecStart (the unit's path is an install's)
    kvtier = Path(sys.executable).with_name("kvtier")
    local = unit.replace("/opt/kvtier/.venv/bin/kvtier", str(kvtier))
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvtier-verify-{os.getpid()}.service"
    path.write_text(local)
    try:
        out = run(analyze, "verify", str(path))
    finally:
        path.unlink()
    assert out.returncode == 0 and "kvtier-verify" not in out.stderr, out.stderr


def test_the_container_image_runs_unprivileged_with_a_real_healthcheck() -> None:
    text = (DEPLOY / "container" / "Containerfile").read_text()
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert 'VOLUME ["/run/kvtier", "/var/cache/kvtier"]' in text
    health = re.search(r'CMD \["kvtier", "ping", "--timeout", "2"\]', text)
    assert health, "HEALTHCHECK runs kvtier ping"
    # the healthcheck's command line is one the CLI accepts (and fails without a daemon)
    out = run(
        sys.executable, "-m", "kvtier", "ping", "--timeout", "2", "--socket", "/nonexistent/s"
    )
    assert out.returncode != 0 and "no kvtier daemon" in out.stderr
