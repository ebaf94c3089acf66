"""The job's rendezvous store: a tiny pod running a TCPStore server, and its Service.

With torchrun's c10d backend the agent whose host matches the endpoint hosts the store, so
losing that worker loses the rendezvous for everyone. The store therefore lives in a pod of its
own, placed by spec.rendezvous.store (a non-preemptible node), and every worker points at its
Service with is_host=false. restartPolicy Always: the store is a server, not a task.
"""

from __future__ import annotations

from elastrain_operator.model.names import (
    LABEL_JOB,
    LABEL_ROLE,
    RDZV_PORT_NAME,
    ROLE_STORE,
    STORE_CONTAINER,
    store_name,
)
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.meta import Manifest, child_metadata
from elastrain_operator.render.node_loss import with_node_loss_tolerations
from elastrain_operator.render.security import (
    pod_security_context,
    scratch_volumes,
    store_container_security_context,
)

# The store is a TCPStore, but reaching it means importing torch: PyPI's CUDA build maps ~530 MiB
# on import (measured: max RSS 526 MiB), and a 256Mi limit OOM-killed the store on a real node.
STORE_RESOURCES = {"requests": {"cpu": "50m", "memory": "640Mi"},
                   "limits": {"memory": "1Gi"}}


# The store's whole program, run with `python3 -c`: it needs python3 and torch only, so the store
# runs in any image a worker runs, a user's own `torchrun train.py` image without elastrain's
# code included. elastrain_trainer.launch.rdzv_store.PROGRAM is the same text (local mode runs
# it; a test keeps the two equal: the operator never imports the trainer).
STORE_PROGRAM = """\
import signal, sys, threading
from datetime import timedelta
from torch.distributed import TCPStore
host, port = sys.argv[1], int(sys.argv[2])
done = threading.Event()
for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda *_: done.set())
store = TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True,
                 timeout=timedelta(hours=1))
print(f"rendezvous store listening on {host}:{store.port}", flush=True)
done.wait()
"""


def render_store_command(port: int) -> list[str]:
    return ["python3", "-c", STORE_PROGRAM, "0.0.0.0", str(port)]


def render_store_pod(job: TrainingJob, avoid: str = "") -> Manifest:
    """`avoid`: a node the pod prefers not to run on (the node of a store no trainer heard,
    policy.store: it may still read Ready). Preferred, not required: on a cluster whose only
    node that takes the store is that one (one node, a frozen store process), it lands there."""
    spec = job.spec
    store = spec.rendezvous.store
    port = spec.rendezvous.port
    volumes, mounts = scratch_volumes(spec, shm=False)
    pod_spec: Manifest = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 5,
        "containers": [{
            "name": STORE_CONTAINER,
            "image": store.image or spec.image,
            "command": render_store_command(port),
            "ports": [{"name": RDZV_PORT_NAME, "containerPort": port, "protocol": "TCP"}],
            "resources": STORE_RESOURCES,
            "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
            # A crash leaves its log's tail in lastState: RendezvousStoreReady quotes its last
            # line (a store image without python3 or torch says so there).
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": store_container_security_context(),
            "volumeMounts": mounts,
        }],
        "volumes": volumes,
        "securityContext": pod_security_context(spec.template),
    }
    if store.node_selector:
        pod_spec["nodeSelector"] = dict(store.node_selector)
    pod_spec["tolerations"] = with_node_loss_tolerations(
        job, [t.to_api() for t in store.tolerations])
    if avoid:
        elsewhere = {"matchFields": [
            {"key": "metadata.name", "operator": "NotIn", "values": [avoid]}]}
        pod_spec["affinity"] = {"nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "preference": elsewhere}]}}
    if store.priority_class_name:
        pod_spec["priorityClassName"] = store.priority_class_name
    if spec.template.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.template.image_pull_secrets]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": child_metadata(job, store_name(job.metadata.name), role=ROLE_STORE),
            "spec": pod_spec}


def render_store_service(job: TrainingJob) -> Manifest:
    port = job.spec.rendezvous.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(job, store_name(job.metadata.name), role=ROLE_STORE),
        "spec": {
            "selector": {LABEL_JOB: job.metadata.name, LABEL_ROLE: ROLE_STORE},
            "ports": [{"name": RDZV_PORT_NAME, "port": port, "targetPort": port,
                       "protocol": "TCP"}],
        },
    }
