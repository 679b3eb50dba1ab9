#!/usr/bin/env bash
# Build scripts/go-check-evidence (Go's own golang.org/x/mod/sumdb/note and sumdb/tlog checking a
# cachewitness Merkle proof answer) into .cache/tools/bin/go-check-evidence, idempotently.
# The Go toolchain and x/mod come from Debian bookworm's packages (apt-get download + dpkg-deb
# -x into a temporary folder: no root needed, nothing installed system-wide, removed after the
# build), each .deb verified against its sha256. Where apt cannot fetch them, nothing is built
# and tests/test_evidence_go.py skips, saying so.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CACHEWITNESS_TOOLS_DIR:-$ROOT/.cache/tools}"
SOURCE="$ROOT/scripts/go-check-evidence/main.go"
DEST="$TOOLS/bin/go-check-evidence"
DEBS=(
    "golang-1.19-go=1.19.8-2 545123039b6c79e75cf2d86528781a825424cf33ce9d3f4513d772d7144cd531"
    "golang-1.19-src=1.19.8-2 2dfa82fe4f08f4e0193c532e561af4c91871f5235608f04f2bb8d57bb288df5a"
    "golang-golang-x-mod-dev=0.7.0-1 e718b3e1d089f9ae3658cf2de80d0572bbf1ce8cd1970373d300ae72e821ab33"
)

log() { printf '[install-go-checker] %s\n' "$*"; }
die() { printf '[install-go-checker] ERROR: %s\n' "$*" >&2; exit 1; }

# Rebuilt when the source changes: its hash is kept beside the binary.
want="$(sha256sum "$SOURCE" | cut -d' ' -f1)"
if [ -x "$DEST" ] && [ "$(cat "$DEST.source-sha256" 2>/dev/null)" = "$want" ]; then
    log "already built: $DEST"
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    log "WARNING: no apt-get/dpkg-deb: go-check-evidence not built (tests/test_evidence_go.py skips)"
    exit 0
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
for entry in "${DEBS[@]}"; do
    package="${entry%% *}" sum="${entry##* }"
    if ! (cd "$WORK" && apt-get download -q "$package" >>"$WORK/apt.log" 2>&1); then
        sed 's/^/    /' "$WORK/apt.log" >&2
        log "WARNING: apt-get could not fetch $package (run apt-get update?): go-check-evidence not built"
        exit 0
    fi
    deb="$(ls "$WORK"/"${package%%=*}"_*.deb)"
    [ "$(sha256sum "$deb" | cut -d' ' -f1)" = "$sum" ] || die "sha256 mismatch for $deb (want $sum)"
    dpkg-deb -x "$deb" "$WORK/root"
done
mkdir -p "$TOOLS/bin"
GOROOT="$WORK/root/usr/lib/go-1.19" GOPATH="$WORK/root/usr/share/gocode" GO111MODULE=off \
    GOCACHE="$WORK/cache" GOFLAGS= "$WORK/root/usr/lib/go-1.19/bin/go" build -o "$DEST" "$SOURCE"
echo "$want" >"$DEST.source-sha256"
log "built $DEST (Go 1.19.8, golang.org/x/mod 0.7.0)"
