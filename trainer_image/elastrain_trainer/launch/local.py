"""Local mode: `elastrain run --local` runs a job's workers as torchrun agents on this machine.

`run_local` is what the CLI calls: a LocalCluster (cluster.py) of agents in the recovery mode
the env renders (restart, or inProcess: survivors keep their processes and regroup, a
replacement joins healed from a live peer), supervised with the job's restartPolicy
(supervise.py), then a summary and a loss plot (resumes and regroups marked). `worker_entry`
turns a pod's command + args into what each local agent runs after the launcher's options.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

from elastrain_trainer.launch.cluster import TRAINER_ENTRY, LocalCluster, Record
from elastrain_trainer.launch.supervise import Outcome, RestartBudget, Supervisor
from elastrain_trainer.summary import RunSummary, plot_loss, summarize, write_summary

# Modules that are torchrun (`python -m MODULE [torchrun options] script ...`).
_TORCHRUN_MODULES = ("torch.distributed.run", "elastrain_trainer.launch")
JOIN_WAIT_ENV = "ELASTRAIN_JOIN_WAIT_AFTER_STEP"


@dataclass(frozen=True)
class LocalRunResult:
    """What a local run did; `summary` also lives in out_dir/summary.json."""

    exit_codes: dict[str, int | None]
    summary: RunSummary
    plot_path: Path | None
    out_dir: Path
    outcome: Outcome | None = None

    @property
    def ok(self) -> bool:
        # torchrun exits 0 only once its whole group finished: that is success even for a
        # script that prints no elastrain records.
        finished = self.summary.finished or 0 in self.exit_codes.values()
        return (finished and all(c is not None for c in self.exit_codes.values())
                and (self.outcome is None or self.outcome.failed is None))


def worker_entry(command: Sequence[str], args: Sequence[str] = ()) -> tuple[str, ...]:
    """What follows the launcher in a pod's command + args: torchrun options, then the script
    or `-m module` and its arguments. Local agents run it under elastrain's launcher with the
    local rendezvous flags before it (an option given again in the command wins).

    `torchrun ...`, `python -m torch.distributed.run ...` and `python -m
    elastrain_trainer.launch ...` are torchrun; ValueError for a command that starts no torchrun
    (local mode runs every worker as a torchrun agent)."""
    words = list(command)
    if words and PurePath(words[0]).name == "torchrun":
        return (*words[1:], *args)
    if (len(words) >= 3 and PurePath(words[0]).name.startswith("python") and words[1] == "-m"
            and words[2] in _TORCHRUN_MODULES):
        return (*words[3:], *args)
    raise ValueError(f"command {words!r} does not start torchrun (`torchrun ...` or `python -m "
                     f"{' | '.join(_TORCHRUN_MODULES)} ...`); local mode runs each worker as a "
                     "torchrun agent")


def run_local(env: Mapping[str, str], workers: int, min_nodes: int, max_nodes: int,
              out_dir: str | os.PathLike[str], *, simulate_preemption: bool = False,
              preempt_at_step: int | None = None, timeout: float = 3600,
              on_record: Callable[[str, Record], None] | None = None,
              budget: RestartBudget | None = None, entry: Sequence[str] = TRAINER_ENTRY,
              cwd: str | os.PathLike[str] | None = None) -> LocalRunResult:
    """Run a job locally; optionally SIGTERM one agent mid-run and start a replacement.

    In process, the survivor waits for the replacement past join_wait_step, so the replacement
    joins before the end however long it takes to start. Crashes are counted against `budget`
    (spec.restartPolicy) and replaced after its backoff; a lost rendezvous store is restarted
    (supervise.py). `entry` is what each agent runs (worker_entry of the job's command), in
    `cwd`."""
    out = Path(out_dir)
    env = {"ELASTRAIN_CHECKPOINT_URI": f"file://{out.absolute()}/checkpoints", **env}
    at = 0
    if simulate_preemption:  # only then: a malformed ELASTRAIN_STEPS is the trainer's to report
        steps = int(env.get("ELASTRAIN_STEPS", "100"))
        at = preempt_at_step if preempt_at_step is not None else max(1, steps // 3)
        if env.get("ELASTRAIN_RECOVERY") == "inProcess":
            env = {JOIN_WAIT_ENV: str(join_wait_step(steps, at)), **env}
    cluster = LocalCluster(env, min_nodes, max_nodes, out,
                           job_id=env.get("ELASTRAIN_JOB_NAME", "local"), entry=tuple(entry),
                           cwd=Path(cwd) if cwd is not None else None,
                           on_record=on_record or print_record)
    started = time.monotonic()
    try:
        cluster.start(workers)
        if simulate_preemption and cluster.wait_for_step(at, timeout=timeout):
            print(f"[local] preempting {cluster.agents[-1].name} at step "
                  f"{cluster.max_step()} and starting a replacement", flush=True)
            cluster.preempt(cluster.agents[-1])
            cluster.add_agent()
        supervisor = Supervisor(cluster, budget or RestartBudget())
        outcome = supervisor.run(timeout=max(1.0, timeout - (time.monotonic() - started)))
        codes = outcome.exit_codes
    finally:
        cluster.stop()
    summary = summarize([r for _, r in cluster.records], wall_s=time.monotonic() - started)
    plot = plot_loss([r for _, r in cluster.records], out / "loss.png")
    write_summary(summary, codes, out)
    return LocalRunResult(codes, summary, plot, out, outcome)


def join_wait_step(steps: int, preempt_at: int) -> int:
    """The step after which an in-process survivor of the simulated preemption waits for its
    replacement to ask to join (TrainerConfig.join_wait_after_step): the replacement starts
    while the survivor trains on alone, and on a loaded machine its start took longer than the
    steps that were left. An eighth of the run is left to train at full world."""
    return max(preempt_at + 1, steps - max(1, steps // 8))


def print_record(agent: str, r: Record) -> None:
    """Default progress printer: one short line per step and per lifecycle event."""
    if r["event"] == "step":
        loss = r.get("loss")
        line = (f"[{agent}] step {r['step']:>5}  loss {math.nan if loss is None else loss:.4f}  "
                f"world {r.get('world_size')}  {r.get('tokens_per_s') or 0:.0f} tok/s")
    else:
        fields = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("event", "time"))
        line = f"[{agent}] {r['event']} {fields}"
    # One write per line: agents' pump threads print concurrently.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
