#!/usr/bin/env bash
# Builds the Kueue manager (sigs.k8s.io/kueue/cmd/kueue) and copies the manifests the test harness
# (hack/kueue.py) installs by hand: the CRDs and the webhook configurations. Kueue's go.mod has no
# replace directives, so a plain `go install MODULE/cmd/kueue@VERSION` builds it, no wrapper module.
#
# Output: $ELASTRAIN_CACHE/kueue-v$KUEUE_VERSION/bin/kueue
#         $ELASTRAIN_CACHE/kueue-v$KUEUE_VERSION/crds/*.yaml        (config/components/crd/bases)
#         $ELASTRAIN_CACHE/kueue-v$KUEUE_VERSION/webhook/manifests.yaml
# Idempotent: a binary whose build info names the pinned module version is kept.
set -euo pipefail
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HACK/lib.sh"

ROOT="$ELASTRAIN_CACHE/kueue-v$KUEUE_VERSION"
BIN="$ROOT/bin"
TIMINGS_FILE="$ROOT/build-times.txt"
MODULE=sigs.k8s.io/kueue
mkdir -p "$BIN"

# The manager has no --version flag; `go version -m` reads the module version go install recorded.
is_built() {
  [[ -x "$BIN/kueue" && -s "$ROOT/webhook/manifests.yaml" ]] || return 1
  compgen -G "$ROOT/crds/*.yaml" >/dev/null || return 1
  local out
  out=$("$GO" version -m "$BIN/kueue" 2>/dev/null) || return 1
  grep -qE "^[[:space:]]+mod[[:space:]]+$MODULE[[:space:]]+v$KUEUE_VERSION[[:space:]]" <<<"$out"
}

build_kueue() {
  local stamp="-X $MODULE/pkg/version.GitVersion=v$KUEUE_VERSION"
  stamp+=" -X $MODULE/pkg/version.BuildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  # go install writes straight to GOBIN: a temporary one, so a crash never leaves half a binary.
  rm -rf "$BIN/.tmp"
  GOBIN="$BIN/.tmp" "$GO" install -p "$BUILD_PARALLELISM" -ldflags "-s -w $stamp" \
    "$MODULE/cmd/kueue@v$KUEUE_VERSION"
  install_atomically "$BIN/.tmp/kueue" "$BIN/kueue"
  rmdir "$BIN/.tmp"
}

# Copies out of the read-only module cache (files there are 0444), so a rebuild can overwrite them.
copy_manifests() {
  local src
  src=$("$GO" mod download -json "$MODULE@v$KUEUE_VERSION" | python3 -c '
import json, sys
info = json.load(sys.stdin)
if "Error" in info:
    sys.exit(info["Error"])
print(info["Dir"])')
  rm -rf "$ROOT/crds" "$ROOT/webhook"
  mkdir -p "$ROOT/crds" "$ROOT/webhook"
  cp "$src"/config/components/crd/bases/*.yaml "$ROOT/crds/"
  cp "$src/config/components/webhook/manifests.yaml" "$ROOT/webhook/"
  chmod -R u+w "$ROOT/crds" "$ROOT/webhook"
}

lock_builds "$ROOT"
if is_built; then
  log "kueue v$KUEUE_VERSION already built: $BIN/kueue"
else
  timed kueue build_kueue
  copy_manifests
  is_built || { log "$BIN/kueue is not sigs.k8s.io/kueue v$KUEUE_VERSION"; exit 1; }
fi
echo "$BIN/kueue"
