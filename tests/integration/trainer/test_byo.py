"""Your own script under `elastrain run JOB.yaml --local`: examples/byo (train.py on the
elastrain_trainer.api session, job.yaml with `command:`) survives a simulated preemption with 0
steps lost and ends bit-identical to an uninterrupted run; a stock torchrun script that imports
nothing of elastrain runs too (the PET_* contract only). Real torchrun agents and store, as
`elastrain run --local` starts them; the job file is the example's, with fewer steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrain_cli import commands
from elastrain_trainer.events import parse_line
from elastrain_trainer.launch.cluster import LocalCluster
from elastrain_trainer.launch.local import worker_entry
from elastrain_trainer.summary import summarize

from .conftest import load_checkpoint, preempt_second_agent_at
from .test_elastic import assert_identical

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(300)]
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "byo"
STEPS = 60


def example_job(tmp: Path) -> Path:
    """The example beside a copy of its script, shortened to STEPS steps, saving every 10, and
    never at world 1: its rendezvous waits for the replacement (below)."""
    shutil.copy(EXAMPLE / "train.py", tmp / "train.py")
    text = (EXAMPLE / "job.yaml").read_text()
    # minReplicas 2: after the notice's save the survivor's torchrun agent re-rendezvouses, and
    # with the example's minimum of 1 a round closes 1 s (last_call_timeout) after its first
    # node joined, so a replacement whose launcher had not started by then (a loaded machine)
    # made a world of 1 resume, and its arrival a second restart (2 resumes). At 2 the round
    # completes when the replacement is in it, however long it takes to start. The world of 1
    # is test_example_script_resumes_at_a_smaller_world_size's.
    for old, new in (("steps: 300", f"steps: {STEPS}"), ("intervalSteps: 25", "intervalSteps: 10"),
                     ('value: "0.02"', 'value: "0.1"'), ("minReplicas: 1", "minReplicas: 2")):
        assert old in text, old
        text = text.replace(old, new)
    job = tmp / "job.yaml"
    job.write_text(text)
    return job


def run_job(job: Path, out: Path, *, preempt: bool) -> dict[str, Any]:
    # Restart mode, whose resume from the notice's save is compared bit for bit below (the job
    # would run InProcess: tests/integration/cli/test_local_demo.py runs that path).
    code = commands.run_local(job.read_text(), str(job), workers=None, simulate_preemption=preempt,
                              out=str(out), checkpoint_uri=f"file://{out}/ckpt", fresh=True,
                              recovery="Restart")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert code == 0, summary
    return summary


def test_example_script_loses_no_step_to_a_preemption_and_resumes_bit_identically(
        tmp_path: Path) -> None:
    job = example_job(tmp_path)
    reference = run_job(job, tmp_path / "reference", preempt=False)
    assert reference["finished"] and reference["resumes"] == 0, reference
    preempted = run_job(job, tmp_path / "preempted", preempt=True)
    assert preempted["finished"] and preempted["final_step"] == STEPS, preempted
    assert preempted["resumes"] == 1 and preempted["steps_lost"] == 0, preempted
    assert preempted["world_sizes"] == [2], preempted
    # The stopped agent was replaced: three agents, the preempted one did not exit 0.
    assert len(preempted["exit_codes"]) == 3, preempted
    want = load_checkpoint(tmp_path / "reference" / "ckpt", STEPS, tmp_path)
    got = load_checkpoint(tmp_path / "preempted" / "ckpt", STEPS, tmp_path)
    assert set(got) == {"model", "optimizer", "scheduler", "elastrain"}, set(got)
    assert got["elastrain"] == {"step": STEPS}
    for part in ("model", "optimizer", "scheduler"):
        assert_identical(want[part], got[part], part)


def test_example_script_resumes_at_a_smaller_world_size(tmp_path: Path) -> None:
    """A preempted worker that is not replaced: the survivor resumes alone (minReplicas 1)."""
    shutil.copy(EXAMPLE / "train.py", tmp_path / "train.py")
    env = {"ELASTRAIN_STEPS": "40", "ELASTRAIN_CHECKPOINT_URI": f"file://{tmp_path}/ckpt",
           "ELASTRAIN_CHECKPOINT_INTERVAL_STEPS": "10", "ELASTRAIN_METRICS_PORT": "0",
           "ELASTRAIN_STEP_SLEEP_SECONDS": "0.1", "OMP_NUM_THREADS": "1"}
    cluster = LocalCluster(env, 1, 2, tmp_path / "logs", job_id=tmp_path.name,
                           entry=worker_entry(["torchrun", "train.py"]), cwd=tmp_path,
                           on_record=lambda agent, r: None)
    codes = preempt_second_agent_at(cluster, 15)
    summary = summarize([r for _, r in cluster.records])
    assert codes["agent-0"] == 0, codes
    assert summary.finished and summary.final_step == 40, summary
    assert summary.resumes == 1 and summary.steps_lost == 0, summary
    assert summary.world_sizes == [2, 1], summary
    resumed = [r for _, r in cluster.records if r["event"] == "resumed"]
    assert resumed[0]["saved_world_size"] == 2 and resumed[0]["world_size"] == 1, resumed


PLAIN_PY = '''\
"""A stock torchrun DDP script: no elastrain import, only what torchrun's variables say."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"plain-script-done rank={rank} world={world}", flush=True)
dist.destroy_process_group()
'''

PLAIN_JOB = '''\
apiVersion: elastrain.dev/v1alpha1
kind: TrainingJob
metadata:
  name: plain
spec:
  image: elastrain/trainer:dev
  replicas: 2
  minReplicas: 2
  maxReplicas: 2
  command: ["torchrun", "plain.py"]
'''


def run_plain(tmp: Path, script: str) -> Path:
    """PLAIN_JOB with `script` as its plain.py, run to its end; both agents exited 0."""
    (tmp / "plain.py").write_text(script)
    job = tmp / "job.yaml"
    job.write_text(PLAIN_JOB)
    out = tmp / "run"
    summary = run_job(job, out, preempt=False)
    assert summary["exit_codes"] == {"agent-0": 0, "agent-1": 0}, summary
    return out


def test_a_script_that_never_calls_the_api_runs_with_torchruns_variables(tmp_path: Path) -> None:
    out = run_plain(tmp_path, PLAIN_PY)
    done = sorted(line.split("plain-script-done ", 1)[1]
                  for log in out.glob("agent-*.log")
                  for line in log.read_text().splitlines() if "plain-script-done " in line)
    assert done == ["rank=0 world=2", "rank=1 world=2"], done
    assert not (out / "ckpt").exists()  # nothing saved what the script never asked to


ABORTS_AFTER_THE_WORLD_FINISHED_PY = PLAIN_PY.replace(
    "dist.destroy_process_group()\n",
    "dist.destroy_process_group()\n"
    "if rank == 0:  # a C++ abort in teardown, after rank 1 exited 0 (seen in CI once)\n"
    "    import os, time\n"
    "    time.sleep(3)\n"
    "    os.abort()\n")


def test_a_worker_that_aborts_after_every_node_finished_ends_the_run_without_a_restart(
        tmp_path: Path) -> None:
    """Rank 0 dies of SIGABRT after the last collective, once rank 1 exited 0: the world's
    training is complete, so its node ends 0 with a warning instead of a counted crash whose
    replacement could never join (and its peer no longer waits 5 minutes at torchrun's exit
    barrier for it). Seen failing without launch/agent.py's finished-world check: agent-0
    exits 1, agent-2 is started and waits for a world that has ended."""
    out = run_plain(tmp_path, ABORTS_AFTER_THE_WORLD_FINISHED_PY)
    # Rank 0 is whichever agent the rendezvous ranked first, not always agent-0 (seen on
    # agent-1 in a fresh-clone run with warm launchers).
    logs = {log.stem: log.read_text() for log in sorted(out.glob("agent-*.log"))}
    warned = [name for name, log in logs.items()
              if "elastrain: warning: worker crashed: rank 0, killed by SIGABRT" in log]
    assert len(warned) == 1, {name: log[-2000:] for name, log in logs.items()}
    assert "after all 2 nodes finished training" in logs[warned[0]], logs[warned[0]][-2000:]


FINAL_SAVE_FAILS_PY = '''\
import torch

from elastrain_trainer.api import Session, init_distributed, run


class RefusingWrites:
    """The store goes down once training is over: every write fails."""

    def __init__(self, inner):
        self.inner, self.uri = inner, inner.uri

    def write(self, key, data):
        raise OSError("the store went away")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main():
    init_distributed()
    model = torch.nn.Linear(2, 1)
    with Session(model=model, steps=3) as session:
        for _ in session.steps():
            pass
        session.manager.storage = RefusingWrites(session.manager.storage)
    print("after-the-block", flush=True)


run(main)
'''


def test_a_script_whose_final_checkpoint_fails_is_a_crash_not_finished(tmp_path: Path) -> None:
    script = tmp_path / "final.py"
    script.write_text(FINAL_SAVE_FAILS_PY)
    env = {**os.environ, "ELASTRAIN_METRICS_PORT": "0", "OMP_NUM_THREADS": "1",
           "ELASTRAIN_CHECKPOINT_URI": f"file://{tmp_path}/ckpt"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FinalCheckpointError: the final checkpoint (step 3) was not committed" in done.stderr
    events = [r["event"] for r in map(parse_line, done.stdout.splitlines()) if r]
    assert "checkpoint_failed" in events and "finished" not in events, events
    assert "after-the-block" not in done.stdout


HOOKS_PY = '''\
import json, sys

import torch

from elastrain_trainer.api import Session, init_distributed, run


class Position:
    """A loop's own progress: the session advances .step, this object saves it."""

    def __init__(self):
        self.step, self.samples = 0, 0

    def state_dict(self):
        return {"step": self.step, "samples": self.samples}

    def load_state_dict(self, sd):
        self.step, self.samples = int(sd["step"]), int(sd["samples"])


def main():
    init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    position, records = Position(), []
    with Session(model=model, position=position, progress=position, steps=int(sys.argv[1]),
                 sidecar=lambda: {"samples": position.samples},
                 on_step=records.append) as session:
        print(json.dumps({"resumed_from": session.resumed_from, "step": position.step}))
        for step in session.steps():
            position.samples += 8
            session.report(loss=0.5, tokens=8, lr=0.1 * step)
    print(json.dumps({"records": records}))


run(main)
'''


def test_a_loop_with_its_own_progress_drives_the_session(tmp_path: Path) -> None:
    """What the built-in trainer uses (Session(progress=, sidecar=, on_step=) and report's extra
    fields): the object's step is advanced and resumed, the session adds no step of its own to
    the checkpoint, and the fields reach the records and the sidecar."""
    script = tmp_path / "hooks.py"
    script.write_text(HOOKS_PY)
    env = {**os.environ, "ELASTRAIN_METRICS_PORT": "0", "OMP_NUM_THREADS": "1",
           "ELASTRAIN_CHECKPOINT_URI": f"file://{tmp_path}/ckpt",
           "ELASTRAIN_CHECKPOINT_INTERVAL_STEPS": "0"}

    def attempt(steps: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        done = subprocess.run([sys.executable, str(script), str(steps)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        events = [x for x in lines if "event" in x]
        return [x for x in lines if "event" not in x], events

    mine, events = attempt(3)
    assert mine[0] == {"resumed_from": None, "step": 0}
    steps = [e for e in events if e["event"] == "step"]
    assert [(e["step"], e["lr"], e["loss"]) for e in steps] == [(1, 0.0, 0.5), (2, 0.1, 0.5),
                                                                (3, 0.2, 0.5)]
    assert [r["step"] for r in mine[1]["records"]] == [1, 2, 3]  # on_step saw each record
    sidecar = json.loads((tmp_path / "ckpt" / "step-00000003" / "sidecar.json").read_text())
    assert sidecar["samples"] == 24 and sidecar["step"] == 3
    state = load_checkpoint(tmp_path / "ckpt", 3, tmp_path)
    assert set(state) == {"model", "position"}, sorted(state)  # no step of the session's own
    assert state["position"] == {"step": 3, "samples": 24}
    mine, _ = attempt(5)
    assert mine[0] == {"resumed_from": 3, "step": 3}
    assert [r["step"] for r in mine[1]["records"]] == [4, 5]
