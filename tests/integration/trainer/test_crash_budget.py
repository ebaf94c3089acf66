"""The crash budget on real torchrun agents: a worker's own crash is counted, a lost peer or
store is not (elastrain_trainer.launch: agent, supervise; elastrain_trainer.faults).

The agents run the launcher the operator gives worker pods; supervise.Supervisor applies
spec.restartPolicy the way the operator does for pods (see tests/integration/operator for the
operator's side of the same contract).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from elastrain_trainer.faults import CRASH_PREFIX
from elastrain_trainer.launch.cluster import LocalCluster
from elastrain_trainer.launch.supervise import Outcome, RestartBudget, Supervisor

from .conftest import trainer_env

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(400)]
RUN_TIMEOUT = 300.0


def supervise(tmp: Path, env: dict[str, str], workers: int, budget: RestartBudget,  # type: ignore[no-untyped-def]
              script=None, min_nodes: int = 1) -> tuple[LocalCluster, Outcome]:
    cluster = LocalCluster(env, min_nodes, 3, tmp / "logs", job_id=tmp.name,
                           on_record=lambda agent, r: None)
    failures: list[BaseException] = []

    def act() -> None:
        try:
            script(cluster)
        except BaseException as e:
            failures.append(e)

    try:
        cluster.start(workers)
        # The script acts while the supervisor replaces crashed agents, as the operator would.
        actor = threading.Thread(target=act, daemon=True)
        if script is not None:
            actor.start()
        outcome = Supervisor(cluster, budget).run(timeout=RUN_TIMEOUT)
        if script is not None:
            actor.join(timeout=5)
    finally:
        cluster.stop()
    if failures:
        raise failures[0]
    return cluster, outcome


def faults(tmp: Path, **knobs: str) -> dict[str, str]:
    """Arm fault injection the one way the trainer honours: a file the harness writes
    (elastrain_trainer.fault_injection); crash_at_step="10" -> ELASTRAIN_FAULT_CRASH_AT_STEP=10."""
    path = tmp / "faults.env"
    path.write_text("".join(f"ELASTRAIN_FAULT_{k.upper()}={v}\n" for k, v in knobs.items()))
    return {"ELASTRAIN_FAULT_INJECTION_FILE": str(path)}


def events(cluster: LocalCluster, kind: str) -> list[dict]:  # type: ignore[type-arg]
    return [r for _, r in cluster.records if r["event"] == kind]


def test_a_crash_at_step_n_spends_the_budget_then_fails_with_its_message(tmp_path: Path) -> None:
    # Synchronous saves: steps 4 and 8 are committed before the crash at step 10, so every
    # attempt after the first resumes. With async uploads on a loaded machine step 4's was once
    # still in flight at the crash (checkpoint_deferred at step 8), the second attempt started
    # fresh and the test counted one resume where it expects two.
    env = trainer_env(tmp_path, STEPS="40", CHECKPOINT_INTERVAL_STEPS="4", CHECKPOINT_ASYNC="0",
                      **faults(tmp_path, crash_at_step="10", crash_rank="1"))
    # A minimum of 2: every attempt waits for the crashed rank's replacement. At 1 the survivor
    # could regroup alone before it came, train past step 10 as rank 0 and resume the next
    # world of 2 beyond the crash (seen once in a full run: 2 crashes, then a finished job).
    cluster, outcome = supervise(tmp_path, env, 2, RestartBudget(max_restarts=2), min_nodes=2)
    # Exactly maxRestarts + 1 attempts crashed, each with the trainer's own exception.
    assert outcome.restarts == 3 and len(outcome.crashes) == 3, outcome
    assert all(c.startswith(f"{CRASH_PREFIX}rank 1, exit code 1: InjectedCrash: injected crash "
                            "at step 10") for c in outcome.crashes), outcome.crashes
    assert outcome.failed is not None and "exceed restartPolicy.maxRestarts (2)" in outcome.failed
    assert "InjectedCrash" in outcome.failed
    # The survivor restarted in place each time (uncounted) and never trained past the crash.
    assert max(r["step"] for r in events(cluster, "step")) == 10
    assert len(events(cluster, "resumed")) >= 2  # after each crash but the last
    assert outcome.store_losses == 0


def test_a_counted_crash_is_replaced_and_lost_peers_do_not_count(tmp_path: Path) -> None:
    """One crash (counted once), then a peer SIGTERMed and another SIGKILLed (not counted):
    the replacement after the crash joins the same rendezvous and training finishes."""
    env = trainer_env(tmp_path, STEPS="36", CHECKPOINT_INTERVAL_STEPS="4",
                      GLOBAL_BATCH_SIZE="12",
                      STEP_SLEEP_SECONDS="0.15",
                      **faults(tmp_path, crash_at_step="8", crash_rank="2",
                               crash_once=str(tmp_path / "crashed")))

    def script(cluster: LocalCluster) -> None:
        assert cluster.wait_for(lambda rs: any(r["event"] == "step" and r["step"] >= 16
                                               and r["world_size"] == 3 for _, r in rs), 200)
        live = [a for a in cluster.agents if a.proc.poll() is None]
        cluster.preempt(live[0])
        cluster.add_agent()
        assert cluster.wait_for(lambda rs: any(r["event"] == "step" and r["step"] >= 24
                                               and r["world_size"] == 3 for _, r in rs), 200)
        live = [a for a in cluster.agents if a.proc.poll() is None]
        cluster.kill(live[-1])
        cluster.add_agent()

    cluster, outcome = supervise(tmp_path, env, 3, RestartBudget(max_restarts=1), script)
    assert outcome.failed is None, outcome
    assert outcome.restarts == 1 and len(outcome.crashes) == 1, outcome
    assert "InjectedCrash" in outcome.crashes[0]
    assert max(r["step"] for r in events(cluster, "step")) == 36
    finished = events(cluster, "finished")
    assert finished and finished[-1]["step"] == 36
    # The replacement that followed the crash trained at full size again before the SIGTERM.
    crash_time = (tmp_path / "crashed").stat().st_mtime
    assert any(r["world_size"] == 3 and r["time"] > crash_time for r in events(cluster, "step"))


def test_killing_the_store_restarts_it_and_counts_no_failure(tmp_path: Path) -> None:
    env = trainer_env(tmp_path, STEPS="40", CHECKPOINT_INTERVAL_STEPS="4",
                      STEP_SLEEP_SECONDS="0.15")
    killed_at: list[float] = []

    def script(cluster: LocalCluster) -> None:
        assert cluster.wait_for_step(12, timeout=200)
        store = cluster.store
        assert store is not None
        killed_at.append(time.time())
        store.kill()

    cluster, outcome = supervise(tmp_path, env, 2, RestartBudget(max_restarts=0), script)
    assert outcome.failed is None and outcome.restarts == 0, outcome
    assert outcome.store_losses == 2, outcome  # both agents lost it; both were replaced
    steps = events(cluster, "step")
    before = [r["step"] for r in steps if r["time"] <= killed_at[0]][-1]
    resumed = [r for r in events(cluster, "resumed") if r["time"] > killed_at[0]]
    assert resumed, "training did not resume after the store came back"
    # The agents' SIGTERM made the workers save the step they were at: nothing is lost.
    assert resumed[0]["step"] >= before
    assert max(r["step"] for r in steps) == 40


def test_run_local_applies_the_specs_restart_policy(tmp_path: Path) -> None:
    job = {
        "apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "crashy"},
        "spec": {"image": "unused", "replicas": 1,
                 "trainer": {"model": "gpt-tiny", "steps": 20, "seqLen": 32,
                             "globalBatchSize": 4, "microBatchSize": 2},
                 "env": [{"name": k, "value": v}
                         for k, v in faults(tmp_path, crash_at_step="3").items()],
                 "restartPolicy": {"maxRestarts": 1, "backoffSeconds": 1}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = subprocess.run(
        [sys.executable, "-m", "elastrain_cli", "run", str(path), "--local", "--fresh",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restart 1/1, replacement in 1 s" in proc.stdout, proc.stdout[-3000:]
    assert ("elastrain: Failed (MaxRestartsExceeded): 2 worker failures exceed "
            "restartPolicy.maxRestarts (1)") in proc.stdout
    assert "InjectedCrash: injected crash at step 3" in proc.stdout
