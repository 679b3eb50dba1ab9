"""The chart with many replicas (issue 15): the headless peers Service, CACHEWITNESS_PEERS_DNS, the PrometheusRule."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from proxy.config.load import load_settings
from proxy.sim import running_sim
from tests.support.client import CLIENT_TIMEOUT
from tests.support.helm import (
    KUBE_VERSIONS,
    Manifest,
    client_service,
    env_values,
    helm_template,
    kinds,
    only,
    peers_service,
    pod_spec,
    render,
    render_text,
    sidecar,
    validate,
)
from tests.support.kv_events import Ports, engine
from tests.support.sidecar import serve_sidecar

REPLICAS_3 = ("--set", "replicaCount=3")
ALERTS = ("--set", "prometheusRule.enabled=true")


def matches(selector: Manifest, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, and Exists/DoesNotExist/In/NotIn expressions) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if not {
            "Exists": present,
            "DoesNotExist": not present,
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
        }[operator]:
            return False
    return True


def test_replicas_3_renders_a_headless_service_over_the_same_pods() -> None:
    """replicaCount 3: three replicas, and a headless Service selecting them on the sidecar's port."""
    manifests = render(*REPLICAS_3)
    assert only(manifests, "Deployment")["spec"]["replicas"] == 3
    headless = peers_service(manifests)
    pod_labels = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    (port,) = headless["spec"]["ports"]
    container_ports = {p["name"]: p["containerPort"] for p in sidecar(manifests)["ports"]}
    assert container_ports[port["targetPort"]] == port["port"] == 8000


def pod_labels(manifests: list[Manifest]) -> dict[str, str]:
    """The labels of the Deployment's pods."""
    labels: dict[str, str] = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    return labels


def test_one_replica_is_recreated_with_no_budget_and_no_spread() -> None:
    """replicaCount 1: Recreate (its GPU is freed first), no PodDisruptionBudget (it would block every
    drain), no topology spread."""
    manifests = render()
    deployment = only(manifests, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "PodDisruptionBudget" not in kinds(manifests)
    assert "topologySpreadConstraints" not in deployment["spec"]["template"]["spec"]


def test_three_replicas_roll_one_at_a_time_under_a_budget_spread_over_nodes() -> None:
    """replicaCount 3: RollingUpdate without surge, one pod down at a time; a PDB over the same pods;
    a soft spread over hostnames counting only the pods of one template."""
    manifests = render(*REPLICAS_3)
    deployment = only(manifests, "Deployment")
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    budget = only(manifests, "PodDisruptionBudget")
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"]["maxUnavailable"] == 1 and "minAvailable" not in budget["spec"]
    assert matches(budget["spec"]["selector"], pod_labels(manifests))
    (spread,) = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["maxSkew"], spread["whenUnsatisfiable"]) == (
        "kubernetes.io/hostname", 1, "ScheduleAnyway",
    )  # fmt: skip
    assert matches(spread["labelSelector"], pod_labels(manifests))
    assert spread["matchLabelKeys"] == ["pod-template-hash"]


def test_budget_takes_min_available_and_refuses_both_bounds() -> None:
    """pdb.minAvailable replaces the default maxUnavailable 1; both set is refused at render time."""
    budget = only(render(*REPLICAS_3, "--set", "pdb.minAvailable=2"), "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 2 and "maxUnavailable" not in budget["spec"]
    both = helm_template(*REPLICAS_3, "--set", "pdb.minAvailable=2", "--set", "pdb.maxUnavailable=1")
    assert both.returncode != 0 and "not both" in both.stderr
    assert "PodDisruptionBudget" not in kinds(render(*REPLICAS_3, "--set", "pdb.enabled=false"))


def test_given_spread_constraints_get_the_pods_selector_and_a_given_strategy_wins() -> None:
    """topologySpreadConstraints from values are used (a missing labelSelector filled in); strategy too."""
    manifests = render(
        *REPLICAS_3,
        "--set", "topologySpreadConstraints[0].maxSkew=1",
        "--set", "topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "--set", "topologySpreadConstraints[0].whenUnsatisfiable=DoNotSchedule",
        "--set", "strategy.type=Recreate",
    )  # fmt: skip
    spec = only(manifests, "Deployment")["spec"]
    (spread,) = spec["template"]["spec"]["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == (
        "topology.kubernetes.io/zone",
        "DoNotSchedule",
    )
    assert matches(spread["labelSelector"], pod_labels(manifests))
    assert spec["strategy"] == {"type": "Recreate"}


def _admitted(policy: Manifest, namespace: str, labels: dict[str, str]) -> bool:
    """Whether the policy's one ingress rule admits a pod with these labels in this namespace."""
    (rule,) = policy["spec"]["ingress"]
    for peer in rule["from"]:
        if "namespaceSelector" in peer:
            if matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace}):
                return True
        elif namespace == "ns" and matches(peer["podSelector"], labels):
            return True
    return False


def test_network_policy_opens_only_the_sidecar_port_to_clients_peers_and_helm_test() -> None:
    """networkPolicy.enabled: ingress to the pods on the sidecar's port only (the engine's is in no rule),
    from clientNamespaces (default the release's), the release's pods and helm test's pod."""
    assert "NetworkPolicy" not in kinds(render())
    manifests = render(*REPLICAS_3, "--set", "networkPolicy.enabled=true")
    policy = only(manifests, "NetworkPolicy")
    assert matches(policy["spec"]["podSelector"], pod_labels(manifests))
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    # The probe listener is the kubelet's (from the node), in no rule: clients reach only "http".
    assert {p["name"] for p in sidecar(manifests)["ports"]} == {"http", "health"}
    assert "ports" not in next(c for c in pod_spec(manifests)["containers"] if c["name"] == "engine")
    (test_pod,) = [m for m in manifests if m["kind"] == "Pod"]
    assert _admitted(policy, "ns", {"app": "client"})
    assert _admitted(policy, "ns", pod_labels(manifests))
    assert _admitted(policy, "ns", test_pod["metadata"]["labels"])
    assert not _admitted(policy, "elsewhere", {"app": "client"})
    listed = only(
        render(*REPLICAS_3, "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.clientNamespaces={gateway,monitoring}"),
        "NetworkPolicy",
    )  # fmt: skip
    assert _admitted(listed, "gateway", {}) and _admitted(listed, "monitoring", {})
    assert not _admitted(listed, "ns", {"app": "client"})
    assert _admitted(listed, "ns", pod_labels(manifests))  # peers still reach each other


def test_sidecar_resolves_the_headless_service_by_its_cluster_name(tmp_path: Path) -> None:
    """CACHEWITNESS_PEERS_DNS is the headless Service's FQDN, absolute (no search-domain tries), and valid."""
    manifests = render(*REPLICAS_3, "--set", "peers.clusterDomain=k8s.example")
    name = peers_service(manifests)["metadata"]["name"]
    env = env_values(sidecar(manifests))
    assert env["CACHEWITNESS_PEERS_DNS"] == f"{name}.ns.svc.k8s.example."
    token_file = tmp_path / "token"
    token_file.write_text("t", encoding="utf-8")
    settings = load_settings({}, env={**env, "CACHEWITNESS_ADMIN_TOKEN_FILE": str(token_file)})
    assert settings.peers_dns == f"{name}.ns.svc.k8s.example."
    assert settings.listen_port == 8000  # the port peers are called on


def test_peers_can_be_switched_off() -> None:
    """peers.enabled=false: no headless Service and no CACHEWITNESS_PEERS_DNS."""
    manifests = render("--set", "peers.enabled=false")
    assert kinds(manifests).count("Service") == 1
    assert "CACHEWITNESS_PEERS_DNS" not in env_values(sidecar(manifests))


def test_service_monitor_scrapes_through_the_client_service_only() -> None:
    """The ServiceMonitor selects the client Service and not the headless one (pods scraped once)."""
    manifests = render(*REPLICAS_3, "--set", "serviceMonitor.enabled=true")
    selector = only(manifests, "ServiceMonitor")["spec"]["selector"]
    assert matches(selector, client_service(manifests)["metadata"]["labels"])
    assert not matches(selector, peers_service(manifests)["metadata"]["labels"])


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_replicas_3_with_alerts_validates_strictly(kube_version: str) -> None:
    """Three replicas, peers, monitors and the PrometheusRule: kubernetes-validate --strict passes."""
    text = render_text(*REPLICAS_3, *ALERTS, "--set", "serviceMonitor.enabled=true")
    result = validate(text, kube_version)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the PrometheusRule (a CRD: no bundled schema, so its shape is checked here) ---------------

EXPECTED_ALERTS = {
    "CachewitnessResetFailed",
    "CachewitnessResetContradicted",
    "CachewitnessTrafficContradicted",
    "CachewitnessUpstreamDown",
    "CachewitnessEngineNotStarted",
    "CachewitnessEvidenceLost",
    "CachewitnessCacheHitRatioDropped",
    "CachewitnessBypassTraffic",
    "CachewitnessKvEventsGap",
    "CachewitnessKvEventsDown",
    "CachewitnessKvEventsForeignPublisher",
    "CachewitnessEngineRestarted",
    "CachewitnessSlowBodies",
}
RULE_KEYS = {"alert", "expr", "for", "labels", "annotations"}


def rules() -> list[Manifest]:
    """The alerting rules of the rendered PrometheusRule."""
    rule = only(render(*ALERTS), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    (group,) = rule["spec"]["groups"]
    found: list[Manifest] = group["rules"]
    return found


def test_prometheus_rule_is_off_by_default() -> None:
    """No PrometheusRule unless asked for (the CRD may not be installed)."""
    assert "PrometheusRule" not in kinds(render())


def test_prometheus_rule_has_the_alerts_ops_want() -> None:
    """Reset failures, contradicted resets and traffic, upstream down 2 min, evidence lost, hit ratio drop,
    bypass, KV-events gaps and silence, engine restarts; well formed."""
    found = rules()
    assert {r["alert"] for r in found} == EXPECTED_ALERTS
    for rule in found:
        assert set(rule) <= RULE_KEYS, rule
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert 'namespace="ns"' in rule["expr"]
    down = next(r for r in found if r["alert"] == "CachewitnessUpstreamDown")
    assert down["for"] == "2m" and "cachewitness_upstream_up" in down["expr"]


SELECTOR = re.compile(r"(cachewitness_\w+)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|=)\s*"([^"]*)"')


def _series_labels(text: str) -> dict[str, list[dict[str, str]]]:
    """name -> label dicts, from the exposition."""
    out: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head = line.rsplit(" ", 1)[0]
        name, _, body = head.partition("{")
        labels = {key: value for key, _, value in MATCHER.findall(body)}
        out.setdefault(name, []).append(labels)
    return out


async def test_every_alert_selects_series_the_sidecar_exports(tmp_path: Path) -> None:
    """Each metric an alert reads exists in a live sidecar's /metrics, with the label values it matches
    (a metric renamed on one side only fails here). The sidecar follows the engine's KV events, so
    the KV events alerts read real series too."""
    ports = Ports()
    async with (
        running_sim(engine("vllm", ports)) as upstream,
        serve_sidecar(upstream, tmp_path, kv_events_endpoint=ports.endpoint) as sidecar,
    ):
        async with (
            aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http,
            http.get(f"{sidecar.url}/metrics") as response,
        ):
            exported = _series_labels(await response.text())
    for rule in rules():
        selectors = SELECTOR.findall(rule["expr"])
        assert selectors, rule["alert"]
        for name, matchers in selectors:
            assert name in exported, f"{rule['alert']}: {name} is not exported"
            for label, operator, value in MATCHER.findall(matchers):
                if label == "namespace":
                    continue  # added by the scrape, not by the sidecar
                wanted = value.split("|") if operator == "=~" else [value]
                have = {series.get(label) for series in exported[name]}
                assert set(wanted) <= have, f"{rule['alert']}: {name}{{{label}}} has {have}, not {wanted}"
