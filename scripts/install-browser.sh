#!/usr/bin/env bash
# Install a headless browser for the report test (tests/test_report_browser.py), idempotently:
#   .cache/tools/chromium/     Debian's `chromium` and `chromium-common` packages and the shared
#                              libraries they need that this machine lacks, unpacked with
#                              apt-get download + dpkg-deb -x (no root, nothing installed system-wide)
#   .cache/tools/bin/chromium  a wrapper that runs it with those libraries
# Debian's security archive serves only the current chromium build, so the version is not pinned:
# the installed one is printed and kept until this script is run with CHROMIUM_REINSTALL=1.
# Where apt cannot fetch the packages (not Debian, no package lists, no network), nothing is
# installed, a warning says so and the browser test skips, saying why.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CACHEWITNESS_TOOLS_DIR:-$ROOT/.cache/tools}"
DEST="$TOOLS/chromium"
WRAPPER="$TOOLS/bin/chromium"
MAX_ROUNDS=6  # dependency levels followed below chromium's own Depends (3 are needed on bookworm)

log() { printf '[install-browser] %s\n' "$*"; }

if [ -x "$WRAPPER" ] && [ -z "${CHROMIUM_REINSTALL:-}" ] && "$WRAPPER" --version >/dev/null 2>&1; then
    log "already installed: $("$WRAPPER" --version 2>/dev/null) ($WRAPPER)"
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null || ! command -v dpkg-query >/dev/null; then
    log "WARNING: no apt-get/dpkg-deb: chromium not installed (the browser test skips)"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/debs" "$WORK/root" "$TOOLS/bin"

installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }
# A package's Depends, first alternative of each, without versions or :any.
depends_of() { dpkg-deb -f "$1" Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/:any//; s/ //g' | grep -v '^$' || true; }

fetch() {
    # apt-get download as root warns that it runs unsandboxed; the log keeps it for a failure.
    (cd "$WORK/debs" && apt-get download -q "$@" >>"$WORK/apt.log" 2>&1)
}

log "fetching Debian's chromium and chromium-common with apt-get download"
if ! fetch chromium chromium-common; then
    sed 's/^/    /' "$WORK/apt.log" >&2
    log "WARNING: apt-get could not fetch chromium (run apt-get update?): not installed (the browser test skips)"
    exit 0
fi
seen=" chromium chromium-common "
queue=""
for deb in "$WORK"/debs/*.deb; do
    dpkg-deb -x "$deb" "$WORK/root"
    queue="$queue $(depends_of "$deb")"
done
# Headless needs no GTK (it is loaded only for a window): its alternative is skipped.
for round in $(seq "$MAX_ROUNDS"); do
    want=""
    for pkg in $queue; do
        case "$seen" in *" $pkg "*) continue ;; esac
        seen="$seen$pkg "
        [ "$pkg" = libgtk-3-0 ] && continue
        installed "$pkg" || want="$want $pkg"
    done
    [ -z "$want" ] && break
    log "round $round: libraries this machine lacks:$want"
    # shellcheck disable=SC2086  # one word per package
    fetch $want || { sed 's/^/    /' "$WORK/apt.log" >&2; log "WARNING: apt-get could not fetch:$want"; exit 0; }
    queue=""
    for pkg in $want; do
        deb="$(ls "$WORK"/debs/"${pkg}"_*.deb 2>/dev/null | head -1 || true)"
        [ -n "$deb" ] || continue
        dpkg-deb -x "$deb" "$WORK/root"
        queue="$queue $(depends_of "$deb")"
    done
done

rm -rf "$DEST"
mv "$WORK/root" "$DEST"
# Every directory holding a shared library of the unpacked packages.
libdirs="$(cd "$DEST" && find . -name '*.so*' -printf '%h\n' | sort -u | sed "s|^\.|$DEST|" | paste -sd:)"
cat >"$WRAPPER" <<EOF
#!/bin/sh
# Written by scripts/install-browser.sh: Debian's chromium with the libraries unpacked beside it.
LD_LIBRARY_PATH="$libdirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$DEST/usr/lib/chromium/chromium" "\$@"
EOF
chmod 0755 "$WRAPPER"
missing="$(LD_LIBRARY_PATH="$libdirs" ldd "$DEST/usr/lib/chromium/chromium" | grep 'not found' || true)"
if [ -n "$missing" ]; then
    printf '%s\n' "$missing" >&2
    log "WARNING: chromium still lacks the libraries above: removed (the browser test skips)"
    rm -f "$WRAPPER"
    exit 0
fi
log "installed $("$WRAPPER" --version 2>/dev/null): $WRAPPER"
