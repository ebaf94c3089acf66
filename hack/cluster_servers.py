"""Each test server: where its binary is, its command line on free loopback ports, when it is
ready, and the API calls that finish it (fake Ready nodes, the MinIO bucket). Every server starts
through `_start`, which retries with fresh ports. Part of hack/cluster.py (stdlib only)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import secrets
import shutil
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hack.cluster_certs import write_kubeconfig
from hack.cluster_state import (
    BUCKET,
    REGION,
    SERVICE_CIDR,
    SHM,
    ClusterError,
    State,
    free_port,
    spawn,
    stop,
    wait_until,
)

FAKE_NODE_LABEL = "elastrain.dev/fake-node=true"
# Seconds without a kubelet's lease renewal before the node controller marks its Node NotReady
# (the real-node tier only; start_controller_manager says why not Kubernetes' 50 s).
NODE_MONITOR_GRACE_S = 20


@dataclass(frozen=True)
class Binaries:
    """Where the build scripts put each program, and which script builds it."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    minio: Path
    kubelet: Path
    kube_proxy: Path
    coredns: Path
    kube_router: Path

    def needed(self, tier: str, s3: bool) -> list[tuple[str, Path]]:
        """(build-all.sh component, binary) pairs that `up` with these options runs."""
        wanted: list[tuple[str, Path]] = []
        if tier in ("a", "a+", "node"):
            wanted += [("etcd", self.etcd), ("k8s", self.kube_apiserver)]
        if tier in ("a+", "node"):
            wanted += [("k8s", self.kube_controller_manager), ("k8s", self.kube_scheduler)]
        if tier == "node":
            wanted += [("node", self.kubelet), ("node", self.kube_proxy),
                       ("coredns", self.coredns), ("kube-router", self.kube_router)]
        if s3:
            wanted.append(("minio", self.minio))
        return wanted

    def missing(self, tier: str, s3: bool) -> list[str]:
        """Components (build-all.sh names) whose binary is absent, without duplicates."""
        return sorted({name for name, path in self.needed(tier, s3) if not path.exists()})


# ------------------------------------------------------------------------------------ HTTP clients


def _https_context(pki: Path, user: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if user:
        ctx.load_cert_chain(str(pki / f"{user}.crt"), str(pki / f"{user}.key"))
    return ctx


def kube_request(state: State, method: str, path: str, body: object = None,
                 content_type: str = "application/json",
                 timeout: float = 10) -> tuple[int, dict[str, object]]:
    """One request to the apiserver as the admin user; returns (status, decoded JSON body)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(state.server + path, data=data, method=method,
                                 headers={"Content-Type": content_type})
    ctx = _https_context(Path(state.dir) / "pki", "admin")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def healthz(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    with urllib.request.urlopen(url, context=ctx, timeout=5) as resp:
        return bool(resp.status == 200)


def _insecure() -> ssl.SSLContext:
    """For the self-signed healthz endpoints of controller-manager and scheduler."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def s3_request(state: State, method: str, path: str, body: bytes = b"") -> int:
    """A SigV4-signed request to MinIO (enough for bucket creation); returns the HTTP status."""
    now = datetime.datetime.now(datetime.UTC)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    host = state.s3_endpoint.removeprefix("http://")
    payload_hash = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "",
                           signed, payload_hash])
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{state.s3_secret_key}".encode()
    for part in (day, REGION, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={state.s3_access_key}/{scope}, "
                                f"SignedHeaders={signed}, Signature={signature}")
    req = urllib.request.Request(state.s3_endpoint + path, data=body or None, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


# ------------------------------------------------------------------------------------- one server


def _data_dir(state: State, name: str) -> Path:
    """A fresh tmpfs directory (disk when /dev/shm is absent), removed again by `down`."""
    base = SHM if SHM.is_dir() else Path(state.dir)
    path = base / f"elastrain-{name}-{secrets.token_hex(6)}"
    path.mkdir(mode=0o700)
    state.data_dirs.append(str(path))
    state.save()
    return path


def _start(state: State, name: str, argv_for: Callable[[], list[str]],
           ready: Callable[[], bool], *, die_with_parent: bool, timeout: float,
           env: dict[str, str] | None = None, attempts: int = 3) -> None:
    """Starts one server and waits until `ready`; a fresh port set per attempt, since a port
    picked as free can be taken by a concurrent cluster before our server binds it."""
    logs = Path(state.dir) / "logs"
    for attempt in range(1, attempts + 1):
        proc, popen = spawn(name, argv_for(), logs, die_with_parent=die_with_parent, env=env)
        state.procs.append(proc)
        state.save()
        try:
            wait_until(name, ready, popen, proc.log, timeout)
            return
        except ClusterError:
            stop(proc)
            state.procs.remove(proc)
            state.save()
            if attempt == attempts:
                raise


# ---------------------------------------------------------------------------------------- servers


def start_etcd(state: State, binaries: Binaries, *, die_with_parent: bool) -> str:
    data = _data_dir(state, "etcd")
    ports: dict[str, int] = {}

    def argv() -> list[str]:
        ports.update(client=free_port(), peer=free_port())
        client, peer = f"http://127.0.0.1:{ports['client']}", f"http://127.0.0.1:{ports['peer']}"
        shutil.rmtree(data / "member", ignore_errors=True)
        return [str(binaries.etcd), "--name=elastrain", f"--data-dir={data}",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=elastrain={peer}", "--unsafe-no-fsync", "--log-level=warn"]

    _start(state, "etcd", argv,
           lambda: healthz(f"http://127.0.0.1:{ports['client']}/readyz"),
           die_with_parent=die_with_parent, timeout=30)
    return f"http://127.0.0.1:{ports['client']}"


def _real_node_args(pki: Path) -> list[str]:
    """What a cluster with a real kubelet needs (shared/notes/real-node.md, pitfall 4): the
    kubernetes Service's endpoints kept (pods use it), the Node authorizer, and the apiserver's
    client side of the kubelet API (logs, exec, port-forward)."""
    return [
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        "--kubelet-preferred-address-types=InternalIP",
    ]


def start_apiserver(state: State, binaries: Binaries, etcd_url: str, *,
                    die_with_parent: bool, address: str = "127.0.0.1") -> None:
    """On loopback (tiers a, a+), or on the real node's bridge address (tier node), where pods
    reach it through the `kubernetes` Service."""
    pki = Path(state.dir) / "pki"
    port = {"secure": 0}
    # Tier a has no controller-manager to create `default` ServiceAccounts, so the ServiceAccount
    # admission plugin would refuse every pod; tier a+ keeps it, as a real cluster does.
    admission = ["--disable-admission-plugins=ServiceAccount"] if state.tier == "a" else []
    if state.tier == "node":
        mode = _real_node_args(pki)
    else:
        # The `kubernetes` Service's Endpoints may not hold a loopback address, and no pod
        # could use one anyway: leave them unmanaged instead of logging errors forever.
        mode = ["--authorization-mode=RBAC", "--endpoint-reconciler-type=none"]

    def argv() -> list[str]:
        port["secure"] = free_port(address)
        return [
            str(binaries.kube_apiserver), f"--etcd-servers={etcd_url}",
            f"--bind-address={address}", f"--advertise-address={address}",
            f"--secure-port={port['secure']}", f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", *mode,
            "--allow-privileged=true", "--profiling=false", "--v=1", *admission,
        ]

    def ready() -> bool:
        state.server = f"https://{address}:{port['secure']}"
        return healthz(state.server + "/readyz", _https_context(pki, "admin"))

    _start(state, "kube-apiserver", argv, ready, die_with_parent=die_with_parent, timeout=90)
    state.kubeconfig = str(Path(state.dir) / "kubeconfig")
    write_kubeconfig(Path(state.kubeconfig), state.server, pki, "admin")
    state.save()


def _component_argv(state: State, binary: Path, user: str, port: int) -> list[str]:
    kubeconfig = Path(state.dir) / f"{user}.kubeconfig"
    write_kubeconfig(kubeconfig, state.server, Path(state.dir) / "pki", user)
    # No --authentication/authorization-kubeconfig: only /healthz (always allowed) is used, and
    # delegated authentication would want a requestheader CA the apiserver does not have.
    return [str(binary), f"--kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
            f"--secure-port={port}", f"--cert-dir={state.dir}/pki",
            "--leader-elect=false", "--profiling=false", "--v=1"]


def start_controller_manager(state: State, binaries: Binaries, *, die_with_parent: bool) -> None:
    pki = Path(state.dir) / "pki"
    port = {"secure": 0}
    # No kubelet posts heartbeats for the fake nodes: without node-lifecycle-controller they stay
    # Ready instead of being tainted unreachable and having their pods evicted. A real node needs
    # it: it lifts the not-ready taint every new Node starts with (real-node.md, pitfall 3).
    controllers = "*" if state.tier == "node" else "*,-node-lifecycle-controller"
    # A node whose kubelet stopped reads NotReady after 20 s, not Kubernetes' default 50 s: the
    # node-loss scenarios wait for it four times (issue 34's e2e budget). Product code reads the
    # Node's condition and taints, never this figure; the kubelets renew their lease every 3 s
    # (hack/node/config.py), so a kubelet must miss six renewals in a row to be judged lost.
    lifecycle = ([f"--node-monitor-grace-period={NODE_MONITOR_GRACE_S}s",
                  "--node-monitor-period=2s"] if state.tier == "node" else [])

    def argv() -> list[str]:
        port["secure"] = free_port()
        return [
            *_component_argv(state, binaries.kube_controller_manager, "controller-manager",
                             port["secure"]),
            f"--controllers={controllers}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", *lifecycle,
        ]

    _start(state, "kube-controller-manager", argv,
           lambda: healthz(f"https://127.0.0.1:{port['secure']}/healthz", _insecure()),
           die_with_parent=die_with_parent, timeout=60)


def start_scheduler(state: State, binaries: Binaries, *, die_with_parent: bool) -> None:
    port = {"secure": 0}

    def argv() -> list[str]:
        port["secure"] = free_port()
        return _component_argv(state, binaries.kube_scheduler, "scheduler", port["secure"])

    _start(state, "kube-scheduler", argv,
           lambda: healthz(f"https://127.0.0.1:{port['secure']}/healthz", _insecure()),
           die_with_parent=die_with_parent, timeout=60)


def _label(selector: str) -> dict[str, str]:
    key, _, value = selector.partition("=")
    return {key: value}


def register_fake_node(state: State, name: str) -> None:
    """A Ready Node no kubelet backs: the scheduler binds pods to it, nothing runs them, and
    tests drive pod phase through the pods/status subresource."""
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                  "kubernetes.io/os": "linux",
                                                  **_label(FAKE_NODE_LABEL)}}}
    status, body = kube_request(state, "POST", "/api/v1/nodes", node)
    if status not in (201, 409):
        raise ClusterError(f"creating node {name}: {status} {body}")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    capacity = {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    patch = {"status": {
        "capacity": capacity, "allocatable": capacity,
        "conditions": [{"type": "Ready", "status": "True", "reason": "FakeNodeReady",
                        "message": "registered by hack/cluster.py; no kubelet",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux",
                     "kubeletVersion": f"v{state.k8s_version}", "kubeProxyVersion": "",
                     "bootID": "", "containerRuntimeVersion": "", "kernelVersion": "",
                     "machineID": "", "osImage": "", "systemUUID": ""}}}
    status, body = kube_request(state, "PATCH", f"/api/v1/nodes/{name}/status", patch,
                                "application/merge-patch+json")
    if status != 200:
        raise ClusterError(f"marking node {name} Ready: {status} {body}")
    # The TaintNodesByCondition admission plugin taints every new Node not-ready; normally the
    # node-lifecycle-controller lifts it once the kubelet reports Ready, but that one is off.
    status, body = kube_request(state, "PATCH", f"/api/v1/nodes/{name}",
                                {"spec": {"taints": None}}, "application/merge-patch+json")
    if status != 200:
        raise ClusterError(f"untainting node {name}: {status} {body}")


def wait_for_default_service_account(state: State, timeout: float = 60) -> None:
    """The controller-manager is really working once it has created `default` in `default`."""
    def exists() -> bool:
        return kube_request(state, "GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] \
            == 200
    log = next((p.log for p in state.procs if p.name == "kube-controller-manager"), None)
    wait_until("default ServiceAccount", exists, None, log, timeout)


def start_minio(state: State, binaries: Binaries, *, die_with_parent: bool,
                address: str = "127.0.0.1") -> None:
    """On loopback, or on the real node's bridge address so that pods reach it too."""
    data = _data_dir(state, "minio")
    state.s3_access_key = "elastrain-" + secrets.token_hex(4)
    state.s3_secret_key = secrets.token_urlsafe(24)
    env = {"MINIO_ROOT_USER": state.s3_access_key, "MINIO_ROOT_PASSWORD": state.s3_secret_key,
           "MINIO_BROWSER": "off", "MINIO_UPDATE": "off", "MINIO_REGION": REGION,
           "MINIO_CI_CD": "1"}
    port = {"api": 0}

    def argv() -> list[str]:
        port["api"] = free_port(address)
        state.s3_endpoint = f"http://{address}:{port['api']}"
        return [str(binaries.minio), "server", "--quiet", "--address", f"{address}:{port['api']}",
                "--console-address", f"127.0.0.1:{free_port()}", str(data)]

    _start(state, "minio", argv, lambda: healthz(state.s3_endpoint + "/minio/health/ready"),
           die_with_parent=die_with_parent, timeout=60, env=env)
    # Ready can come a moment before MinIO's IAM is up: it answers 503 (server not initialized)
    # until then, seen once in ~1 s on a loaded machine.
    deadline = time.monotonic() + 30
    while (status := s3_request(state, "PUT", f"/{BUCKET}")) == 503 and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    if status not in (200, 409):
        raise ClusterError(f"creating bucket {BUCKET}: HTTP {status}")
    state.save()
