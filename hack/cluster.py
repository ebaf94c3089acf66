#!/usr/bin/env python3
"""Real test servers on loopback: etcd + kube-apiserver (tier a), plus kube-controller-manager and
kube-scheduler (tier a+), and MinIO with a bucket. Standard library only (certificates come from the
openssl CLI), so it runs with any python3 >= 3.11, inside or outside the project's venv.

    python3 hack/cluster.py up   [--tier a|a+|none] [--no-s3] [--dir DIR]   # prints `env`
    python3 hack/cluster.py env  [--dir DIR]    # shell exports: KUBECONFIG, ELASTRAIN_*
    python3 hack/cluster.py down [--dir DIR]

Binaries come from the cache the hack/build-*.sh scripts fill (versions in hack/versions.env); `up`
fails naming the script to run when one is missing. Every listener binds 127.0.0.1 on a free port,
so several clusters (parallel CI jobs, a developer's own) coexist. State, certificates, kubeconfig
and logs live in DIR; etcd and MinIO data on /dev/shm. `down` stops the recorded PIDs (checking
each is still the process we started) and removes the data. tests/conftest.py imports this module
and starts the servers with `die_with_parent=True`: then the kernel kills them (PR_SET_PDEATHSIG)
if the test session dies without running its teardown.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import datetime
import hashlib
import hmac
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

HACK = Path(__file__).resolve().parent
DEFAULT_DIR = Path(os.environ.get("ELASTRAIN_CLUSTER_DIR", "/tmp/elastrain-cluster"))
SHM = Path("/dev/shm")
BUCKET = "elastrain-test"
REGION = "us-east-1"
SERVICE_CIDR = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"
FAKE_NODES = ("node-a",)
FAKE_NODE_LABEL = "elastrain.dev/fake-node=true"
STOP_ORDER = ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd", "minio")
TIERS = ("none", "a", "a+")


class ClusterError(RuntimeError):
    """A server could not be started or did not become ready."""


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


@dataclass(frozen=True)
class Binaries:
    """Where the build scripts put each program, and which script builds it."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    minio: Path

    def needed(self, tier: str, s3: bool) -> list[tuple[str, Path]]:
        """(build-all.sh component, binary) pairs that `up` with these options runs."""
        wanted: list[tuple[str, Path]] = []
        if tier in ("a", "a+"):
            wanted += [("etcd", self.etcd), ("k8s", self.kube_apiserver)]
        if tier == "a+":
            wanted += [("k8s", self.kube_controller_manager), ("k8s", self.kube_scheduler)]
        if s3:
            wanted.append(("minio", self.minio))
        return wanted

    def missing(self, tier: str, s3: bool) -> list[str]:
        """Components (build-all.sh names) whose binary is absent, without duplicates."""
        return sorted({name for name, path in self.needed(tier, s3) if not path.exists()})


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
    )


def build(components: Sequence[str]) -> None:
    """Runs hack/build-all.sh for the given components (slow when cold: see hack/README.md)."""
    subprocess.run(["bash", str(HACK / "build-all.sh"), *components], check=True)


# ------------------------------------------------------------------------------------ certificates


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path)
    path.chmod(0o600)


def _sign(pki: Path, name: str, subject: str, extensions: str) -> None:
    """Issues pki/<name>.crt (and its key) signed by pki/ca."""
    key, csr, ext = pki / f"{name}.key", pki / f"{name}.csr", pki / f"{name}.ext"
    _new_key(key)
    _openssl("req", "-new", "-key", key, "-subj", subject, "-out", csr)
    ext.write_text(extensions)
    _openssl("x509", "-req", "-in", csr, "-CA", pki / "ca.crt", "-CAkey", pki / "ca.key",
             "-set_serial", str(secrets.randbits(63)), "-days", "3650", "-sha256",
             "-extfile", ext, "-out", pki / f"{name}.crt")
    csr.unlink()
    ext.unlink()


def make_pki(pki: Path) -> None:
    """A CA, the apiserver's serving cert, client certs and the service-account key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    _new_key(pki / "ca.key")
    _openssl("req", "-x509", "-new", "-key", pki / "ca.key", "-subj", "/CN=elastrain-test-ca",
             "-days", "3650", "-sha256", "-out", pki / "ca.crt")
    sans = ",".join([
        "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local", "IP:127.0.0.1", f"IP:{SERVICE_IP}",
    ])
    server = "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    client = "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
    _sign(pki, "apiserver", "/CN=kube-apiserver", server + f"subjectAltName={sans}\n")
    _sign(pki, "admin", "/O=system:masters/CN=elastrain-admin", client)
    _sign(pki, "controller-manager", "/CN=system:kube-controller-manager", client)
    _sign(pki, "scheduler", "/CN=system:kube-scheduler", client)
    _new_key(pki / "sa.key")
    _openssl("pkey", "-in", pki / "sa.key", "-pubout", "-out", pki / "sa.pub")


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A self-contained kubeconfig (JSON is valid YAML) with the certificates embedded."""
    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "elastrain",
        "clusters": [{"name": "elastrain", "cluster": {
            "server": server, "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": user, "user": {
            "client-certificate-data": b64(f"{user}.crt"), "client-key-data": b64(f"{user}.key")}}],
        "contexts": [{"name": "elastrain", "context": {"cluster": "elastrain", "user": user}}],
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


# -------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """preexec_fn: have the kernel send SIGTERM to the child when the parent thread exits."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


@dataclass
class Proc:
    """A started server as recorded in state.json."""

    name: str
    pid: int
    argv: list[str]
    log: str

    def alive(self) -> bool:
        """True while our process (not a later one that reused the PID) runs."""
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        zombie = stat.rpartition(")")[2].split()[0] == "Z"
        return not zombie and cmdline[0].decode() == self.argv[0]


def spawn(name: str, argv: list[str], logs: Path, *, die_with_parent: bool,
          env: dict[str, str] | None = None) -> tuple[Proc, subprocess.Popen[bytes]]:
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    return Proc(name, popen.pid, argv, str(log)), popen


def stop(proc: Proc, timeout: float = 15.0) -> None:
    if not proc.alive():
        return
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.alive():
        os.kill(proc.pid, signal.SIGKILL)


def wait_until(what: str, check: Callable[[], bool], popen: subprocess.Popen[bytes] | None,
               log: str | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            raise ClusterError(f"{what} exited with {popen.returncode}; see {log}:\n{tail(log)}")
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ssl.SSLError, ValueError):
            pass
        time.sleep(0.2)
    raise ClusterError(f"{what} not ready after {timeout:.0f} s; see {log}:\n{tail(log)}")


def tail(log: str | None, lines: int = 20) -> str:
    if not log or not Path(log).exists():
        return ""
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])


# ------------------------------------------------------------------------------------ HTTP clients


def _https_context(pki: Path, user: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if user:
        ctx.load_cert_chain(str(pki / f"{user}.crt"), str(pki / f"{user}.key"))
    return ctx


def kube_request(state: State, method: str, path: str, body: object = None,
                 content_type: str = "application/json") -> tuple[int, dict[str, object]]:
    """One request to the apiserver as the admin user; returns (status, decoded JSON body)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(state.server + path, data=data, method=method,
                                 headers={"Content-Type": content_type})
    ctx = _https_context(Path(state.dir) / "pki", "admin")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _healthz(url: str, ctx: ssl.SSLContext | None = None) -> bool:
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


# ------------------------------------------------------------------------------------------ state


@dataclass
class State:
    """Everything `env` and `down` need, kept in DIR/state.json."""

    dir: str
    tier: str = "none"
    k8s_version: str = ""
    server: str = ""
    kubeconfig: str = ""
    s3_endpoint: str = ""
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_bucket: str = BUCKET
    s3_region: str = REGION
    data_dirs: list[str] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return Path(self.dir) / "state.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(self.path)

    @classmethod
    def load(cls, directory: Path) -> State | None:
        try:
            raw = json.loads((directory / "state.json").read_text())
        except (OSError, ValueError):
            return None
        raw["procs"] = [Proc(**p) for p in raw.get("procs", [])]
        return cls(**raw)

    def running(self) -> bool:
        return bool(self.procs) and all(p.alive() for p in self.procs)

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.kubeconfig:
            out |= {"KUBECONFIG": self.kubeconfig, "ELASTRAIN_KUBECONFIG": self.kubeconfig}
        if self.s3_endpoint:
            out |= {"ELASTRAIN_S3_ENDPOINT": self.s3_endpoint,
                    "ELASTRAIN_S3_ACCESS_KEY": self.s3_access_key,
                    "ELASTRAIN_S3_SECRET_KEY": self.s3_secret_key,
                    "ELASTRAIN_S3_BUCKET": self.s3_bucket,
                    "ELASTRAIN_S3_REGION": self.s3_region}
        return out


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
           lambda: _healthz(f"http://127.0.0.1:{ports['client']}/readyz"),
           die_with_parent=die_with_parent, timeout=30)
    return f"http://127.0.0.1:{ports['client']}"


def start_apiserver(state: State, binaries: Binaries, etcd_url: str, *,
                    die_with_parent: bool) -> None:
    pki = Path(state.dir) / "pki"
    port = {"secure": 0}
    # Tier a has no controller-manager to create `default` ServiceAccounts, so the ServiceAccount
    # admission plugin would refuse every pod; tier a+ keeps it, as a real cluster does.
    admission = ["--disable-admission-plugins=ServiceAccount"] if state.tier == "a" else []

    def argv() -> list[str]:
        port["secure"] = free_port()
        return [
            str(binaries.kube_apiserver), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={port['secure']}", f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=RBAC",
            # The `kubernetes` Service's Endpoints may not hold a loopback address, and no pod
            # could use one anyway: leave them unmanaged instead of logging errors forever.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true", "--profiling=false", "--v=1", *admission,
        ]

    def ready() -> bool:
        state.server = f"https://127.0.0.1:{port['secure']}"
        return _healthz(state.server + "/readyz", _https_context(pki, "admin"))

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

    def argv() -> list[str]:
        port["secure"] = free_port()
        return [
            *_component_argv(state, binaries.kube_controller_manager, "controller-manager",
                             port["secure"]),
            # No kubelet posts heartbeats for the fake nodes: without node-lifecycle-controller
            # they stay Ready instead of being tainted unreachable and having their pods evicted.
            "--controllers=*,-node-lifecycle-controller",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
        ]

    _start(state, "kube-controller-manager", argv,
           lambda: _healthz(f"https://127.0.0.1:{port['secure']}/healthz", _insecure()),
           die_with_parent=die_with_parent, timeout=60)


def start_scheduler(state: State, binaries: Binaries, *, die_with_parent: bool) -> None:
    port = {"secure": 0}

    def argv() -> list[str]:
        port["secure"] = free_port()
        return _component_argv(state, binaries.kube_scheduler, "scheduler", port["secure"])

    _start(state, "kube-scheduler", argv,
           lambda: _healthz(f"https://127.0.0.1:{port['secure']}/healthz", _insecure()),
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


def start_minio(state: State, binaries: Binaries, *, die_with_parent: bool) -> None:
    data = _data_dir(state, "minio")
    state.s3_access_key = "elastrain-" + secrets.token_hex(4)
    state.s3_secret_key = secrets.token_urlsafe(24)
    env = {"MINIO_ROOT_USER": state.s3_access_key, "MINIO_ROOT_PASSWORD": state.s3_secret_key,
           "MINIO_BROWSER": "off", "MINIO_UPDATE": "off", "MINIO_REGION": REGION,
           "MINIO_CI_CD": "1"}
    port = {"api": 0}

    def argv() -> list[str]:
        port["api"] = free_port()
        state.s3_endpoint = f"http://127.0.0.1:{port['api']}"
        return [str(binaries.minio), "server", "--quiet", "--address", f"127.0.0.1:{port['api']}",
                "--console-address", f"127.0.0.1:{free_port()}", str(data)]

    _start(state, "minio", argv, lambda: _healthz(state.s3_endpoint + "/minio/health/ready"),
           die_with_parent=die_with_parent, timeout=60, env=env)
    status = s3_request(state, "PUT", f"/{BUCKET}")
    if status not in (200, 409):
        raise ClusterError(f"creating bucket {BUCKET}: HTTP {status}")
    state.save()


# ------------------------------------------------------------------------------------ up and down


def up(directory: Path, *, tier: str = "a+", s3: bool = True, die_with_parent: bool = False,
       binaries: Binaries | None = None) -> State:
    """Starts the servers (or returns the running ones recorded in `directory`)."""
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
        _up(state, binaries, s3=s3, die_with_parent=die_with_parent)
    except BaseException:
        down(directory)
        raise
    return state


def _up(state: State, binaries: Binaries, *, s3: bool, die_with_parent: bool) -> None:
    if state.tier != "none":
        make_pki(Path(state.dir) / "pki")
        etcd_url = start_etcd(state, binaries, die_with_parent=die_with_parent)
        start_apiserver(state, binaries, etcd_url, die_with_parent=die_with_parent)
    if state.tier == "a+":
        start_controller_manager(state, binaries, die_with_parent=die_with_parent)
        start_scheduler(state, binaries, die_with_parent=die_with_parent)
        for name in FAKE_NODES:
            register_fake_node(state, name)
        wait_for_default_service_account(state)
    if s3:
        start_minio(state, binaries, die_with_parent=die_with_parent)
    state.save()


def down(directory: Path) -> None:
    """Stops every recorded server and removes their data; safe to call any number of times."""
    state = State.load(directory.resolve())
    if state is None:
        return
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
                             help="a: etcd+apiserver; a+: also controller-manager and scheduler")
            cmd.add_argument("--no-s3", dest="s3", action="store_false", help="skip MinIO")
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
    except ClusterError as err:
        print(f"cluster.py: {err}", file=sys.stderr)
        return 1
    print_env(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
