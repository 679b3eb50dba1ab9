"""The Helm chart rendered with the pinned helm from .cache/tools, read through the tools venv's PyYAML."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


CHART = ROOT / "helm" / "cachewitness"


EXAMPLES = ROOT / "helm" / "examples"


TOOLS = ROOT / ".cache" / "tools"


HELM = TOOLS / "bin" / "helm"


TOOLS_PYTHON = TOOLS / "venv" / "bin" / "python"


KUBERNETES_VALIDATE = TOOLS / "venv" / "bin" / "kubernetes-validate"


HADOLINT = TOOLS / "venv" / "bin" / "hadolint"


KUBE_VERSIONS = ("1.29.0", "1.33.0")


PRESETS = ("vllm", "sglang", "llamacpp", "trtllm")


Manifest = dict[str, Any]


YAML_TO_JSON = "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))"


@pytest.fixture(autouse=True, scope="module")
def deploy_tools() -> None:
    """Fail (not skip) when the pinned tools are missing: CI installs them first."""
    missing = [
        str(p.relative_to(ROOT))
        for p in (HELM, TOOLS_PYTHON, KUBERNETES_VALIDATE, HADOLINT)
        if not p.exists()
    ]
    if missing:
        pytest.fail(
            f"deploy tools missing ({', '.join(missing)}): run scripts/install-deploy-tools.sh", pytrace=False
        )


# The chart requires the sidecar's image to name a registry; later arguments may override it.
IMAGE = ("--set", "sidecar.image.repository=registry.example.com/cachewitness")


def helm_template(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `helm template` on the chart with the image and extra arguments; never raises on failure."""
    command = [
        str(HELM),
        "template",
        "cw",
        str(CHART),
        "--namespace",
        "ns",
        "--kube-version",
        "1.33.0",
        *IMAGE,
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def yaml_documents(text: str) -> list[Manifest]:
    """Parse a YAML stream with the tools venv's PyYAML."""
    parsed = subprocess.run(
        [str(TOOLS_PYTHON), "-c", YAML_TO_JSON],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    documents: list[Manifest] = json.loads(parsed.stdout)
    return documents


@functools.cache
def _render_cached(args: tuple[str, ...]) -> tuple[str, str]:
    """Rendered YAML for these arguments (cached: each render spawns helm)."""
    result = helm_template(*args)
    assert result.returncode == 0, f"helm template {' '.join(args)} failed:\n{result.stderr}"
    return result.stdout, json.dumps(yaml_documents(result.stdout))


def render(*args: str) -> list[Manifest]:
    """The chart's manifests for these `helm template` arguments (a fresh copy)."""
    manifests: list[Manifest] = json.loads(_render_cached(args)[1])
    return manifests


def render_text(*args: str) -> str:
    """The chart's YAML text for these `helm template` arguments."""
    return _render_cached(args)[0]


def only(manifests: list[Manifest], kind: str) -> Manifest:
    """The single manifest of `kind` (excluding helm test hooks)."""
    found = [
        m
        for m in manifests
        if m["kind"] == kind and "helm.sh/hook" not in m["metadata"].get("annotations", {})
    ]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def client_service(manifests: list[Manifest]) -> Manifest:
    """The Service clients use (not the headless peers Service)."""
    (service,) = [m for m in manifests if m["kind"] == "Service" and m["spec"].get("clusterIP") != "None"]
    return service


def peers_service(manifests: list[Manifest]) -> Manifest:
    """The headless Service that lists the pods for cluster resets."""
    (service,) = [m for m in manifests if m["kind"] == "Service" and m["spec"].get("clusterIP") == "None"]
    return service


def kinds(manifests: list[Manifest]) -> list[str]:
    """Kinds of the rendered manifests."""
    return [m["kind"] for m in manifests]


def pod_spec(manifests: list[Manifest]) -> Manifest:
    """The Deployment's pod spec."""
    spec: Manifest = only(manifests, "Deployment")["spec"]["template"]["spec"]
    return spec


def sidecar(manifests: list[Manifest]) -> Manifest:
    """The cachewitness init container."""
    containers: list[Manifest] = pod_spec(manifests).get("initContainers", [])
    (container,) = [c for c in containers if c["name"] == "cachewitness"]
    return container


def engine(manifests: list[Manifest]) -> Manifest:
    """The engine container."""
    containers: list[Manifest] = pod_spec(manifests)["containers"]
    (container,) = [c for c in containers if c["name"] == "engine"]
    return container


def env_of(container: Manifest) -> dict[str, Manifest]:
    """The container's env entries by name."""
    return {e["name"]: e for e in container.get("env", [])}


def env_values(container: Manifest) -> dict[str, str]:
    """The container's literal env values by name."""
    return {name: e["value"] for name, e in env_of(container).items() if "value" in e}


def flag_value(argv: list[str], flag: str) -> str:
    """The argument following `flag` in a command line."""
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def validate(manifest_text: str, kube_version: str) -> subprocess.CompletedProcess[str]:
    """kubernetes-validate --strict for one Kubernetes version."""
    return subprocess.run(
        [str(KUBERNETES_VALIDATE), "--strict", "-k", kube_version, "--quiet", "-"],
        input=manifest_text,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
