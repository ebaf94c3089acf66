"""Your own script on real pods: examples/byo/job.yaml (command: the launcher and train.py, the
script mounted from a ConfigMap into the trainer image's working directory) survives the eviction
of a worker with 0 steps lost, counted as a preemption, and succeeds with its final checkpoint
reported by the operator from the session's /progress."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    RECOVERY_MODES,
    RESTART,
    LogCollector,
    evict,
    job_status,
    recovery_spec,
    steps_lost_at,
    steps_retrained,
    wait_for,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "byo"
STEPS = 200


def byo_job(node: NodeCluster, ns: str, mode: str) -> dict[str, Any]:
    """The example as written, but for this one-node cluster: its images and its MinIO."""
    job: dict[str, Any] = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    job["metadata"]["namespace"] = ns
    s = job["spec"]
    s.update(image=node.images["trainer"], terminationGracePeriodSeconds=60)
    s["trainer"]["steps"] = STEPS
    s["env"] = [{"name": "ELASTRAIN_STEP_SLEEP_SECONDS", "value": "0.25"},
                {"name": "BYO_LOG_SAMPLES", "value": "1"}]
    s["checkpoint"].update(uri=f"s3://{node.s3.bucket}/{ns}/byo", endpoint=node.s3.endpoint_url,
                           intervalSteps=20)
    s["template"]["imagePullPolicy"] = "Never"
    s["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"memory": "1536Mi"}}
    s.update(recovery_spec(mode))
    return job


def assert_every_sample_once_per_epoch(records: list[dict[str, Any]]) -> None:
    """Every step was trained by each rank of its world once and read one global batch, and the
    samples trained cover each epoch once: every whole epoch exactly, the last one in part (the
    loader has 2 workers; InProcess went from world 2 to 1 and back in the same processes)."""
    per_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        per_step.setdefault(int(r["step"]), []).append(r)
    assert sorted(per_step) == list(range(STEPS)), sorted(set(range(STEPS)) - set(per_step))
    per_epoch: dict[int, list[int]] = {}
    for step, rs in per_step.items():
        world = {int(r["world_size"]) for r in rs}
        assert len(world) == 1 and sorted(r["rank"] for r in rs) == list(range(world.pop())), (
            step, rs)
        indices = [i for r in rs for i in r["indices"]]
        assert len(indices) == 64, (step, len(indices))
        per_epoch.setdefault(int(rs[0]["epoch"]), []).extend(indices)
    for epoch, indices in sorted(per_epoch.items()):
        assert len(indices) == len(set(indices)), f"epoch {epoch}: a sample trained twice"
        if epoch < max(per_epoch):
            assert sorted(indices) == list(range(4096)), f"epoch {epoch}: samples skipped"


@pytest.mark.parametrize("mode", list(RECOVERY_MODES.values()), ids=list(RECOVERY_MODES))
def test_byo_script_resumes_an_eviction_with_no_step_lost(operator: NodeCluster,
                                                          job_namespace: str, mode: str) -> None:
    """Restart: every worker resumes from the evicted one's SIGTERM checkpoint. InProcess: the
    same script, unchanged, trains on at world 1 in the survivor's process and the replacement
    joins with the survivor's state."""
    node, ns, k = operator, job_namespace, operator.kubectl
    k("create", "configmap", "byo-train-py", "-n", ns,
      "--from-file", f"train.py={EXAMPLE / 'train.py'}")
    selector = "elastrain.dev/job-name=byo,elastrain.dev/role=worker"
    with LogCollector(k, ns, selector, ARTIFACTS / f"byo-{mode.lower()}") as logs:
        k.apply(byo_job(node, ns, mode))
        logs.wait_for_step(40, timeout=300)
        pods = k.json("get", "pods", "-n", ns, "-l", selector)["items"]
        victim = sorted(p["metadata"]["name"] for p in pods)[-1]
        at = evict(k, ns, victim)
        wait_for("Succeeded", lambda: job_status(k, ns, "byo").get("phase") == "Succeeded",
                 timeout=600)
        time.sleep(1)  # the last log lines
        if mode == RESTART:
            assert steps_lost_at(logs, at) == 0
        else:
            assert steps_retrained(logs, at) == 0
            regroups = [(r["reason"], r["world_size"]) for r in logs.events("regroup")
                        if float(r["time"]) > at]
            assert ("leave", 1) in regroups and ("join", 2) in regroups, regroups
            assert not [r for r in logs.events("resumed") if float(r["time"]) > at]
        assert_every_sample_once_per_epoch(logs.events("samples"))
    status = job_status(k, ns, "byo")
    assert status.get("preemptions") == 1 and status.get("restarts", 0) == 0, status
    assert status["lastCheckpoint"]["step"] == STEPS, status
