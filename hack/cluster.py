#!/usr/bin/env python3
"""Real test servers on loopback: etcd + kube-apiserver (tier a), plus kube-controller-manager and
kube-scheduler (tier a+), and MinIO with a bucket. Standard library only (certificates come from the
openssl CLI), so it runs with any python3 >= 3.11, inside or outside the project's venv.

    python3 hack/cluster.py up   [--tier a|a+|none|node] [--nodes 2] [--no-s3] [--dir DIR]
    python3 hack/cluster.py env  [--dir DIR]    # shell exports: KUBECONFIG, ELASTRAIN_*
    python3 hack/cluster.py down [--dir DIR]

Binaries come from the cache the hack/build-*.sh scripts fill (versions in hack/versions.env); `up`
fails naming the script to run when one is missing. Every listener binds 127.0.0.1 on a free port,
so several clusters (parallel CI jobs, a developer's own) coexist. State, certificates, kubeconfig
and logs live in DIR; etcd and MinIO data on /dev/shm. `down` stops the recorded PIDs (checking
each is still the process we started) and removes the data. tests/conftest.py imports this module
and starts the servers with `die_with_parent=True`: then the kernel kills them (PR_SET_PDEATHSIG)
if the test session dies without running its teardown.

This file keeps the CLI, `up`/`down` and the binaries; hack/cluster_certs.py makes the
certificates, hack/cluster_servers.py starts each server, and hack/cluster_state.py holds what they
share (processes, state.json). They import each other as `hack.cluster_*`, so the lines below put
the repository root on sys.path: hack/ is scripts, not a package, and this file runs as a script or
is loaded by path (tests/conftest.py, bench/checkpoint_s3.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

HACK = Path(__file__).resolve().parent
if str(HACK.parent) not in sys.path:
    sys.path.insert(0, str(HACK.parent))

from hack.cluster_certs import make_pki  # noqa: E402
from hack.cluster_servers import (  # noqa: E402
    FAKE_NODE_LABEL as FAKE_NODE_LABEL,
)
from hack.cluster_servers import (  # noqa: E402
    Binaries,
    register_fake_node,
    start_apiserver,
    start_controller_manager,
    start_etcd,
    start_minio,
    start_scheduler,
    wait_for_default_service_account,
)
from hack.cluster_state import BUCKET as BUCKET  # noqa: E402
from hack.cluster_state import REGION as REGION  # noqa: E402
from hack.cluster_state import SHM, ClusterError, State, stop  # noqa: E402
from hack.node import host as node_host  # noqa: E402
from hack.node.config import NODE_IP  # noqa: E402
from hack.node.second import down_second, up_second  # noqa: E402
from hack.node.servers import NodeBinaries, make_node_certificates  # noqa: E402
from hack.node.tier import down_node, load_images, prepare_host, start_node  # noqa: E402

Images = Mapping[str, tuple[str, Path]]  # name -> (image ref, docker-archive)

DEFAULT_DIR = Path(os.environ.get("ELASTRAIN_CLUSTER_DIR", "/tmp/elastrain-cluster"))
FAKE_NODES = ("node-a",)
STOP_ORDER = ("kube-router", "coredns", "kube-proxy", "kubelet", "containerd", "kube-scheduler",
              "kube-controller-manager", "kube-apiserver", "etcd", "minio")
TIERS = ("none", "a", "a+", "node")
# What `up --tier node` loads into the node's containerd when the caller names no images.
NODE_IMAGES = ("pause", "operator", "trainer", "torch")


# ---------------------------------------------------------------------------- versions and binaries


def read_versions() -> dict[str, str]:
    """hack/versions.env, each key overridable by an environment variable of the same name."""
    versions: dict[str, str] = {}
    for line in (HACK / "versions.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isupper() and not key.startswith("#"):
            versions[key] = os.environ.get(key) or value.strip()
    return versions


def cache_root() -> Path:
    return Path(os.environ.get("ELASTRAIN_CACHE", Path.home() / ".cache" / "elastrain"))


def find_binaries(versions: dict[str, str] | None = None) -> Binaries:
    v = versions or read_versions()
    root = cache_root()
    k8s = root / f"k8s-v{v['K8S_VERSION']}" / "bin"
    _, commit_time, commit = v["MINIO_MODULE_VERSION"].split("-")
    return Binaries(
        etcd=root / f"etcd-v{v['ETCD_VERSION']}" / "bin" / "etcd",
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        minio=root / f"minio-{commit_time}-{commit}" / "bin" / "minio",
        kubelet=k8s / "kubelet",
        kube_proxy=k8s / "kube-proxy",
        coredns=root / f"coredns-v{v['COREDNS_VERSION']}" / "bin" / "coredns",
        kube_router=root / f"kube-router-v{v['KUBE_ROUTER_VERSION']}" / "bin" / "kube-router",
    )


def build(components: Sequence[str]) -> None:
    """Runs hack/build-all.sh for the given components (slow when cold: see hack/README.md)."""
    subprocess.run(["bash", str(HACK / "build-all.sh"), *components], check=True)


# ------------------------------------------------------------------------------------ up and down


def up(directory: Path, *, tier: str = "a+", s3: bool = True, die_with_parent: bool = False,
       binaries: Binaries | None = None, images: Images | None = None) -> State:
    """Starts the servers (or returns the running ones recorded in `directory`).
    Tier node also runs a real node (hack/node) with `images` (default: NODE_IMAGES, built by
    hack/images when missing) loaded into its containerd."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    directory = directory.resolve()
    existing = State.load(directory)
    same = existing and existing.tier == tier and bool(existing.s3_endpoint) == s3
    if existing and same and existing.running():
        return existing
    down(directory)
    sweep_stale_data_dirs()
    versions = read_versions()
    binaries = binaries or find_binaries(versions)
    missing = binaries.missing(tier, s3)
    if missing:
        raise ClusterError(f"missing binaries for {missing}: "
                           f"run hack/build-all.sh {' '.join(missing)}")
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(directory / "logs", ignore_errors=True)  # `down` keeps them for a post-mortem
    state = State(dir=str(directory), tier=tier, k8s_version=versions["K8S_VERSION"])
    state.save()
    try:
        if tier == "node":
            with node_host.node_lock():
                _up(state, binaries, s3=s3, die_with_parent=die_with_parent,
                    images=images if images is not None else node_images())
        else:
            _up(state, binaries, s3=s3, die_with_parent=die_with_parent)
    except BaseException:
        down(directory)
        raise
    return state


def _up(state: State, binaries: Binaries, *, s3: bool, die_with_parent: bool,
        images: Images | None = None) -> None:
    # Tier node: everything pods reach binds the bridge's address (real-node.md, pitfall 5).
    address = NODE_IP if state.tier == "node" else "127.0.0.1"
    if state.tier == "node":
        prepare_host(state)
    if state.tier != "none":
        make_pki(Path(state.dir) / "pki", extra_ips=(NODE_IP,) if state.tier == "node" else ())
        if state.tier == "node":
            make_node_certificates(state)
        etcd_url = start_etcd(state, binaries, die_with_parent=die_with_parent)
        start_apiserver(state, binaries, etcd_url, die_with_parent=die_with_parent,
                        address=address)
    if state.tier in ("a+", "node"):
        start_controller_manager(state, binaries, die_with_parent=die_with_parent)
        start_scheduler(state, binaries, die_with_parent=die_with_parent)
        if state.tier == "a+":
            for name in FAKE_NODES:
                register_fake_node(state, name)
        wait_for_default_service_account(state)
    if state.tier == "node":
        start_node(state, _node_binaries(binaries), cache=cache_root(), images=images or {},
                   die_with_parent=die_with_parent)
    if s3:
        start_minio(state, binaries, die_with_parent=die_with_parent, address=address)
    state.save()


def node_images(names: Sequence[str] = NODE_IMAGES) -> dict[str, tuple[str, Path]]:
    """The project's images for the node (hack/images builds them, cached by input hash)."""
    from hack.images import ensure_images

    return {name: (image.ref, image.archive) for name, image in ensure_images(names).items()}


def load_node_images(state: State, images: Images) -> None:
    """Imports images into the running node of `state` (a no-op for those it has)."""
    load_images(state, images, cache=cache_root())


def up_second_node(directory: Path, *, images: Images | None = None,
                   die_with_parent: bool = False) -> State:
    """Adds node 2 (hack/node/second.py) to the running real-node cluster in `directory`, with
    `images` (default: the pause and operator images) in its own containerd."""
    state = State.load(directory.resolve())
    if state is None or state.tier != "node" or not state.running():
        raise ClusterError(f"no running real-node cluster in {directory}")
    binaries = find_binaries()
    with node_host.node_lock():
        up_second(state, _node_binaries(binaries), cache=cache_root(),
                  images=images if images is not None else node_images(("pause", "operator")),
                  die_with_parent=die_with_parent)
    return state


def down_second_node(directory: Path) -> None:
    """Removes node 2 and everything it added to the host; node 1 keeps running."""
    state = State.load(directory.resolve())
    if state is not None:
        with node_host.node_lock():
            down_second(state, cache=cache_root())


def _node_binaries(binaries: Binaries) -> NodeBinaries:
    return NodeBinaries(kubelet=binaries.kubelet, kube_proxy=binaries.kube_proxy,
                        coredns=binaries.coredns, kube_router=binaries.kube_router)


def down(directory: Path) -> None:
    """Stops every recorded server and removes their data; safe to call any number of times.
    A real node is stopped first, in order, and the host cleaned (hack/node/tier.py)."""
    state = State.load(directory.resolve())
    if state is None:
        return
    if state.node:
        with node_host.node_lock():
            down_node(state, stop_control_plane=lambda: _stop_servers(state))
    _stop_servers(state)


def _stop_servers(state: State) -> None:
    order = {name: i for i, name in enumerate(STOP_ORDER)}
    for proc in sorted(state.procs, key=lambda p: order.get(p.name, -1)):
        stop(proc)
    for data in state.data_dirs:
        shutil.rmtree(data, ignore_errors=True)
    state.procs, state.data_dirs = [], []
    state.save()


def sweep_stale_data_dirs() -> None:
    """Removes /dev/shm data left by clusters whose owner was killed before `down` ran (tmpfs
    would hold the memory until reboot): a data dir no live process names on its command line.
    etcd and MinIO both take their data dir as an argument."""
    stale = {str(p) for p in SHM.glob("elastrain-*") if p.is_dir()}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        stale = {d for d in stale if d not in args}
    for path in stale:
        try:
            young = time.time() - Path(path).stat().st_mtime < 120  # a concurrent `up` starting
        except OSError:
            continue
        if not young:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------- CLI


def print_env(state: State) -> None:
    for key, value in state.env().items():
        print(f"export {key}={value}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "env"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                         help=f"state, certificates, logs (default {DEFAULT_DIR})")
        if name == "up":
            cmd.add_argument("--tier", choices=TIERS, default="a+",
                             help="a: etcd+apiserver; a+: also controller-manager and scheduler "
                                  "and a fake node; node: a real kubelet node (root)")
            cmd.add_argument("--no-s3", dest="s3", action="store_false", help="skip MinIO")
            cmd.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                             help="tier node: 2 adds a second real node in namespaces of its "
                                  "own (hack/node/second.py)")
            cmd.add_argument("--build", action="store_true",
                             help="run hack/build-all.sh first for missing binaries")
    args = parser.parse_args(argv)
    if args.command == "down":
        down(args.dir)
        return 0
    if args.command == "env":
        state = State.load(args.dir.resolve())
        if state is None or not state.running():
            print(f"no running cluster in {args.dir}", file=sys.stderr)
            return 1
        print_env(state)
        return 0
    if args.build and (missing := find_binaries().missing(args.tier, args.s3)):
        build(missing)
    try:
        state = up(args.dir, tier=args.tier, s3=args.s3)
        if args.nodes == 2:
            if args.tier != "node":
                raise ClusterError("--nodes 2 needs --tier node")
            up_second_node(args.dir)
    except ClusterError as err:
        print(f"cluster.py: {err}", file=sys.stderr)
        return 1
    print_env(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
