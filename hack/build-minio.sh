#!/usr/bin/env bash
# Builds the MinIO server from github.com/minio/minio. MinIO's release tags (RELEASE.2025-...) are
# not semver, so the module is pinned by pseudo-version. The proxy here serves this commit
# (2026-02-12, the newest it knows); the module has no replace directives.
# No `mc`: tests create buckets through the S3 API (boto3).
#
# Output: $ELASTRAIN_CACHE/minio-<commit date>/bin/minio      Idempotent.
set -euo pipefail
HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HACK/lib.sh"

commit_time=$(cut -d- -f2 <<<"$MINIO_MODULE_VERSION")             # 20260212201848
commit=$(cut -d- -f3 <<<"$MINIO_MODULE_VERSION")                  # 7aac2a2c5b7c
release_time="${commit_time:0:4}-${commit_time:4:2}-${commit_time:6:2}T${commit_time:8:2}:${commit_time:10:2}:${commit_time:12:2}Z"
release_tag="DEVELOPMENT.${release_time//:/-}"
ROOT="$ELASTRAIN_CACHE/minio-$commit_time-$commit"
BIN="$ROOT/bin"
TIMINGS_FILE="$ROOT/build-times.txt"
mkdir -p "$BIN"

is_built() {
  [[ -x "$BIN/minio" ]] || return 1
  local out
  out=$("$BIN/minio" --version 2>/dev/null) || return 1
  grep -q "$release_tag" <<<"$out"
}

build_minio() {
  local dir="$ROOT/src/minio" pkg=github.com/minio/minio/cmd
  new_wrapper_module "$dir" minio
  cd "$dir"
  "$GO" get -tool "github.com/minio/minio@$MINIO_MODULE_VERSION"
  "$GO" mod tidy
  "$GO" build -p "$BUILD_PARALLELISM" -tags kqueue \
    -ldflags "-s -w -X $pkg.Version=$release_time -X $pkg.ReleaseTag=$release_tag -X $pkg.CommitID=$commit -X $pkg.ShortCommitID=$commit -X $pkg.CopyrightYear=${commit_time:0:4}" \
    -o "$BIN/.minio.tmp" github.com/minio/minio
  install_atomically "$BIN/.minio.tmp" "$BIN/minio"
}

lock_builds "$ROOT"
if is_built; then
  log "minio $release_tag already built: $BIN/minio"
else
  timed minio build_minio
  is_built || { log "$BIN/minio does not report $release_tag"; exit 1; }
fi
echo "$BIN/minio"
