"""Certificates for the test servers, made with the openssl CLI: a CA, the apiserver's serving
certificate, the client certificates, the service-account key pair, and kubeconfigs that embed them.
Part of hack/cluster.py (standard library only)."""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
from pathlib import Path

from hack.cluster_state import SERVICE_IP


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path)
    path.chmod(0o600)


def _sign(pki: Path, name: str, subject: str, extensions: str, out: Path | None = None) -> None:
    """Issues <out>/<name>.crt (and its key) signed by pki/ca; `out` defaults to pki."""
    out = out or pki
    key, csr, ext = out / f"{name}.key", out / f"{name}.csr", out / f"{name}.ext"
    _new_key(key)
    _openssl("req", "-new", "-key", key, "-subj", subject, "-out", csr)
    ext.write_text(extensions)
    _openssl("x509", "-req", "-in", csr, "-CA", pki / "ca.crt", "-CAkey", pki / "ca.key",
             "-set_serial", str(secrets.randbits(63)), "-days", "3650", "-sha256",
             "-extfile", ext, "-out", out / f"{name}.crt")
    csr.unlink()
    ext.unlink()


def make_pki(pki: Path, *, extra_ips: tuple[str, ...] = ()) -> None:
    """A CA, the apiserver's serving cert, client certs and the service-account key pair.
    `extra_ips`: more addresses the apiserver is reached at (the real node's bridge address)."""
    pki.mkdir(parents=True, exist_ok=True)
    _new_key(pki / "ca.key")
    _openssl("req", "-x509", "-new", "-key", pki / "ca.key", "-subj", "/CN=elastrain-test-ca",
             "-days", "3650", "-sha256", "-out", pki / "ca.crt")
    sans = ",".join([
        "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local", "IP:127.0.0.1", f"IP:{SERVICE_IP}",
        *(f"IP:{ip}" for ip in extra_ips),
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


def make_node_pki(pki: Path, *, node_name: str, node_ip: str) -> None:
    """What a real node adds to the CA of make_pki (note, pitfall 4): the kubelet's serving cert
    (the node IP as SAN, checked by the apiserver's --kubelet-certificate-authority), the kubelet's
    client cert as system:node:<name> (Node authorizer + NodeRestriction), kube-proxy's, and the
    apiserver's client cert for the kubelet API (system:masters passes the kubelet's webhook
    authorization)."""
    client = "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
    make_kubelet_pki(pki, node_name=node_name, node_ip=node_ip)
    _sign(pki, "kube-proxy", "/CN=system:kube-proxy", client)
    _sign(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
          client)


def issue_certificate(pki: Path, out: Path, name: str, subject: str, *,
                      serving_ips: tuple[str, ...] = ()) -> None:
    """One more certificate from the cluster's CA for a server the harness adds (Kueue): a serving
    certificate for `serving_ips` (a webhook the apiserver calls by URL), or a client one."""
    out.mkdir(parents=True, exist_ok=True)
    usage = "serverAuth" if serving_ips else "clientAuth"
    extensions = f"keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n"
    if serving_ips:
        extensions += "subjectAltName=" + ",".join(f"IP:{ip}" for ip in serving_ips) + "\n"
    _sign(pki, name, subject, extensions, out)


def make_kubelet_pki(pki: Path, *, node_name: str, node_ip: str, prefix: str = "kubelet") -> None:
    """One node's kubelet certificates: pki/<prefix>-serving (the node IP as SAN) and
    pki/<prefix> (system:node:<name>); a second node passes a prefix of its own."""
    server = "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    client = "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
    _sign(pki, f"{prefix}-serving", f"/CN={node_name}",
          server + f"subjectAltName=DNS:{node_name},IP:{node_ip}\n")
    _sign(pki, prefix, f"/O=system:nodes/CN=system:node:{node_name}", client)
