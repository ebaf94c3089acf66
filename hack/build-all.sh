#!/usr/bin/env bash
# Builds (or finds in the cache) every test server: helm, etcd, MinIO, the Kubernetes components,
# then Kueue (the integration tier's queueing tests), one after another: each Go build already uses
# both cores (go build -p 2), so running two at once would only add memory pressure. Prints how
# long each step took.
# Usage: hack/build-all.sh [helm|etcd|minio|k8s|kueue|node|coredns|kube-router ...]
#   default: helm etcd minio k8s kueue (the control plane and Kueue); node (kubelet, kube-proxy),
#   coredns and kube-router (the NetworkPolicy enforcer) are the real-node tier's (hack/node),
#   built by `make test-e2e` before pytest starts, by `make cluster-up TIER=node`, or on demand
#   by the fixture.
set -euo pipefail
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HACK/lib.sh"

declare -A SCRIPT=([helm]=get-helm.sh [etcd]=build-etcd.sh [minio]=build-minio.sh [k8s]=build-k8s.sh
                   [kueue]=build-kueue.sh [node]=build-k8s.sh [coredns]=build-coredns.sh
                   [kube-router]=build-kube-router.sh)
# build-k8s.sh builds the programs K8S_PROGRAMS names (default: the control plane's).
declare -A PROGRAMS=([node]="kubelet kube-proxy")
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(helm etcd minio k8s kueue)

summary=()
for step in "${steps[@]}"; do
  [[ -n ${SCRIPT[$step]:-} ]] || { log "unknown component '$step' (${!SCRIPT[*]})"; exit 2; }
  start=$(date +%s)
  K8S_PROGRAMS=${PROGRAMS[$step]:-${K8S_PROGRAMS:-}} bash "$HACK/${SCRIPT[$step]}" >/dev/null
  summary+=("$(printf '%-6s %5d s' "$step" "$(($(date +%s) - start))")")
done

printf '%s\n' "build times:" "${summary[@]/#/  }"
printf 'binaries under %s:\n' "$ELASTRAIN_CACHE"
find "$ELASTRAIN_CACHE" -maxdepth 3 -type f -perm -u+x -not -path "$ELASTRAIN_CACHE/go/*" -not -name '.*' |
  sort | sed 's/^/  /'
