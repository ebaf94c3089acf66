#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kube-scheduler from the published Go modules.
#
# k8s.io/kubernetes cannot be `go install`ed: its go.mod requires every staging module
# (k8s.io/api, k8s.io/apiserver, ...) at v0.0.0 and replaces it with ./staging/... . So for each
# program we make a wrapper module that requires k8s.io/kubernetes vK8S_VERSION and replaces each
# of those staging modules with its published v0.<minor>.<patch>. One wrapper per program, so one
# program's dependency choices never leak into another's.
#
# Output: $ELASTRAIN_CACHE/k8s-v$K8S_VERSION/bin/{kube-apiserver,kube-controller-manager,kube-scheduler}
# Idempotent: a program whose binary already reports the pinned version is skipped.
set -euo pipefail
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HACK/lib.sh"

read -r -a PROGRAMS <<<"${K8S_PROGRAMS:-kube-apiserver kube-controller-manager kube-scheduler}"

major=${K8S_VERSION%%.*}
rest=${K8S_VERSION#*.}
minor=${rest%%.*}
STAGING_VERSION="v0.${rest}"          # 1.34.12 -> v0.34.12
ROOT="$ELASTRAIN_CACHE/k8s-v$K8S_VERSION"
BIN="$ROOT/bin"
TIMINGS_FILE="$ROOT/build-times.txt"
mkdir -p "$BIN"

is_built() {
  [[ -x "$BIN/$1" ]] || return 1
  local out
  out=$("$BIN/$1" --version 2>/dev/null) || return 1
  grep -qx "Kubernetes v$K8S_VERSION" <<<"$out"
}

ldflags() {
  local flags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  printf '%s' "$flags"
}

prepare_module() {
  local prog=$1 dir="$ROOT/src/$1" kgomod mod
  new_wrapper_module "$dir" "$prog"
  kgomod=$(go_mod_file "k8s.io/kubernetes@v$K8S_VERSION")
  cd "$dir"
  while read -r mod; do
    "$GO" mod edit -replace="$mod=$mod@$STAGING_VERSION"
  done < <(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$kgomod")
  "$GO" get -tool "k8s.io/kubernetes/cmd/$prog@v$K8S_VERSION"
  "$GO" mod tidy
}

build_program() {
  local prog=$1
  log "building $prog v$K8S_VERSION (wrapper module $ROOT/src/$prog)"
  (prepare_module "$prog")
  (cd "$ROOT/src/$prog" &&
    "$GO" build -p "$BUILD_PARALLELISM" -tags notest -ldflags "$(ldflags)" \
      -o "$BIN/.$prog.tmp" "k8s.io/kubernetes/cmd/$prog")
  install_atomically "$BIN/.$prog.tmp" "$BIN/$prog"
  is_built "$prog" || { log "$prog does not report v$K8S_VERSION"; exit 1; }
}

lock_builds "$ROOT"
for prog in "${PROGRAMS[@]}"; do
  if is_built "$prog"; then
    log "$prog v$K8S_VERSION already built: $BIN/$prog"
  else
    timed "$prog" build_program "$prog"
  fi
done
echo "$BIN"
