"""The lines the trainer's launcher ends a pod with are the ones the operator reads.

The two packages never import each other; each keeps its own copy of the prefixes, so a line
changed on one side only fails here.
"""

from __future__ import annotations

from elastrain_operator.policy import failures
from elastrain_operator.policy.failures import WorkerPod, crash_reason, finish_warning
from elastrain_trainer import faults
from elastrain_trainer.launch.agent import finished_world_warning

CRASH = faults.crash_reason(-6, "", 0)


def test_both_sides_spell_the_prefixes_alike() -> None:
    assert (failures.CRASH_PREFIX, failures.CONFIG_PREFIX, failures.WARNING_PREFIX) == (
        faults.CRASH_PREFIX, faults.CONFIG_PREFIX, faults.WARNING_PREFIX)


def test_a_crash_after_the_world_finished_is_read_as_a_warning_not_a_crash() -> None:
    line = finished_world_warning(CRASH, 3)
    pod = WorkerPod(name="w-0", index=0, attempt=0, phase="Succeeded", exit_code=0,
                    exit_message=line + "\n")
    said = finish_warning(pod)
    assert said.startswith("worker crashed: rank 0, killed by SIGABRT") and "all 3 nodes" in said
    assert crash_reason(pod.exit_message) == ""  # never counted as the job's crash
