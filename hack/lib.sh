# Shared settings for the hack/build-*.sh scripts; source it, do not run it.
# Everything is cached outside the repository under $ELASTRAIN_CACHE (default ~/.cache/elastrain):
#   go/mod, go/build        Go module and build caches (warm for every later build on this machine)
#   <component>-<version>/  one directory per pinned component; bin/ holds the finished programs
# shellcheck shell=bash

ELASTRAIN_CACHE=${ELASTRAIN_CACHE:-"$HOME/.cache/elastrain"}
GO=${GO:-/usr/local/go/bin/go}
[[ -x $GO ]] || GO=$(command -v go)

export GOTOOLCHAIN=local
export GOMODCACHE="$ELASTRAIN_CACHE/go/mod"
export GOCACHE="$ELASTRAIN_CACHE/go/build"
export GOPATH="$ELASTRAIN_CACHE/go/path"
export GOFLAGS="-buildvcs=false -trimpath"
export CGO_ENABLED=0
# Two cores and 24 GiB: at most two compile jobs, so the linker of kube-apiserver (2-3 GiB) never
# competes with more than one compiler.
BUILD_PARALLELISM=${BUILD_PARALLELISM:-2}

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The is_built checks read a program's whole version output before grep sees it: under pipefail,
# `prog --version | grep -q X` fails at random when grep exits at the first match and prog dies of
# SIGPIPE writing its next line (CI: etcd exit 141 on a loaded machine, so a good binary was rebuilt
# and then refused).

# timed NAME CMD...: runs CMD and appends "NAME <seconds>" to $TIMINGS_FILE (if set).
timed() {
  local name=$1 start end
  shift
  start=$(date +%s)
  "$@"
  end=$(date +%s)
  log "$name took $((end - start)) s"
  if [[ -n ${TIMINGS_FILE:-} ]]; then
    printf '%s %s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$name" "$((end - start))" >>"$TIMINGS_FILE"
  fi
}

# go_mod_file MODULE@VERSION: prints the path of the cached go.mod of that module version.
go_mod_file() {
  "$GO" mod download -json "$1" | python3 -c '
import json, sys
info = json.load(sys.stdin)
if "Error" in info:
    sys.exit(info["Error"])
print(info["GoMod"])'
}

# new_wrapper_module DIR NAME: an empty Go module in DIR (recreated from scratch every time).
new_wrapper_module() {
  local dir=$1 name=$2
  rm -rf "$dir"
  mkdir -p "$dir"
  (cd "$dir" && "$GO" mod init "example.invalid/elastrain-build/$name" >/dev/null 2>&1)
}

# install_atomically SRC DEST: move a finished binary into place so a crash never leaves half a file.
install_atomically() {
  chmod 0755 "$1"
  mv -f "$1" "$2"
}

# Pinned versions: versions.env, each overridable by an environment variable of the same name.
_hack_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
while IFS='=' read -r _key _value; do
  [[ $_key =~ ^[A-Z0-9_]+$ ]] || continue
  [[ -n ${!_key:-} ]] || printf -v "$_key" '%s' "$_value"
done <"$_hack_dir/versions.env"
unset _key _value _hack_dir

# lock_builds DIR: holds an exclusive lock on DIR/.build.lock until the script exits, so two
# concurrent builds of one component (a test session and build-all.sh, say) never share a wrapper
# module; the second waits, then finds the binary built.
lock_builds() {
  mkdir -p "$1"
  exec 9>"$1/.build.lock"
  if ! flock -n 9; then
    log "waiting for another build in $1"
    flock 9
  fi
}
