#!/usr/bin/env bash
# Builds kube-router for the real-node tier, where only its NetworkPolicy firewall controller runs
# (hack/node/servers.py: --run-firewall=true --run-router=false --run-service-proxy=false). Built
# inside the published module github.com/cloudnativelabs/kube-router/v2 with its own go.mod and
# go.sum (the versions its release was tested with), from the Go module proxy.
#
# Output: $ELASTRAIN_CACHE/kube-router-v$KUBE_ROUTER_VERSION/bin/kube-router      Idempotent.
set -euo pipefail
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HACK/lib.sh"

ROOT="$ELASTRAIN_CACHE/kube-router-v$KUBE_ROUTER_VERSION"
BIN="$ROOT/bin"
TIMINGS_FILE="$ROOT/build-times.txt"
MODULE=github.com/cloudnativelabs/kube-router/v2
mkdir -p "$BIN"

# kube-router prints its version on stderr.
is_built() {
  [[ -x "$BIN/kube-router" ]] || return 1
  local out
  out=$("$BIN/kube-router" --version 2>&1) || return 1
  grep -q "version v$KUBE_ROUTER_VERSION," <<<"$out"
}

build_kube_router() {
  local dir
  dir=$(cd /tmp && "$GO" mod download -json "$MODULE@v$KUBE_ROUTER_VERSION" | python3 -c '
import json, sys
info = json.load(sys.stdin)
if "Error" in info:
    sys.exit(info["Error"])
print(info["Dir"])')
  cd "$dir"
  "$GO" build -mod=readonly -p "$BUILD_PARALLELISM" -o "$BIN/.kube-router.tmp" -ldflags \
    "-s -w -X $MODULE/pkg/version.Version=v$KUBE_ROUTER_VERSION -X $MODULE/pkg/version.BuildDate=proxy" \
    ./cmd/kube-router
  install_atomically "$BIN/.kube-router.tmp" "$BIN/kube-router"
}

lock_builds "$ROOT"
if is_built; then
  log "kube-router v$KUBE_ROUTER_VERSION already built: $BIN/kube-router"
else
  timed kube-router build_kube_router
  is_built || { log "$BIN/kube-router does not report v$KUBE_ROUTER_VERSION"; exit 1; }
fi
echo "$BIN/kube-router"
