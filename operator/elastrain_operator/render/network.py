"""The job's NetworkPolicy: its rendezvous store and its workers talk only to their own job.

One policy per job, selecting every pod of the job (store and workers), ingress only: egress
stays open, so workers still reach object storage (S3, MinIO), DNS and the apiserver. Rules:

1. from this job's worker pods, any port: the store's rendezvous port, and the ports gloo and
   NCCL pick at random for collectives between workers;
2. the metrics/progress port (spec.metricsPort, when not 0) from the operator's pods, whose
   probe polls every Ready worker's `GET /progress` on it, and from the configured scrapers
   (Prometheus). Nothing else of the operator connects to a job's pods.

Not listed, and still allowed: the node a pod runs on. The store's tcpSocket readiness probe
comes from its kubelet, and the Kubernetes documentation says traffic to and from a pod's own
node is always allowed whatever the policy; kube-router, the e2e node's enforcer, accepts it
with a rule of its own (source address type LOCAL) ahead of the policy's.

Known limits of one label-based policy: a pod of the job's namespace that forges the job's
worker labels passes as a worker (labels are namespace-scoped trust, as for every
NetworkPolicy); and a job whose rendezvous port equals its metrics port opens its store to the
operator and the scrapers too (the store listens on no other port).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastrain_operator.model.names import (
    LABEL_JOB,
    LABEL_ROLE,
    ROLE_NETWORK,
    ROLE_WORKER,
    network_policy_name,
)
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.meta import Manifest, child_metadata


@dataclass(frozen=True)
class MetricsPeers:
    """Who may reach the workers' metrics/progress port, as NetworkPolicyPeer objects.

    operator None: nobody told the operator who it is, so the port stays open to every source
    (a rule with ports and no `from`): blocking the operator's progress polls would silently
    turn off progress reporting and the hang watchdog. The store and the collective ports stay
    closed to everyone but the job's workers either way.
    """

    operator: Manifest | None = None
    scrapers: tuple[Manifest, ...] = ()


def render_network_policy(job: TrainingJob, peers: MetricsPeers) -> Manifest:
    name = job.metadata.name
    workers = {"podSelector": {"matchLabels": {LABEL_JOB: name, LABEL_ROLE: ROLE_WORKER}}}
    ingress: list[Manifest] = [{"from": [workers]}]
    port = job.spec.metrics_port
    if port:
        metrics: Manifest = {"ports": [{"protocol": "TCP", "port": port}]}
        if peers.operator is not None:
            metrics["from"] = [dict(peers.operator), *(dict(p) for p in peers.scrapers)]
        ingress.append(metrics)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(job, network_policy_name(name), role=ROLE_NETWORK),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
