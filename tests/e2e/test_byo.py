"""Your own script on real pods: examples/byo/job.yaml (command: the launcher and train.py, the
script mounted from a ConfigMap into the trainer image's working directory) survives the eviction
of a worker with 0 steps lost, counted as a preemption, and succeeds with its final checkpoint
reported by the operator from the session's /progress."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

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


def byo_job(node: NodeCluster, ns: str, mode: str, name: str) -> dict[str, Any]:
    """The example as written, but for this one-node cluster: its images and its MinIO."""
    job: dict[str, Any] = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    job["metadata"].update(namespace=ns, name=name)
    s = job["spec"]
    s.update(image=node.images["trainer"], terminationGracePeriodSeconds=60)
    s["trainer"]["steps"] = STEPS
    s["env"] = [{"name": "ELASTRAIN_STEP_SLEEP_SECONDS", "value": "0.25"},
                {"name": "BYO_LOG_SAMPLES", "value": "1"}]
    s["checkpoint"].update(uri=f"s3://{node.s3.bucket}/{ns}/{name}",
                           endpoint=node.s3.endpoint_url, intervalSteps=20)
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


def test_byo_script_resumes_an_eviction_with_no_step_lost(operator: NodeCluster,
                                                          job_namespace: str) -> None:
    """One job per recovery mode, side by side (the same example, two names). Restart: every
    worker resumes from the evicted one's SIGTERM checkpoint. InProcess: the same script,
    unchanged, trains on at world 1 in the survivor's process and the replacement joins with
    the survivor's state."""
    node, ns, k = operator, job_namespace, operator.kubectl
    k("create", "configmap", "byo-train-py", "-n", ns,
      "--from-file", f"train.py={EXAMPLE / 'train.py'}")
    names = {mode: f"byo-{key}" for key, mode in RECOVERY_MODES.items()}
    selectors = {mode: f"elastrain.dev/job-name={name},elastrain.dev/role=worker"
                 for mode, name in names.items()}
    with contextlib.ExitStack() as stack:
        logs = {mode: stack.enter_context(LogCollector(k, ns, selectors[mode],
                                                       ARTIFACTS / names[mode]))
                for mode in names}
        for mode, name in names.items():
            k.apply(byo_job(node, ns, mode, name))
        evicted: dict[str, float] = {}
        for mode in names:
            logs[mode].wait_for_step(40, timeout=300)
            pods = k.json("get", "pods", "-n", ns, "-l", selectors[mode])["items"]
            victim = sorted(p["metadata"]["name"] for p in pods)[-1]
            evicted[mode] = evict(k, ns, victim)
        for name in names.values():
            wait_for(f"{name} Succeeded",
                     lambda name=name: job_status(k, ns, name).get("phase") == "Succeeded",
                     timeout=600)
        time.sleep(1)  # the last log lines
        for mode, at in evicted.items():
            if mode == RESTART:
                assert steps_lost_at(logs[mode], at) == 0
            else:
                assert steps_retrained(logs[mode], at) == 0
                regroups = [(r["reason"], r["world_size"]) for r in logs[mode].events("regroup")
                            if float(r["time"]) > at]
                assert ("leave", 1) in regroups and ("join", 2) in regroups, regroups
                assert not [r for r in logs[mode].events("resumed") if float(r["time"]) > at]
            assert_every_sample_once_per_epoch(logs[mode].events("samples"))
    for name in names.values():
        status = job_status(k, ns, name)
        assert status.get("preemptions") == 1 and status.get("restarts", 0) == 0, status
        assert status["lastCheckpoint"]["step"] == STEPS, status
