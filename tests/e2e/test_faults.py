"""Faults that leave no pod exiting on its own, told on a real kubelet (issue 9, items 1 and 3),
in each recovery mode.

- A trainer that raises at step N: its torchrun agent (elastrain_trainer.launch) ends the pod
  with the exception in the termination message; each crash spends restartPolicy.maxRestarts,
  and the job fails quoting it. Without the launcher the pod would restart in place forever.
- A trainer that blocks inside a step (ELASTRAIN_FAULT_HANG_AT_STEP): the operator's progress
  watchdog sees no step for spec.hangTimeoutSeconds, says Hung, and restarts the workers as one
  counted failure; before that, steps slower than nothing but well inside the timeout never
  trip it, and once the resumed group trains again Hung turns False.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import NodeCluster
from tests.e2e.support import (
    RECOVERY_MODES,
    RESTART,
    event_reasons,
    job_status,
    make_job,
    recovery_spec,
    wait_for,
)


def _arm_faults(k: Any, job: dict[str, Any], **knobs: str) -> None:
    """Fault injection the one way the trainer honours (elastrain_trainer.fault_injection): a
    file, here from a ConfigMap mounted into the worker pods; hang_at_step="10" ->
    ELASTRAIN_FAULT_HANG_AT_STEP=10."""
    name, ns, folder = f"{job['metadata']['name']}-faults", job["metadata"]["namespace"], \
        "/etc/elastrain-faults"
    text = "".join(f"ELASTRAIN_FAULT_{key.upper()}={value}\n" for key, value in knobs.items())
    k.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns},
             "data": {"faults.env": text}})
    template = job["spec"].setdefault("template", {})
    template.setdefault("volumes", []).append({"name": "faults", "configMap": {"name": name}})
    template.setdefault("volumeMounts", []).append(
        {"name": "faults", "mountPath": folder, "readOnly": True})
    job["spec"]["env"].append({"name": "ELASTRAIN_FAULT_INJECTION_FILE",
                               "value": f"{folder}/faults.env"})


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def _phase(k: Any, ns: str, name: str, phase: str) -> dict[str, Any] | None:
    status = job_status(k, ns, name)
    return status if status.get("phase") == phase else None


def _hung(k: Any, ns: str, name: str, value: str) -> dict[str, Any] | None:
    cond = _condition(job_status(k, ns, name), "Hung")
    return cond if cond.get("status") == value else None


@pytest.mark.parametrize("mode", list(RECOVERY_MODES.values()), ids=list(RECOVERY_MODES))
def test_a_crashing_trainer_spends_the_budget_and_the_job_fails_with_its_exception(
        operator: NodeCluster, job_namespace: str, mode: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    job = make_job("crashy", ns, image=node.images["trainer"], s3_endpoint=node.s3.endpoint_url,
                   bucket=node.s3.bucket, steps=200, replicas=2, interval_steps=4,
                   step_sleep=0.1, **recovery_spec(mode))
    # minReplicas 2 (make_job's): the survivor waits for the crashed rank's replacement, so the
    # group resumes at world 2 and a rank 1 trains step 6 again. With 1, the survivor went on
    # alone (no rank 1), passed step 6 before the replacement joined, and the job succeeded
    # after one crash (seen once in CI).
    _arm_faults(k, job, crash_at_step="6", crash_rank="1")
    # Restart mode: the crash fires after step 6 commits, the group resumes from the step-4
    # checkpoint and trains step 6 again, so it crashes again: two failures spend a budget of
    # 1. InProcess: the survivor, alone below min, saves the step it holds (6) by itself, so
    # step 6 is never trained again and the crash does not recur (no work is redone): a
    # budget of 0 is spent by the one crash.
    budget = 1 if mode == RESTART else 0
    crashes_expected = budget + 1
    job["spec"]["restartPolicy"] = {"maxRestarts": budget, "backoffSeconds": 1}
    k.apply(job)
    status = wait_for("the job Failed", lambda: _phase(k, ns, "crashy", "Failed"), timeout=420)
    failed = _condition(status, "Failed")
    assert failed.get("reason") == "MaxRestartsExceeded", status
    assert (f"{crashes_expected} worker failures exceed spec.restartPolicy.maxRestarts "
            f"({budget})") in failed["message"]
    assert "InjectedCrash: injected crash at step 6 on rank 1" in failed["message"]
    # The survivors restarted in place: only the crashed ranks' pods were counted.
    assert status["restarts"] == crashes_expected and status.get("preemptions", 0) == 0, status
    assert [x["kind"] for x in status["recentLosses"]] == ["Failed"] * crashes_expected
    assert all("InjectedCrash" in x["reason"] for x in status["recentLosses"])
    # Events are posted after the status write that counted the loss: the one of the round
    # that failed the job may land a moment after the test saw Failed.

    def crash_events() -> list[dict[str, Any]] | None:
        events = k.json("get", "events", "-n", ns, "--field-selector",
                        "involvedObject.name=crashy,reason=WorkerFailed")["items"]
        found = [e for e in events if "InjectedCrash: injected crash at step 6" in e["message"]]
        return found if len(found) >= crashes_expected else None

    crashes = wait_for("a WorkerFailed event per crash", crash_events, timeout=30)
    assert len(crashes) == crashes_expected, [e["message"] for e in crashes]


@pytest.mark.parametrize("mode", list(RECOVERY_MODES.values()), ids=list(RECOVERY_MODES))
def test_a_hung_trainer_is_told_and_restarted_and_slow_steps_are_not(
        operator: NodeCluster, job_namespace: str, mode: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    timeout = 30
    # ~4.5 s per step for 10 steps: 45 s of slow progress, longer than the timeout in all.
    job = make_job("stuck", ns, image=node.images["trainer"], s3_endpoint=node.s3.endpoint_url,
                   bucket=node.s3.bucket, steps=400, replicas=2, interval_steps=4,
                   step_sleep=4.5, hangTimeoutSeconds=timeout, **recovery_spec(mode))
    _arm_faults(k, job, hang_at_step="10")
    job["spec"]["restartPolicy"] = {"maxRestarts": 3, "backoffSeconds": 1}
    k.apply(job)
    wait_for("step 9 reported", lambda: (job_status(k, ns, "stuck").get("progress") or {})
             .get("step", 0) >= 9, timeout=300)
    status = job_status(k, ns, "stuck")
    assert status.get("restarts", 0) == 0 and not _condition(status, "Hung"), status
    hung = wait_for("Hung", lambda: _hung(k, ns, "stuck", "True"), timeout=timeout + 90)
    assert hung["reason"] == "NoTrainingProgress"
    assert f"(spec.hangTimeoutSeconds={timeout})" in hung["message"]
    status = job_status(k, ns, "stuck")
    assert status["restarts"] == 1 and status.get("preemptions", 0) == 0, status
    assert status["recentLosses"][-1]["reason"].startswith("hung: no training step")
    assert "NoTrainingProgress" in event_reasons(k, ns, "stuck")
    # The replacements resume (from step 8) and train on: Hung turns False.
    cleared = wait_for("Hung=False", lambda: _hung(k, ns, "stuck", "False"), timeout=300)
    assert cleared["reason"] == "TrainingProgressing"
    status = job_status(k, ns, "stuck")
    assert status["restarts"] == 1 and status.get("preemptions", 0) == 0, status
    assert status["progress"]["resumedFromStep"] >= 8
    assert "TrainingProgressing" in event_reasons(k, ns, "stuck")
