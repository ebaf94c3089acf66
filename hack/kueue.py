"""Real Kueue beside the integration tier's control plane: its CRDs, its manager as a process on
loopback, and the webhook configurations that make the apiserver call it.

Kueue is installed the way its release manifests do it, minus what needs in-cluster networking:
- The manager runs as a host process with internal cert management off; its webhook server
  serves a certificate the cluster's CA issued for 127.0.0.1, and every webhook (admission and
  CRD conversion) is registered with a `url:` clientConfig instead of a Service.
- CRD conversion (v1beta1 <-> v1beta2): both versions are served and v1beta2 is stored, so a
  v1beta1 read needs the webhook. The five CRDs upstream's kustomization wires to `/convert` get
  the same wiring here; the others serve both versions with strategy None, as upstream does.
- Only the webhooks of what this manager runs are registered: Kueue's own kinds, batch/v1 Jobs
  and pods (frameworks `batch/job` and `pod`: the pod integration is in Kueue's shipped config
  since 0.16, so the operator's pods will meet it in a real cluster). Every webhook fails closed,
  so the Job and pod ones are limited to namespaces labelled NAMESPACE_LABEL, as is
  `managedJobsNamespaceSelector`; other tests on the same apiserver never reach Kueue.
- RBAC: the manager's client certificate is in `system:masters` (cluster-admin); a test harness
  needs no narrower role, and Kueue's ClusterRole would be one more thing to keep in sync.

Kueue 0.17 reads the metrics server's certificate from the fixed path /etc/kueue/metrics/certs
when internal cert management is off (cmd/kueue/main.go), so a placeholder pair is written there
once per machine. Needs PyYAML (the project venv has it, and Debian's python3-yaml).
"""

from __future__ import annotations

import base64
import copy
import subprocess
import tempfile
import time
import urllib.error
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hack.cluster_certs import issue_certificate, write_kubeconfig
from hack.cluster_servers import healthz, kube_request
from hack.cluster_state import ClusterError, Proc, State, free_port, spawn, stop, wait_until

Manifest = dict[str, Any]

NAMESPACE_LABEL = "elastrain.dev/kueue"  # value "true": the namespaces Kueue manages
FRAMEWORKS = ("batch/job", "pod")
# Kinds whose own controller makes their Workloads (README, Kueue): Kueue's pod integration then
# leaves alone the pods of such a job that carries a queue label.
EXTERNAL_FRAMEWORKS = ("TrainingJob.v1alpha1.elastrain.dev",)
# The CRDs config/components/crd/kustomization.yaml patches with a conversion webhook.
CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
# Webhooks registered: those of Kueue's kinds, and of the enabled frameworks' kinds.
WEBHOOK_RULES = {("kueue.x-k8s.io", None), ("batch", "jobs"), ("", "pods")}
NAMESPACED_RULES = {("batch", "jobs"), ("", "pods")}
WEBHOOK_NAMES = {"MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
                 "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration"}
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
FIELD_MANAGER = "elastrain-test-harness"


@dataclass(frozen=True)
class KueueFiles:
    """What hack/build-kueue.sh leaves in the cache."""

    binary: Path
    crds: Path  # directory of CRD manifests
    webhooks: Path  # config/components/webhook/manifests.yaml

    @classmethod
    def in_cache(cls, cache: Path, version: str) -> KueueFiles:
        root = cache / f"kueue-v{version}"
        return cls(root / "bin" / "kueue", root / "crds", root / "webhook" / "manifests.yaml")

    def present(self) -> bool:
        return self.binary.exists() and self.webhooks.exists() and any(self.crds.glob("*.yaml"))


@dataclass
class Kueue:
    """A running Kueue manager and where it listens."""

    directory: Path
    proc: Proc
    webhook_url: str  # https://127.0.0.1:<port>
    health_port: int
    metrics_port: int
    install_seconds: float  # CRDs applied until Established, webhook configurations applied
    start_seconds: float  # from spawn to webhooks answering through the apiserver

    def rss_kib(self) -> int:
        """The manager's resident memory now."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise ClusterError(f"kueue (pid {self.proc.pid}) is not running")


# ------------------------------------------------------------------------------------ pure parts


def namespace_selector() -> Manifest:
    return {"matchLabels": {NAMESPACE_LABEL: "true"}}


def render_config(*, webhook_port: int, health_port: int, metrics_port: int,
                  cert_dir: Path) -> Manifest:
    """The manager's --config file (config.kueue.x-k8s.io/v1beta2 Configuration)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": "kueue-system",
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "leaderElection": {"leaderElect": False},
        "pprofBindAddress": "0",
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": namespace_selector(),
        "integrations": {"frameworks": list(FRAMEWORKS),
                         "externalFrameworks": list(EXTERNAL_FRAMEWORKS)},
        # The visibility API is an aggregated apiserver on a fixed port (8082) that needs an
        # APIService; nothing here reads it, and two pytest workers would fight over the port.
        # Workload slices (alpha in 0.17, off by default) on, so both ways a job grows are
        # tested against one manager: by slices (the operator's ELASTRAIN_KUEUE_SLICES) and by
        # an extra Workload. The gate changes nothing for a Workload that names no slice it
        # replaces and whose counts never drop (its uses in v0.17.0: the scheduler's slice
        # replacement, the Workload webhook's count decrease, a requeue after one).
        "featureGates": {"VisibilityOnDemand": False, "ElasticJobsViaWorkloadSlices": True},
    }


def render_crd(crd: Manifest, *, url: str, ca_bundle: str) -> Manifest:
    """The CRD with upstream's conversion webhook pointed at `url`/convert."""
    out = copy.deepcopy(crd)
    if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
        out["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
            "clientConfig": {"url": f"{url}/convert", "caBundle": ca_bundle},
            "conversionReviewVersions": ["v1"]}}
    return out


def _rule_keys(webhook: Manifest) -> set[tuple[str, str | None]]:
    keys: set[tuple[str, str | None]] = set()
    for rule in webhook["rules"]:
        for group in rule["apiGroups"]:
            keys |= {(group, None)} if group == "kueue.x-k8s.io" else \
                {(group, resource) for resource in rule["resources"]}
    return keys


def render_webhook_configurations(manifests: Iterable[Manifest], *, url: str,
                                  ca_bundle: str) -> list[Manifest]:
    """Upstream's Mutating/ValidatingWebhookConfigurations, keeping the webhooks of what this
    manager runs, each calling `url` + its path; the job and pod ones only in Kueue's namespaces."""
    out = []
    for config in manifests:
        kept = []
        for webhook in config["webhooks"]:
            keys = _rule_keys(webhook)
            if not keys <= WEBHOOK_RULES:
                continue
            path = webhook["clientConfig"]["service"]["path"]
            webhook = {**webhook, "clientConfig": {"url": url + path, "caBundle": ca_bundle}}
            if keys & NAMESPACED_RULES:
                webhook["namespaceSelector"] = namespace_selector()
            kept.append(webhook)
        out.append({"apiVersion": "admissionregistration.k8s.io/v1", "kind": config["kind"],
                    "metadata": {"name": WEBHOOK_NAMES[config["kind"]]}, "webhooks": kept})
    return out


# ------------------------------------------------------------------------------------ API calls


def _api_path(manifest: Manifest, plural: str) -> str:
    group, _, version = manifest["apiVersion"].rpartition("/")
    return f"/apis/{group}/{version}/{plural}/{manifest['metadata']['name']}"


def _apply(state: State, manifest: Manifest, plural: str) -> None:
    """Server-side apply: idempotent on a reused cluster, and no last-applied annotation (the
    Workload CRD is ~0.7 MB of JSON, past that annotation's 256 KiB limit)."""
    path = _api_path(manifest, plural) + f"?fieldManager={FIELD_MANAGER}&force=true"
    # A minute: the Workload CRD alone is ~0.7 MB of JSON, slow to admit on a loaded machine.
    status, body = kube_request(state, "PATCH", path, manifest, "application/apply-patch+yaml",
                                timeout=60)
    if status not in (200, 201):
        raise ClusterError(f"applying {plural} {manifest['metadata']['name']}: {status} {body}")


def _established(state: State, name: str) -> bool:
    status, body = kube_request(
        state, "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    crd: Manifest = body if status == 200 else {}
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def install_crds(state: State, files: KueueFiles, *, url: str, ca_bundle: str) -> list[str]:
    names = []
    for path in sorted(files.crds.glob("*.yaml")):
        crd = render_crd(yaml.safe_load(path.read_text()), url=url, ca_bundle=ca_bundle)
        _apply(state, crd, "customresourcedefinitions")
        names.append(crd["metadata"]["name"])
    for name in names:
        def established(name: str = name) -> bool:
            return _established(state, name)
        wait_until(f"CRD {name} Established", established, None, None, timeout=60)
    return names


def _webhooks_answer(state: State) -> bool:
    """A dry-run ResourceFlavor passes Kueue's mutating and validating webhooks only when the
    apiserver reaches the manager; until then it fails closed (500 "failed calling webhook")."""
    flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
              "metadata": {"name": "elastrain-readiness-probe"}}
    status, _ = kube_request(state, "POST",
                             "/apis/kueue.x-k8s.io/v1beta2/resourceflavors?dryRun=All", flavor)
    return status in (201, 409)


# ------------------------------------------------------------------------------ start and stop


def ensure_metrics_certificate() -> None:
    """A self-signed placeholder where Kueue 0.17 insists on finding one (see the docstring);
    nothing scrapes the metrics server over TLS in the tests."""
    if (METRICS_CERT_DIR / "tls.crt").exists() and (METRICS_CERT_DIR / "tls.key").exists():
        return
    try:
        METRICS_CERT_DIR.parent.mkdir(parents=True, exist_ok=True)
    except PermissionError as err:
        raise ClusterError(f"Kueue needs a metrics certificate in {METRICS_CERT_DIR} (a fixed "
                           f"path in Kueue 0.17); create that directory writable: {err}") from err
    # Written beside and renamed, so concurrent pytest workers never see half a pair.
    tmp = Path(tempfile.mkdtemp(dir=METRICS_CERT_DIR.parent, prefix=".certs-"))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-days", "3650",
                    "-subj", "/CN=kueue-metrics-placeholder", "-keyout", tmp / "tls.key",
                    "-out", tmp / "tls.crt"], check=True, capture_output=True)
    try:
        tmp.rename(METRICS_CERT_DIR)
    except OSError:  # another worker won the race; its pair is as good
        subprocess.run(["rm", "-rf", str(tmp)], check=True)


def start(state: State, files: KueueFiles, directory: Path, *,
          die_with_parent: bool = True) -> Kueue:
    """Installs Kueue on the cluster `state` describes and starts its manager; returns once the
    apiserver reaches its webhooks. The cluster's CA key (DIR/pki/ca.key) signs its certificates."""
    pki = Path(state.dir) / "pki"
    certs = directory / "certs"
    issue_certificate(pki, certs, "tls", "/CN=kueue-webhook", serving_ips=("127.0.0.1",))
    # Beside the cluster's own client certificates, which write_kubeconfig embeds from there.
    issue_certificate(pki, pki, "kueue", "/O=system:masters/CN=kueue-manager")
    kubeconfig = directory / "kubeconfig"
    write_kubeconfig(kubeconfig, state.server, pki, "kueue")
    ensure_metrics_certificate()
    ca_bundle = base64.b64encode((pki / "ca.crt").read_bytes()).decode()
    ports = {"webhook_port": free_port(), "health_port": free_port(),
             "metrics_port": free_port()}
    url = f"https://127.0.0.1:{ports['webhook_port']}"
    installing = time.monotonic()
    install_crds(state, files, url=url, ca_bundle=ca_bundle)
    config = directory / "config.yaml"
    config.write_text(yaml.safe_dump(render_config(cert_dir=certs, **ports)))
    manifests = list(yaml.safe_load_all(files.webhooks.read_text()))
    for webhook_config in render_webhook_configurations(manifests, url=url, ca_bundle=ca_bundle):
        plural = webhook_config["kind"].lower() + "s"
        _apply(state, webhook_config, plural)
    started = time.monotonic()
    install_seconds = started - installing
    proc, popen = spawn("kueue", [str(files.binary), f"--config={config}"], directory,
                        die_with_parent=die_with_parent, env={"KUBECONFIG": str(kubeconfig)})
    kueue = Kueue(directory, proc, url, ports["health_port"], ports["metrics_port"],
                  install_seconds, 0.0)
    try:
        wait_until("kueue", lambda: healthz(f"http://127.0.0.1:{ports['health_port']}/readyz"),
                   popen, proc.log, timeout=120)
        wait_until("kueue webhooks", lambda: _webhooks_answer(state), popen, proc.log,
                   timeout=60)
    except BaseException:
        stop_kueue(state, kueue)
        raise
    kueue.start_seconds = time.monotonic() - started
    return kueue


def stop_kueue(state: State, kueue: Kueue) -> None:
    """Unregisters every webhook first, so that nothing on the apiserver calls a stopped
    manager: admission would fail closed, and v1beta1 reads of converted kinds would error."""
    try:
        for kind, name in WEBHOOK_NAMES.items():
            kube_request(state, "DELETE",
                         f"/apis/admissionregistration.k8s.io/v1/{kind.lower()}s/{name}")
        for plural in CONVERTED_CRDS:
            patch = {"spec": {"conversion": {"strategy": "None", "webhook": None}}}
            kube_request(state, "PATCH",
                         f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                         f"{plural}.kueue.x-k8s.io", patch, "application/merge-patch+json")
    except (OSError, urllib.error.URLError):
        pass  # the apiserver is gone already, and with it everything that could call Kueue
    finally:
        stop(kueue.proc)


def environment_for(state_dir: Path) -> State:
    """The State of a cluster hack/cluster.py started in `state_dir` (its kubeconfig's folder)."""
    state = State.load(state_dir)
    if state is None or not (state_dir / "pki" / "ca.key").exists():
        raise ClusterError(f"{state_dir} holds no cluster hack/cluster.py started (state.json "
                           "and pki/ca.key): Kueue's certificates are issued from that CA")
    return state

