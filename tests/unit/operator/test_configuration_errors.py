"""A worker's configuration error fails the job at once (issue 18 item 2): the launcher's
`elastrain: configuration error: <message>` line, or a command the runtime cannot find, is not
counted against maxRestarts, gets no backoff and no replacement; a crash keeps its budget."""

from __future__ import annotations

from typing import Any

from elastrain_operator.model.names import WORKER_FINALIZER
from elastrain_operator.policy.failures import configuration_error, describe_exit, read_worker_pod
from tests.unit.operator.test_failures import make_pod
from tests.unit.operator.test_planning import T0, started

UNREADABLE = ("elastrain: configuration error: file:///data/train.bin: not an llm.c token "
              "file (magic 0x0 != 20240520)")


def config_error_of(**kw: Any) -> str:
    pod = read_worker_pod(make_pod(**kw), WORKER_FINALIZER)
    assert pod is not None
    return configuration_error(pod)


def test_the_launchers_line_and_a_missing_command_are_configuration_errors() -> None:
    tail = f"[rank0] Traceback ...\n{UNREADABLE}\n"
    assert config_error_of(phase="Failed", exit_code=78, message=tail) == (
        "file:///data/train.bin: not an llm.c token file (magic 0x0 != 20240520)")
    missing = ('failed to create containerd task: exec: "trainx": executable file not found '
               'in $PATH: unknown')
    assert "executable file not found" in config_error_of(
        phase="Failed", exit_code=128, exit_reason="StartError", message=missing)


def test_crashes_and_other_start_failures_are_not() -> None:
    crash = "elastrain: worker crashed: rank 0, exit code 1: KeyError: 'tokens'"
    assert config_error_of(phase="Failed", exit_code=1, message=crash) == ""
    assert config_error_of(phase="Failed", exit_code=128, exit_reason="StartError",
                           message="failed to mount volume: device busy") == ""
    assert config_error_of(phase="Running") == ""
    pod = read_worker_pod(make_pod(phase="Failed", exit_code=78, message=UNREADABLE),
                          WORKER_FINALIZER)
    assert pod is not None and "configuration error: file:///data/train.bin" in describe_exit(pod)


def test_a_configuration_error_fails_the_job_at_once_with_the_message() -> None:
    w = started(restartPolicy={"maxRestarts": 3, "backoffSeconds": 10})
    w.set_pod("demo-worker-0-0", "Failed", exit_code=78, message=UNREADABLE)
    plan = w.reconcile(T0)
    assert w.status["phase"] == "Failed" and w.status["restarts"] == 0
    failed = w.condition("Failed")
    assert failed["status"] == "True" and failed["reason"] == "ConfigurationError"
    assert "not an llm.c token file" in failed["message"]
    assert not plan.create, "nothing is replaced"
    assert w.status.get("restartBackoffUntil") is None
    events = {e.reason: e.message for e in plan.events}
    assert "not an llm.c token file" in events["ConfigurationError"]


def test_a_crash_still_restarts_after_backoff() -> None:
    w = started(restartPolicy={"maxRestarts": 3, "backoffSeconds": 10})
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1,
              message="elastrain: worker crashed: rank 0, exit code 1: KeyError: 'tokens'")
    w.reconcile(T0)
    assert w.status["phase"] != "Failed" and w.status["restarts"] == 1
    assert w.status.get("restartBackoffUntil")
