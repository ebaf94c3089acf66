#!/usr/bin/env bash
# Builds the etcd server from the published module go.etcd.io/etcd/server/v3 (package main).
# Its go.mod replaces the sibling modules with ../api etc.; replace directives of a dependency are
# ignored, so a wrapper module that requires it gets the published, tagged siblings instead.
#
# Output: $ELASTRAIN_CACHE/etcd-v$ETCD_VERSION/bin/etcd      Idempotent.
set -euo pipefail
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HACK/lib.sh"

ROOT="$ELASTRAIN_CACHE/etcd-v$ETCD_VERSION"
BIN="$ROOT/bin"
TIMINGS_FILE="$ROOT/build-times.txt"
mkdir -p "$BIN"

is_built() {
  [[ -x "$BIN/etcd" ]] || return 1
  local out
  out=$("$BIN/etcd" --version 2>/dev/null) || return 1
  grep -qx "etcd Version: $ETCD_VERSION" <<<"$out"
}

build_etcd() {
  local dir="$ROOT/src/etcd"
  new_wrapper_module "$dir" etcd
  cd "$dir"
  "$GO" get -tool "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  "$GO" mod tidy
  "$GO" build -p "$BUILD_PARALLELISM" -ldflags "-s -w" -o "$BIN/.etcd.tmp" go.etcd.io/etcd/server/v3
  install_atomically "$BIN/.etcd.tmp" "$BIN/etcd"
}

lock_builds "$ROOT"
if is_built; then
  log "etcd v$ETCD_VERSION already built: $BIN/etcd"
else
  timed etcd build_etcd
  is_built || { log "$BIN/etcd does not report $ETCD_VERSION"; exit 1; }
fi
echo "$BIN/etcd"
