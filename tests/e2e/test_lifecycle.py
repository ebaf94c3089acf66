"""Scenarios 9 and 10 of the e2e suite, and the images' security settings on a real kubelet.

9. A job runs to Succeeded, in each recovery mode: its final checkpoint is committed in MinIO,
   `kubectl get tj` shows real values in every column, and the operator's and the trainers'
   /metrics are scraped from their pods (the host reaches pod IPs on the bridge, as Prometheus
   would in a cluster).
10. A stock `torchrun train.py` (command override; the script imports no elastrain code) runs
    under the operator with the PET_* contract alone.
"""

from __future__ import annotations

import time
from typing import Any

import boto3
import pytest

from tests.e2e.conftest import OPERATOR_NAMESPACE, NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    RECOVERY_MODES,
    RESTART,
    LogCollector,
    job_status,
    make_job,
    recovery_spec,
    scrape,
    wait_for,
)


def _pods(node: NodeCluster, ns: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = node.kubectl.json("get", "pods", "-n", ns, "-l",
                                                    selector)["items"]
    return items


def _running_ips(node: NodeCluster, ns: str, selector: str) -> list[str]:
    return [p["status"]["podIP"] for p in _pods(node, ns, selector)
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")]


@pytest.mark.parametrize("mode", list(RECOVERY_MODES.values()), ids=list(RECOVERY_MODES))
def test_9_job_succeeds_with_a_committed_checkpoint_columns_and_metrics(
        operator: NodeCluster, job_namespace: str, mode: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    steps = 60
    k.apply(make_job("finish", ns, image=node.images["trainer"], steps=steps, step_sleep=0.3,
                     s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket,
                     **recovery_spec(mode)))
    workers = "elastrain.dev/job-name=finish,elastrain.dev/role=worker"
    with LogCollector(k, ns, workers, ARTIFACTS / f"finish-{mode.lower()}") as logs:
        logs.wait_for_step(5, timeout=240)
        # Every worker's local rank 0 serves /metrics on the metrics port.
        ips = wait_for("3 running workers", lambda: (ips := _running_ips(node, ns, workers))
                       and len(ips) == 3 and ips)
        for ip in ips:
            samples = scrape(f"http://{ip}:9400/metrics")
            assert samples["elastrain_trainer_steps_total"] >= 1, ip
            assert samples["elastrain_trainer_world_size"] == 3, ip
        (op_ip,) = _running_ips(node, OPERATOR_NAMESPACE, "app.kubernetes.io/name=elastrain")
        operator_samples = scrape(f"http://{op_ip}:9090/metrics")
        wait_for("Succeeded", lambda: job_status(k, ns, "finish").get("phase") == "Succeeded",
                 timeout=400)
    status = job_status(k, ns, "finish")
    assert status["progress"]["step"] == steps
    assert status["lastCheckpoint"]["step"] == steps
    assert (status["restarts"], status["preemptions"]) == (0, 0)
    assert status["recoveryMode"] == mode  # InProcess: the mode unset, what it picks
    assert any(key.startswith("elastrain_operator_workers_created_total")
               and value >= 3 for key, value in operator_samples.items())
    assert logs.events("finished"), "no trainer reported finishing"
    if mode == INPROCESS:  # one generation of 3 from the start to the end, in process
        gens = {(r["gen"], r["world_size"]) for r in logs.events("regroup")}
        assert gens == {(1, 3)}, gens

    s3 = boto3.client("s3", **node.s3.client_kwargs)
    prefix = f"{ns}/finish/"
    latest = s3.get_object(Bucket=node.s3.bucket, Key=prefix + "latest")["Body"].read().decode()
    assert latest.strip() == f"step-{steps:08d}"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=node.s3.bucket,
                                                 Prefix=prefix + latest.strip())["Contents"]}
    assert prefix + latest.strip() + "/COMMITTED" in keys

    wide = k("get", "tj", "finish", "-n", ns, "-o", "wide").stdout.splitlines()
    print("\n".join(wide))
    row = wide[1].split()
    assert "<none>" not in row, wide
    # NAME PHASE WORKERS STEP LAST-CHECKPOINT RESTARTS PREEMPTIONS FAILED-SAVES AGE STRATEGY
    # RECOVERY MIN MAX LOSS ...
    assert row[1] == "Succeeded" and row[3] == str(steps) and row[4] == str(steps), wide
    assert row[5:8] == ["0", "0", "0"] and row[9:13] == ["ddp", mode, "2", "3"], wide
    float(row[13])  # the last loss


TRAIN_PY = '''\
"""A plain torchrun DDP script: no elastrain import, only the PET_* contract torchrun reads."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 31):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.1)
restarts = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"stock-script-done rank={rank} world={world} restart={restarts}", flush=True)
dist.destroy_process_group()
'''


def test_10_stock_torchrun_script_runs_with_the_pet_contract(
        operator: NodeCluster, job_namespace: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    k("create", "configmap", "train-py", "-n", ns, "--from-literal", f"train.py={TRAIN_PY}")
    # hack/images' `torch` image: python3, torch and torchrun, no elastrain code at all (the
    # rendezvous store pod runs in it too).
    job = make_job("stock", ns, image=node.images["torch"], s3_endpoint=node.s3.endpoint_url,
                   bucket=node.s3.bucket, replicas=2)
    spec = job["spec"]
    del spec["checkpoint"], spec["trainer"]
    spec["command"] = ["torchrun", "/scripts/train.py"]
    spec["template"]["volumes"] = [{"name": "scripts", "configMap": {"name": "train-py"}}]
    spec["template"]["volumeMounts"] = [{"name": "scripts", "mountPath": "/scripts"}]
    k.apply(job)
    started = time.monotonic()
    wait_for("Succeeded", lambda: job_status(k, ns, "stock").get("phase") == "Succeeded",
             timeout=300)
    print(f"stock torchrun job succeeded in {time.monotonic() - started:.0f} s")
    # The mode is unset: a stock script cannot regroup in process, so the default is Restart.
    assert job_status(k, ns, "stock")["recoveryMode"] == RESTART
    selector = "elastrain.dev/job-name=stock,elastrain.dev/role=worker"
    outputs = [k("logs", "-n", ns, p["metadata"]["name"], "-c", "trainer").stdout
               for p in _pods(node, ns, selector)]
    done = sorted(line.split("stock-script-done ", 1)[1] for out in outputs
                  for line in out.splitlines() if "stock-script-done " in line)
    assert done == ["rank=0 world=2 restart=0", "rank=1 world=2 restart=0"], outputs


def test_images_run_as_the_non_root_user_on_a_read_only_root(operator: NodeCluster) -> None:
    """The chart's restricted pod security context, enforced by a real kubelet and runc."""
    k = operator.kubectl
    (pod,) = [p["metadata"]["name"] for p in _pods(operator, OPERATOR_NAMESPACE,
                                                   "app.kubernetes.io/name=elastrain")]
    assert k("exec", "-n", OPERATOR_NAMESPACE, pod, "--", "id", "-u").stdout.strip() == "65532"
    denied = k("exec", "-n", OPERATOR_NAMESPACE, pod, "--", "touch", "/opt/venv/x", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied
    assert k("exec", "-n", OPERATOR_NAMESPACE, pod, "--", "touch", "/tmp/x").returncode == 0
