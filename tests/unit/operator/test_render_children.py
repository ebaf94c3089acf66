"""Children renderers against inline expectations: worker pod, headless Service, store."""

from __future__ import annotations

from typing import Any

import yaml

from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.rendezvous import (
    STORE_PROGRAM,
    render_store_pod,
    render_store_service,
)
from elastrain_operator.render.service import render_worker_service
from elastrain_operator.render.workers import render_worker_pod


def job(**spec: Any) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"image": "trainer:dev", "replicas": 2, "maxReplicas": 4,
                 "recovery": {"mode": "Restart"}, **spec}})


OWNER = {"apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob", "name": "demo",
         "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}

WORKER = yaml.safe_load("""
apiVersion: v1
kind: Pod
metadata:
  name: demo-worker-1-3
  namespace: ml
  labels:
    team: ml
    app.kubernetes.io/name: elastrain
    app.kubernetes.io/managed-by: elastrain-operator
    elastrain.dev/job-name: demo
    elastrain.dev/worker-index: "1"
    elastrain.dev/attempt: "3"
    elastrain.dev/role: worker
  annotations: {note: x}
  finalizers: [elastrain.dev/worker-accounting]
spec:
  hostname: demo-worker-1
  subdomain: demo-workers
  restartPolicy: Never
  terminationGracePeriodSeconds: 90
  nodeSelector: {pool: spot}
  tolerations:
  - {key: spot, operator: Exists, effect: NoSchedule}
  - {key: node.kubernetes.io/not-ready, operator: Exists, effect: NoExecute, tolerationSeconds: 30}
  - {key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute,
     tolerationSeconds: 30}
  priorityClassName: batch
  imagePullSecrets: [{name: regcred}]
  volumes:
  - {name: data, emptyDir: {}}
  - {name: elastrain-tmp, emptyDir: {}}
  - {name: elastrain-shm, emptyDir: {medium: Memory, sizeLimit: 1Gi}}
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    seccompProfile: {type: RuntimeDefault}
  containers:
  - name: trainer
    image: trainer:dev
    command: [python, -m, elastrain_trainer.launch, -m, elastrain_trainer]
    terminationMessagePolicy: FallbackToLogsOnError
    args: [--steps, "5"]
    ports: [{name: metrics, containerPort: 9400, protocol: TCP}]
    resources: {limits: {cpu: "2"}}
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities: {drop: [ALL]}
    volumeMounts:
    - {name: data, mountPath: /data}
    - {name: elastrain-tmp, mountPath: /tmp}
    - {name: elastrain-shm, mountPath: /dev/shm}
""")


def test_worker_pod() -> None:
    pod = render_worker_pod(job(
        args=["--steps", "5"], terminationGracePeriodSeconds=90,
        resources={"limits": {"cpu": "2"}},
        template={"labels": {"team": "ml"}, "annotations": {"note": "x"},
                  "nodeSelector": {"pool": "spot"}, "priorityClassName": "batch",
                  "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                  "imagePullSecrets": ["regcred"], "volumes": [{"name": "data", "emptyDir": {}}],
                  "volumeMounts": [{"name": "data", "mountPath": "/data"}]}), 1, 3)
    env = pod["spec"]["containers"][0].pop("env")
    assert pod["metadata"].pop("ownerReferences") == [OWNER]
    assert pod == WORKER
    assert {"name": "PET_RDZV_ENDPOINT", "value": "demo-rdzv.ml.svc:29400"} in env


NODE_LOSS_30 = [{"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute",
                 "tolerationSeconds": 30} for t in ("not-ready", "unreachable")]


def test_every_pod_leaves_a_lost_node_after_node_loss_toleration_seconds_not_300() -> None:
    """Without tolerations of the node-loss taints a pod gets 300 s (DefaultTolerationSeconds);
    the job's own window applies to workers and the store, and the user's toleration of the
    same key wins."""
    mine = {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
            "effect": "NoExecute", "tolerationSeconds": 600}
    j = job(recovery={"nodeLossTolerationSeconds": 12}, template={"tolerations": [mine]},
            rendezvous={"store": {"tolerations": [mine]}})
    worker = render_worker_pod(j, 0, 0)["spec"]["tolerations"]
    store = render_store_pod(j)["spec"]["tolerations"]
    ready = {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 12}
    assert worker == store == [mine, ready]
    assert render_worker_pod(job(), 0, 0)["spec"]["tolerations"] == NODE_LOSS_30
    assert render_store_pod(job())["spec"]["tolerations"] == NODE_LOSS_30


def test_job_labels_win_over_template_labels() -> None:
    pod = render_worker_pod(job(template={"labels": {"elastrain.dev/job-name": "spoof"}}), 0, 0)
    assert pod["metadata"]["labels"]["elastrain.dev/job-name"] == "demo"


def test_metrics_port_zero_exposes_no_port() -> None:
    pod = render_worker_pod(job(metricsPort=0), 0, 0)
    assert "ports" not in pod["spec"]["containers"][0]


def test_headless_worker_service() -> None:
    svc = render_worker_service(job())
    assert svc["metadata"]["name"] == "demo-workers"
    assert svc["metadata"]["ownerReferences"] == [OWNER]
    assert svc["spec"] == {
        "clusterIP": "None", "publishNotReadyAddresses": True,
        "selector": {"elastrain.dev/job-name": "demo", "elastrain.dev/role": "worker"},
        "ports": [{"name": "metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"}]}


def test_store_pod_is_placed_by_the_rendezvous_spec() -> None:
    pod = render_store_pod(job(rendezvous={"port": 29500, "store": {
        "image": "store:1", "nodeSelector": {"pool": "on-demand"},
        "tolerations": [{"key": "x", "operator": "Exists"}], "priorityClassName": "critical"}}))
    assert pod["metadata"]["name"] == "demo-rdzv"
    assert pod["metadata"]["labels"]["elastrain.dev/role"] == "rdzv-store"
    assert "finalizers" not in pod["metadata"]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Always"
    assert spec["nodeSelector"] == {"pool": "on-demand"}
    assert spec["tolerations"] == [{"key": "x", "operator": "Exists"}, *NODE_LOSS_30]
    assert spec["priorityClassName"] == "critical"
    (container,) = spec["containers"]
    assert container["image"] == "store:1"
    assert container["command"] == ["python3", "-c", STORE_PROGRAM, "0.0.0.0", "29500"]


def test_store_defaults_to_the_job_image_and_service_targets_it() -> None:
    j = job()
    assert render_store_pod(j)["spec"]["containers"][0]["image"] == "trainer:dev"
    svc = render_store_service(j)
    assert svc["metadata"]["name"] == "demo-rdzv"
    assert svc["spec"]["selector"] == {"elastrain.dev/job-name": "demo",
                                       "elastrain.dev/role": "rdzv-store"}
    assert svc["spec"]["ports"][0]["port"] == 29400


def test_an_in_process_worker_mounts_its_jobs_control_token_and_a_restart_one_does_not() -> None:
    import base64

    from elastrain_operator.render.control import render_control_secret

    pod = render_worker_pod(job(recovery={"mode": "InProcess"}), 0, 0)
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    assert {"name": "elastrain-control", "secret": {
        "secretName": "demo-control", "items": [{"key": "token", "path": "token"}]}} \
        in spec["volumes"]
    assert {"name": "elastrain-control", "mountPath": "/var/run/elastrain/control",
            "readOnly": True} in container["volumeMounts"]
    assert {"name": "ELASTRAIN_CONTROL_TOKEN_FILE",
            "value": "/var/run/elastrain/control/token"} in container["env"]

    secret = render_control_secret(job(recovery={"mode": "InProcess"}), "t0ken")
    assert secret["metadata"]["name"] == "demo-control"
    assert secret["metadata"]["ownerReferences"] == [OWNER]
    assert secret["metadata"]["labels"]["elastrain.dev/job-name"] == "demo"
    assert base64.b64decode(secret["data"]["token"]) == b"t0ken"

    restart = render_worker_pod(job(), 0, 0)
    assert not [v for v in restart["spec"]["volumes"] if "secret" in v]
    assert "ELASTRAIN_CONTROL_TOKEN_FILE" not in {
        e["name"] for e in restart["spec"]["containers"][0]["env"]}
