"""The headless Service that gives worker pods DNS names (`<host>.<job>-workers.<ns>.svc`)."""

from __future__ import annotations

from elastrain_operator.model.names import (
    LABEL_JOB,
    LABEL_ROLE,
    METRICS_PORT_NAME,
    ROLE_WORKER,
    worker_service_name,
)
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.meta import Manifest, child_metadata


def render_worker_service(job: TrainingJob) -> Manifest:
    """Headless, and publishing not-ready addresses: torchrun resolves a peer's hostname while
    the peer is still joining the rendezvous, long before anything would call it Ready."""
    port = job.spec.metrics_port or job.spec.rendezvous.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(job, worker_service_name(job.metadata.name), role=ROLE_WORKER),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job.metadata.name, LABEL_ROLE: ROLE_WORKER},
            "ports": [{"name": METRICS_PORT_NAME, "port": port, "targetPort": port,
                       "protocol": "TCP"}],
        },
    }
