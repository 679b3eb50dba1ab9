"""The Helm chart's contract: native sidecar wiring, token handling, probes, shutdown, presets, monitors.

Renders helm/cachewitness with the pinned helm from .cache/tools (scripts/install-deploy-tools.sh)
and reads the manifests through the tools venv's PyYAML, so the project venv needs nothing more.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from proxy.config.load import load_settings
from proxy.config.options import OPTIONS
from tests.support.helm import (
    CHART,
    EXAMPLES,
    HADOLINT,
    HELM,
    KUBE_VERSIONS,
    PRESETS,
    ROOT,
    Manifest,
    client_service,
    engine,
    env_of,
    env_values,
    flag_value,
    helm_template,
    kinds,
    only,
    pod_spec,
    render,
    render_text,
    sidecar,
    validate,
    yaml_documents,
)

# --- the native sidecar and its wiring -------------------------------------------------------


def test_sidecar_is_a_native_sidecar_init_container() -> None:
    """cachewitness runs as an init container with restartPolicy Always, not as a plain container."""
    manifests = render()
    assert sidecar(manifests)["restartPolicy"] == "Always"
    assert "cachewitness" not in [c["name"] for c in pod_spec(manifests)["containers"]]


@pytest.mark.parametrize("preset", PRESETS)
def test_sidecar_upstream_is_the_engines_pod_local_port(preset: str) -> None:
    """CACHEWITNESS_UPSTREAM points at 127.0.0.1 on the port the engine was told to bind."""
    manifests = render("--set", f"engine.preset={preset}", "--set", "engine.port=8311")
    argv = engine(manifests)["command"]
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8311"
    assert env_values(sidecar(manifests))["CACHEWITNESS_UPSTREAM"] == "http://127.0.0.1:8311"


def test_engine_exposes_no_container_port() -> None:
    """The engine's port is pod-local: no containerPort for it, so nothing can target it."""
    assert "ports" not in engine(render())


def test_service_targets_the_sidecar_port() -> None:
    """The Service port 8000 resolves to the sidecar's container port, which it listens on."""
    manifests = render()
    (service_port,) = client_service(manifests)["spec"]["ports"]
    ports = {p["name"]: p["containerPort"] for p in sidecar(manifests)["ports"]}
    assert service_port["port"] == 8000
    assert ports[service_port["targetPort"]] == 8000
    assert env_values(sidecar(manifests))["CACHEWITNESS_LISTEN"] == "0.0.0.0:8000"


def test_service_selects_the_pod_but_not_the_helm_test_pod() -> None:
    """The Service selector matches the Deployment's pods and not the `helm test` pod."""
    manifests = render()
    selector = client_service(manifests)["spec"]["selector"]
    pod_labels = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    (test_pod,) = [m for m in manifests if m["kind"] == "Pod"]
    assert selector.items() <= pod_labels.items()
    assert not selector.items() <= test_pod["metadata"]["labels"].items()


def test_sidecar_env_is_a_valid_cachewitness_configuration(tmp_path: Path) -> None:
    """Every CACHEWITNESS_* variable the chart sets is a real `serve` option and parses."""
    env = env_values(sidecar(render()))
    known = {f"CACHEWITNESS_{option.name.upper()}" for option in OPTIONS}
    assert set(env) <= known, f"unknown settings: {sorted(set(env) - known)}"
    token_file = tmp_path / "admin-token"
    token_file.write_text("t0ken\n", encoding="utf-8")
    settings = load_settings({}, env={**env, "CACHEWITNESS_ADMIN_TOKEN_FILE": str(token_file)})
    assert (settings.upstream, settings.listen, settings.engine) == (
        "http://127.0.0.1:8200",
        "0.0.0.0:8000",
        "vllm",
    )
    # Benchmark tools' own reset calls get the uniform reset; control routes stay closed.
    assert (settings.native_resets, settings.engine_routes) == ("uniform", "admin")


def test_sidecar_image_must_name_a_registry() -> None:
    """No bare `cachewitness:0.1.0` (a node would pull it from Docker Hub): rendering without a
    repository fails saying what to set, one without a registry fails the schema."""
    empty = helm_template("--set", "sidecar.image.repository=")
    assert empty.returncode != 0
    assert "sidecar.image.repository must name your registry" in empty.stderr
    bare = helm_template("--set", "sidecar.image.repository=cachewitness")
    assert bare.returncode != 0 and "sidecar.image.repository" in bare.stderr
    assert sidecar(render())["image"] == "registry.example.com/cachewitness:0.1.0"


PINNED_TAGS = {
    "vllm": re.compile(r"v\d+\.\d+\.\d+"),
    "sglang": re.compile(r"v\d+\.\d+\.\d+"),
    "llamacpp": re.compile(r"server-cuda-b\d+"),
    "trtllm": re.compile(r"\d+\.\d+\.\d+(rc\d+)?"),
}


@pytest.mark.parametrize(
    "source", ["preset", "values-sglang.yaml", "values-llamacpp.yaml", "values-trtllm.yaml"]
)
def test_engine_images_are_pinned_releases(source: str) -> None:
    """Every preset and example names a release of its engine, never a floating tag (server-cuda,
    latest); SGLang is the release its routes were checked against."""
    renders = (
        {preset: render("--set", f"engine.preset={preset}") for preset in PINNED_TAGS}
        if source == "preset"
        else {"example": render("-f", str(EXAMPLES / source))}
    )
    for manifests in renders.values():
        preset = only(manifests, "Deployment")["metadata"]["labels"]["cachewitness.io/engine"]
        tag = engine(manifests)["image"].rsplit(":", 1)[1]
        assert PINNED_TAGS[preset].fullmatch(tag), (preset, tag)
        if preset == "sglang":
            assert tag == "v0.5.23"


def test_evidence_signing_key_is_mounted_and_passed_only_when_set() -> None:
    """evidence.signingKey.existingSecret: its key mounted read-only and given as
    --evidence-signing-key-file; unset, neither (and no Secret is generated for it)."""
    assert "args" not in sidecar(render())
    assert "evidence-signing-key" not in {v["name"] for v in pod_spec(render())["volumes"]}
    manifests = render("--set", "evidence.signingKey.existingSecret=evidence-key")
    container = sidecar(manifests)
    assert container["args"][0] == "--evidence-signing-key-file"
    path = Path(container["args"][1])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "evidence-signing-key")
    assert mount["readOnly"] is True and path.parent == Path(mount["mountPath"])
    volume = next(v for v in pod_spec(manifests)["volumes"] if v["name"] == "evidence-signing-key")
    assert volume["secret"]["secretName"] == "evidence-key"
    assert volume["secret"]["items"] == [{"key": "signing-key", "path": path.name}]
    assert kinds(manifests).count("Secret") == 1  # the admin token's only


# --- the admin token --------------------------------------------------------------------------


def test_admin_token_reaches_the_sidecar_only_through_a_secret_volume() -> None:
    """The generated token is in the Secret, mounted as a file; no env var or value carries it."""
    manifests = render()
    secret = only(manifests, "Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    container = sidecar(manifests)
    token_path = env_values(container)["CACHEWITNESS_ADMIN_TOKEN_FILE"]
    mount = next(m for m in container["volumeMounts"] if token_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod_spec(manifests)["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert volume["secret"]["items"] == [{"key": "token", "path": token_path.rsplit("/", 1)[1]}]
    assert "CACHEWITNESS_ADMIN_TOKEN" not in env_of(container)
    assert token not in json.dumps(only(manifests, "Deployment"))


def test_generated_admin_token_is_48_random_characters() -> None:
    """Without an existing Secret the chart generates a 48-character alphanumeric token."""
    token = base64.b64decode(only(render(), "Secret")["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)


def test_existing_secret_is_mounted_and_none_is_generated() -> None:
    """adminToken.existingSecret: no Secret rendered, the named one and its key are mounted."""
    manifests = render("--set", "adminToken.existingSecret=bench-token", "--set", "adminToken.key=bearer")
    assert "Secret" not in kinds(manifests)
    volume = next(v for v in pod_spec(manifests)["volumes"] if v["name"] == "admin-token")
    assert volume["secret"]["secretName"] == "bench-token"
    assert volume["secret"]["items"][0]["key"] == "bearer"


# --- probes and shutdown ----------------------------------------------------------------------


def test_sidecar_probes_use_health_and_ready_routes() -> None:
    """Startup and liveness on /-/healthy (never gated on the engine), readiness on /-/ready, all on
    the probe listener's own port (health_listen), which the Service does not expose."""
    manifests = render()
    container = sidecar(manifests)
    paths = {
        kind: container[kind]["httpGet"]["path"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert paths == {
        "startupProbe": "/-/healthy",
        "readinessProbe": "/-/ready",
        "livenessProbe": "/-/healthy",
    }
    assert {container[kind]["httpGet"]["port"] for kind in paths} == {"health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "health": 8001}
    assert env_values(container)["CACHEWITNESS_HEALTH_LISTEN"] == "0.0.0.0:8001"
    assert [p["targetPort"] for p in client_service(manifests)["spec"]["ports"]] == ["http"]


def test_sidecar_probes_use_the_main_port_without_a_health_port() -> None:
    """sidecar.healthPort=null: no probe listener, the probes go to the main port."""
    container = sidecar(render("--set", "sidecar.healthPort=null"))
    kinds = ("startupProbe", "readinessProbe", "livenessProbe")
    assert {container[kind]["httpGet"]["port"] for kind in kinds} == {"http"}
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert "CACHEWITNESS_HEALTH_LISTEN" not in env_values(container)


def test_a_health_port_equal_to_the_main_port_is_refused() -> None:
    """The probe listener cannot share the main listener's port: the render fails and says so."""
    result = helm_template("--set", "sidecar.healthPort=8000")
    assert result.returncode != 0
    assert "sidecar.healthPort=8000 is sidecar.port too" in result.stderr


def test_sidecar_liveness_tolerates_a_pause_and_readiness_stays_fast() -> None:
    """Liveness restarts the sidecar after 3 missed probes 10 s apart, not on one slow second;
    readiness still follows the engine within seconds."""
    container = sidecar(render())
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    assert (liveness["periodSeconds"], liveness["failureThreshold"]) == (10, 3)
    assert readiness["periodSeconds"] == 1 and readiness["failureThreshold"] <= 3


def test_engine_startup_probe_tolerates_ten_minutes_of_model_loading() -> None:
    """The engine's startup probe polls every second for 600 tries before liveness applies."""
    probe = engine(render())["startupProbe"]
    assert probe["periodSeconds"] == 1
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 600
    assert "http://127.0.0.1:8200/health" in " ".join(probe["exec"]["command"])


def test_engine_has_a_prestop_sleep() -> None:
    """The engine (stopped before the sidecar) sleeps in preStop so routes go away first."""
    assert engine(render())["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]


def _required_grace(manifests: list[Manifest]) -> float:
    """preStop sleep + drain + retry + attempt timeout + grace, read from the rendered pod."""
    env = env_values(sidecar(manifests))
    prestop = float(engine(manifests)["lifecycle"]["preStop"]["exec"]["command"][1])
    names = ("DRAIN_TIMEOUT", "RETRY_SECONDS", "RESET_ATTEMPT_TIMEOUT", "GRACE_PERIOD")
    return prestop + sum(float(env[f"CACHEWITNESS_{name}"]) for name in names)


@pytest.mark.parametrize(
    "overrides",
    [(), ("--set", "sidecar.drainTimeoutSeconds=300", "--set", "engine.preStopSleepSeconds=45")],
    ids=["defaults", "long-drain"],
)
def test_grace_period_covers_prestop_and_worst_case_drain(overrides: tuple[str, ...]) -> None:
    """terminationGracePeriodSeconds >= preStop + drain + retry + attempt timeout + grace."""
    manifests = render(*overrides)
    assert pod_spec(manifests)["terminationGracePeriodSeconds"] >= _required_grace(manifests)


def test_grace_period_arithmetic_is_written_beside_it() -> None:
    """The rendered Deployment shows the sum that makes the grace period."""
    assert "#   = 120 s" in render_text()


def test_grace_period_below_the_worst_case_is_refused() -> None:
    """An explicit termination.gracePeriodSeconds shorter than the sum fails the render."""
    result = helm_template("--set", "termination.gracePeriodSeconds=60")
    assert result.returncode != 0
    assert "termination.gracePeriodSeconds=60 is below" in result.stderr


def test_pod_does_not_get_service_link_env_vars() -> None:
    """enableServiceLinks is false (no VLLM_PORT=tcp://... from a Service named vllm)."""
    assert pod_spec(render())["enableServiceLinks"] is False


@pytest.mark.parametrize("container_of", [sidecar, engine], ids=["sidecar", "engine"])
def test_containers_run_non_root_without_privileges(container_of: Any) -> None:
    """Each container: non-root, no privilege escalation, ALL capabilities dropped, seccomp RuntimeDefault."""
    context = container_of(render())["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["seccompProfile"]["type"] == "RuntimeDefault"


def test_sidecar_root_filesystem_is_read_only() -> None:
    """The sidecar writes only to its evidence volume."""
    assert sidecar(render())["securityContext"]["readOnlyRootFilesystem"] is True


# --- values schema ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("sidecar.drainTimeoutSeconds=abc", "sidecar.drainTimeoutSeconds: Invalid type"),
        ("engine.preset=tgi", "engine.preset"),
        ("engine.bogus=1", "Additional property bogus is not allowed"),
        ("sidecar.retrySeconds=500", "sidecar.retrySeconds"),
    ],
    ids=["wrong-type", "unknown-preset", "unknown-key", "out-of-range"],
)
def test_schema_rejects_bad_values(setting: str, message: str) -> None:
    """values.schema.json refuses wrong types, unknown keys and out-of-range values."""
    result = helm_template("--set", setting)
    assert result.returncode != 0
    assert message in result.stderr


# --- engine presets ---------------------------------------------------------------------------


def test_vllm_preset_enables_prefix_caching_details_and_dev_mode() -> None:
    """vLLM: prefix caching and prompt-token details on, VLLM_SERVER_DEV_MODE=1 for the reset route."""
    container = engine(render())
    assert container["command"][:2] == ["vllm", "serve"]
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(container["command"])
    assert env_values(container)["VLLM_SERVER_DEV_MODE"] == "1"


def test_sglang_preset_enables_cache_report_and_metrics() -> None:
    """SGLang: --enable-cache-report and --enable-metrics, and no vLLM dev mode."""
    container = engine(render("--set", "engine.preset=sglang"))
    assert {"--enable-cache-report", "--enable-metrics"} <= set(container["command"])
    assert "VLLM_SERVER_DEV_MODE" not in env_of(container)
    assert env_values(sidecar(render("--set", "engine.preset=sglang")))["CACHEWITNESS_ENGINE"] == "sglang"


def test_trtllm_preset_turns_on_perf_metrics_and_block_reuse() -> None:
    """TensorRT-LLM: trtllm-serve with an options file written at start (return_perf_metrics for
    /prometheus/metrics, block reuse for prefix caching); extraArgs reach trtllm-serve; no vLLM dev mode."""
    manifests = render("--set", "engine.preset=trtllm", "--set-string", "engine.extraArgs={--tp_size,2}")
    container = engine(manifests)
    argv = container["command"]
    assert argv[:2] == ["/bin/sh", "-c"] and argv[3] == "trtllm-serve"
    assert argv[-2:] == ["--tp_size", "2"]
    options = flag_value(argv, "--extra_llm_api_options")
    assert f"> {options} && exec trtllm-serve" in argv[2]
    for line in ("'return_perf_metrics: true'", "'kv_cache_config:'", "'  enable_block_reuse: true'"):
        assert line in argv[2]
    mount = next(m for m in container["volumeMounts"] if options.startswith(m["mountPath"] + "/"))
    assert mount["name"] == "engine-cache"  # writable: the engine's root filesystem may not be
    assert "VLLM_SERVER_DEV_MODE" not in env_of(container)
    assert "--kv-events-config" not in argv
    assert env_values(sidecar(manifests))["CACHEWITNESS_ENGINE"] == "trtllm"


def test_llamacpp_preset_saves_slots_on_an_emptydir_and_disables_ram_cache() -> None:
    """llama.cpp: --slot-save-path on an emptyDir mount, --cache-ram 0, --metrics, --slots."""
    manifests = render("--set", "engine.preset=llamacpp")
    container = engine(manifests)
    argv = container["command"]
    assert flag_value(argv, "--cache-ram") == "0"
    assert {"--metrics", "--slots"} <= set(argv)
    slot_dir = flag_value(argv, "--slot-save-path")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == slot_dir)
    volume = next(v for v in pod_spec(manifests)["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume


def test_llamacpp_model_path_uses_model_flag() -> None:
    """llama.cpp: a model starting with / is a file (--model), otherwise a HF repo (--hf-repo)."""
    argv = engine(render("--set", "engine.preset=llamacpp", "--set", "engine.model=/models/m.gguf"))[
        "command"
    ]
    assert flag_value(argv, "--model") == "/models/m.gguf"
    assert "--hf-repo" not in argv


@pytest.mark.parametrize("example", ["values-sglang.yaml", "values-llamacpp.yaml"])
def test_example_values_select_their_preset(example: str) -> None:
    """The per-preset values examples render with their engine and matching sidecar dialect."""
    manifests = render("-f", str(EXAMPLES / example))
    preset = example.removeprefix("values-").removesuffix(".yaml")
    assert only(manifests, "Deployment")["metadata"]["labels"]["cachewitness.io/engine"] == preset
    assert env_values(sidecar(manifests))["CACHEWITNESS_ENGINE"] == preset


# --- evidence volume --------------------------------------------------------------------------


def _evidence_volume(manifests: list[Manifest]) -> Manifest:
    """The volume mounted at the directory of CACHEWITNESS_EVIDENCE."""
    container = sidecar(manifests)
    directory = env_values(container)["CACHEWITNESS_EVIDENCE"].rsplit("/", 1)[0]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == directory)
    volume: Manifest = next(v for v in pod_spec(manifests)["volumes"] if v["name"] == mount["name"])
    return volume


def test_evidence_is_on_an_emptydir_by_default() -> None:
    """Evidence goes to an emptyDir and no claim is rendered."""
    manifests = render()
    assert "emptyDir" in _evidence_volume(manifests)
    assert "PersistentVolumeClaim" not in kinds(manifests)


def test_evidence_persistence_renders_and_mounts_a_claim() -> None:
    """evidence.persistence.enabled: a PVC is rendered and mounted at the evidence directory."""
    manifests = render("--set", "evidence.persistence.enabled=true")
    claim = only(manifests, "PersistentVolumeClaim")
    assert _evidence_volume(manifests)["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_evidence_existing_claim_is_mounted_without_rendering_one() -> None:
    """evidence.persistence.existingClaim: mounted as is, no PVC rendered."""
    manifests = render(
        "--set", "evidence.persistence.enabled=true", "--set", "evidence.persistence.existingClaim=ev"
    )
    assert "PersistentVolumeClaim" not in kinds(manifests)
    assert _evidence_volume(manifests)["persistentVolumeClaim"]["claimName"] == "ev"


# --- monitoring and dashboard -----------------------------------------------------------------


def test_monitors_and_dashboard_are_off_by_default() -> None:
    """No ServiceMonitor, PodMonitor or dashboard ConfigMap unless asked for."""
    assert not {"ServiceMonitor", "PodMonitor", "ConfigMap"} & set(kinds(render()))


def test_service_monitor_scrapes_the_sidecar_metrics_through_the_service() -> None:
    """ServiceMonitor (monitoring.coreos.com/v1): the Service's http port, /metrics, every 30 s."""
    manifests = render("--set", "serviceMonitor.enabled=true", "--set", "serviceMonitor.labels.release=prom")
    monitor = only(manifests, "ServiceMonitor")
    service = client_service(manifests)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert set(monitor["spec"]) == {"namespaceSelector", "selector", "endpoints"}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ns"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_pod_monitor_scrapes_the_sidecar_container_port() -> None:
    """PodMonitor (monitoring.coreos.com/v1): the sidecar's named container port, /metrics."""
    manifests = render("--set", "podMonitor.enabled=true")
    monitor = only(manifests, "PodMonitor")
    pod_labels = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) == {"namespaceSelector", "selector", "podMetricsEndpoints"}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    assert endpoint["port"] in {p["name"] for p in sidecar(manifests)["ports"]}


def test_dashboard_configmap_is_labelled_for_grafana_and_holds_the_chart_dashboard() -> None:
    """dashboard.enabled: a ConfigMap labelled grafana_dashboard "1" with the chart's dashboard JSON."""
    configmap = only(render("--set", "dashboard.enabled=true"), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "cachewitness.json").read_text(encoding="utf-8"))
    assert json.loads(configmap["data"]["cachewitness.json"]) == shipped


def test_chart_dashboard_is_a_copy_of_the_config_dashboard() -> None:
    """helm/cachewitness/dashboards/cachewitness.json equals config/grafana-dashboard.json."""
    source = ROOT / "config" / "grafana-dashboard.json"
    copy_in_chart = json.loads((CHART / "dashboards" / "cachewitness.json").read_text(encoding="utf-8"))
    assert copy_in_chart == json.loads(source.read_text(encoding="utf-8")), (
        "copy config/grafana-dashboard.json to helm/cachewitness/dashboards/cachewitness.json"
    )


# --- schema validation of everything rendered -------------------------------------------------


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_full_render_validates_strictly(kube_version: str) -> None:
    """Everything on (monitors, dashboard, PVC) still validates with --strict for 1.29 and 1.33."""
    text = render_text(
        "--set", "serviceMonitor.enabled=true", "--set", "podMonitor.enabled=true",
        "--set", "dashboard.enabled=true", "--set", "evidence.persistence.enabled=true",
    )  # fmt: skip
    result = validate(text, kube_version)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_refuses_kubernetes_without_native_sidecars() -> None:
    """kubeVersion >= 1.29 in Chart.yaml: rendering for 1.28 fails instead of deploying a broken pod."""
    command = [str(HELM), "template", "cw", str(CHART), "--kube-version", "1.28.0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr


def test_native_sidecar_is_rejected_by_kubernetes_1_27_schema() -> None:
    """The validator is strict enough to see the feature: 1.27 has no restartPolicy on init containers."""
    result = validate(render_text(), "1.27.0")
    assert result.returncode != 0
    assert "'restartPolicy' was unexpected" in result.stdout + result.stderr


# --- the sample for an existing Deployment ----------------------------------------------------

ENGINE_DEPLOYMENT: Manifest = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "my-vllm"},
    "spec": {
        "selector": {"matchLabels": {"app": "my-vllm"}},
        "template": {
            "metadata": {"labels": {"app": "my-vllm"}},
            "spec": {
                "containers": [
                    {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "ports": [{"containerPort": 8000}]}
                ],
                "volumes": [{"name": "models", "emptyDir": {}}],
            },
        },
    },
}


def merge_by_name(base: Any, patch: Any) -> Any:
    """Strategic merge for what the sample uses: maps merge, lists of named items merge by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = merge_by_name(base[key], value) if key in base else value
        return merged
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(i, dict) and "name" in i for i in patch)
    ):
        merged_list = list(base)
        for item in patch:
            names = [existing.get("name") for existing in merged_list]
            if item["name"] in names:
                index = names.index(item["name"])
                merged_list[index] = merge_by_name(merged_list[index], item)
            else:
                merged_list.append(item)
        return merged_list
    return patch


def test_existing_deployment_patch_adds_a_valid_native_sidecar() -> None:
    """The sample patch, merged into a plain vLLM Deployment, adds the sidecar and still validates."""
    (patch,) = yaml_documents((EXAMPLES / "existing-deployment-patch.yaml").read_text(encoding="utf-8"))
    patched = merge_by_name(copy.deepcopy(ENGINE_DEPLOYMENT), patch)
    spec = patched["spec"]["template"]["spec"]
    (added,) = spec["initContainers"]
    assert added["restartPolicy"] == "Always"
    assert env_values(added)["CACHEWITNESS_UPSTREAM"] == "http://127.0.0.1:8000"
    assert {v["name"] for v in spec["volumes"]} >= {
        "models",
        "cachewitness-admin-token",
        "cachewitness-evidence",
    }
    for kube_version in KUBE_VERSIONS:
        result = validate(json.dumps(patched), kube_version)
        assert result.returncode == 0, result.stdout + result.stderr


# --- the image --------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    """hadolint finds nothing in the Dockerfile."""
    result = subprocess.run(
        [str(HADOLINT), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_serve_as_a_non_root_user_with_a_healthcheck() -> None:
    """Runtime stage: python:3.11-slim, numeric non-root USER, HEALTHCHECK on /-/healthy, serve entrypoint."""
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    runtime = text.rsplit("\nFROM ", 1)[1]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert re.search(r"^USER 10001:10001$", runtime, re.MULTILINE)
    assert "HEALTHCHECK" in runtime and "/-/healthy" in runtime
    assert runtime.rstrip().endswith('ENTRYPOINT ["cachewitness", "serve"]')


# --- the engine's KV cache events --------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "overrides"), [("vllm", ("engine.kvEvents.discovery=false",)), ("sglang", ())]
)
def test_kv_events_join_the_engine_to_the_sidecar_on_loopback(
    preset: str, overrides: tuple[str, ...]
) -> None:
    """SGLang (and vLLM without discovery) publish to the port the sidecar binds, replay on their own, both pod-local."""
    manifests = render("--set", f"engine.preset={preset}", *(arg for o in overrides for arg in ("--set", o)))
    kv = json.loads(flag_value(engine(manifests)["command"], "--kv-events-config"))
    assert kv["publisher"] == "zmq"
    # A concrete host: the engine connects, the sidecar binds (docs/engines.md).
    assert (kv["endpoint"], kv["replay_endpoint"], kv["topic"]) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "kv",
    )
    assert kv.get("enable_kv_cache_events") is (True if preset == "vllm" else None)
    env = env_values(sidecar(manifests))
    assert env["CACHEWITNESS_KV_EVENTS_ENDPOINT"] == kv["endpoint"]
    assert env["CACHEWITNESS_KV_EVENTS_REPLAY"] == kv["replay_endpoint"]
    assert env["CACHEWITNESS_KV_EVENTS_PUBLISHERS"] == "127.0.0.1"  # the engine's address only


def test_vllm_names_its_kv_event_sockets_and_the_sidecar_finds_them() -> None:
    """vLLM binds ipc sockets in a pod-local emptyDir both containers mount; the sidecar is told nothing."""
    manifests = render("--set", "engine.preset=vllm")
    kv = json.loads(flag_value(engine(manifests)["command"], "--kv-events-config"))
    assert (kv["endpoint"], kv["replay_endpoint"]) == (
        "ipc:///var/run/kv-events/pub",
        "ipc:///var/run/kv-events/replay",
    )
    assert not any(name.startswith("CACHEWITNESS_KV_EVENTS") for name in env_values(sidecar(manifests)))
    for container in (engine(manifests), sidecar(manifests)):
        assert {"name": "kv-events", "mountPath": "/var/run/kv-events"} in container["volumeMounts"]
    [volume] = [v for v in pod_spec(manifests)["volumes"] if v["name"] == "kv-events"]
    assert volume["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize(
    "overrides", [("engine.preset=llamacpp",), ("engine.preset=vllm", "engine.kvEvents.enabled=false")]
)
def test_kv_events_stay_off_where_there_are_none(overrides: tuple[str, ...]) -> None:
    """llama.cpp publishes no events; switched off, neither container hears of them."""
    manifests = render(*(arg for o in overrides for arg in ("--set", o)))
    assert "--kv-events-config" not in engine(manifests)["command"]
    assert not any(name.startswith("CACHEWITNESS_KV_EVENTS") for name in env_values(sidecar(manifests)))
