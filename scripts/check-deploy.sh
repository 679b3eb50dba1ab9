#!/usr/bin/env bash
# Lint and validate the deployment artefacts offline, with the pinned tools that
# scripts/install-deploy-tools.sh puts in .cache/tools/:
#   - helm lint --strict, for each engine preset and each examples/values-*.yaml;
#   - helm template for each preset x monitoring off/on, plus the existing-secret, PVC,
#     replicas-3 with the PrometheusRule (PodDisruptionBudget, spread, NetworkPolicy), signing-key,
#     no-peers and examples/values-*.yaml variants, each validated with
#     kubernetes-validate --strict against Kubernetes 1.29.0 and 1.33.0
#     (CRDs such as ServiceMonitor and PrometheusRule have no bundled schema: tests/test_helm.py checks them);
#   - hadolint on the Dockerfile.
# Runs every check, prints one line per check, exits non-zero if any failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CACHEWITNESS_TOOLS_DIR:-$ROOT/.cache/tools}"
HELM="$TOOLS/bin/helm"
KV="$TOOLS/venv/bin/kubernetes-validate"
HADOLINT="$TOOLS/venv/bin/hadolint"
CHART="$ROOT/helm/cachewitness"
EXAMPLES="$ROOT/helm/examples"
KUBE_VERSIONS=(1.29.0 1.33.0)
# The chart requires the sidecar's image to name a registry.
IMAGE=(--set sidecar.image.repository=registry.example.com/cachewitness)

for tool in "$HELM" "$KV" "$HADOLINT"; do
    if [ ! -x "$tool" ]; then
        echo "missing $tool: run scripts/install-deploy-tools.sh first" >&2
        exit 2
    fi
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
failures=0
checks=0

# run_check NAME CMD...: run CMD, print PASS/FAIL, show its output only on failure.
run_check() {
    local name="$1"
    shift
    checks=$((checks + 1))
    if "$@" >"$WORK/out" 2>&1; then
        printf 'PASS  %s\n' "$name"
    else
        failures=$((failures + 1))
        printf 'FAIL  %s\n' "$name"
        sed 's/^/      /' "$WORK/out"
        return 1
    fi
}

# render KUBE-VERSION OUT HELM-ARGS...: helm template the chart into OUT.
render() {
    local kube_version="$1" out="$2"
    shift 2
    "$HELM" template cw "$CHART" --namespace cw --kube-version "$kube_version" "${IMAGE[@]}" "$@" >"$out"
}

# validate_render NAME HELM-ARGS...: for each Kubernetes version, render the chart
# (templates/tests included: they are Pods too) and validate what it rendered.
validate_render() {
    local name="$1"
    shift
    local kv manifest
    for kv in "${KUBE_VERSIONS[@]}"; do
        manifest="$WORK/$name-$kv.yaml"
        run_check "helm template --kube-version $kv [$name]" render "$kv" "$manifest" "$@" \
            && run_check "kubernetes-validate --strict -k $kv [$name]" "$KV" --strict -k "$kv" --quiet "$manifest"
    done
}

cd "$ROOT" || exit 2
echo "== tools: $("$HELM" version --short), $("$HADOLINT" --version), kubernetes-validate $("$KV" --version 2>&1 | tail -1)"

echo "== helm lint"
for preset in vllm sglang llamacpp trtllm; do
    run_check "helm lint --strict [preset=$preset]" "$HELM" lint --strict "$CHART" "${IMAGE[@]}" --set "engine.preset=$preset"
done
for example in "$EXAMPLES"/values-*.yaml; do
    run_check "helm lint --strict [$(basename "$example")]" "$HELM" lint --strict "$CHART" "${IMAGE[@]}" -f "$example"
done
run_check "helm lint --strict [replicas=3, network policy]" "$HELM" lint --strict "$CHART" "${IMAGE[@]}" \
    --set replicaCount=3 --set networkPolicy.enabled=true

echo "== render and validate"
MONITORING=(--set serviceMonitor.enabled=true --set podMonitor.enabled=true --set dashboard.enabled=true)
for preset in vllm sglang llamacpp trtllm; do
    validate_render "$preset" --set "engine.preset=$preset"
    validate_render "$preset-monitoring" --set "engine.preset=$preset" "${MONITORING[@]}"
done
validate_render "existing-secret" --set adminToken.existingSecret=my-admin-token --set adminToken.key=bearer
validate_render "evidence-pvc" --set evidence.persistence.enabled=true --set evidence.persistence.storageClassName=standard
validate_render "evidence-existing-claim" --set evidence.persistence.enabled=true --set evidence.persistence.existingClaim=evidence
validate_render "replicas-3-alerts" --set replicaCount=3 --set prometheusRule.enabled=true "${MONITORING[@]}"
validate_render "replicas-3-operator" --set replicaCount=3 --set networkPolicy.enabled=true \
    --set networkPolicy.clientNamespaces='{gateway,monitoring}' --set pdb.minAvailable=2
validate_render "network-policy" --set networkPolicy.enabled=true
validate_render "signing-key" --set evidence.signingKey.existingSecret=evidence-key
validate_render "no-peers" --set peers.enabled=false
validate_render "example-sglang" -f "$EXAMPLES/values-sglang.yaml" "${MONITORING[@]}"
validate_render "example-llamacpp" -f "$EXAMPLES/values-llamacpp.yaml" "${MONITORING[@]}"

echo "== Dockerfile"
run_check "hadolint Dockerfile" "$HADOLINT" Dockerfile

echo "== $((checks - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
