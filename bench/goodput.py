"""Goodput and recovery of a fixed-steps local job under repeated worker loss.

    .venv/bin/python bench/goodput.py [--events 10] [--period 6] [--steps 400]
                                      [--intervals 10,25] [--out bench/results/goodput.json]

Takes ~25 min on 2 cores; results in bench/RESULTS.md.

Per checkpoint interval (ELASTRAIN_CHECKPOINT_INTERVAL_STEPS), one run each of:
  a        uninterrupted;
  term     every P seconds of training, SIGTERM the oldest agent (notice: LocalCluster.preempt)
           and start a replacement (add_agent);
  kill     the same with SIGKILL of the agent and its worker (no notice: LocalCluster.kill);
  ip-term  the same as term with in-process recovery (spec.recovery.mode InProcess): each agent
           runs torchrun standalone, the trainers form the job's world over the store, survivors
           keep their processes and regroup; the replacement joins with state from a live peer;
  ip-kill  the same as kill, in process;
  ip-term-spare, ip-kill-spare
           the same with one warm spare (spec.spares: 1): N + 1 agents, the world N, the
           extra one waiting with torch imported; the loss takes a member (never the spare),
           the spare takes its place, the replacement becomes the next spare;
and, for the first interval only, term and kill again with the rendezvous hosted by worker 0's
agent (`host-term`, `host-kill`: c10d is_host=true on slot 0, what Kubeflow's PyTorchJob does)
instead of elastrain's own store; there the lost worker is always slot 0, the store's host,
and every agent that exits non-zero is restarted after --restart-delay (a pod's restartPolicy).

--nodes N (default 2) workers of minimum --min-nodes (default N): the in-process variants can
only keep training at a smaller world when --min-nodes < --nodes (with 2:2 a loss stops every
node, as in restart mode); compare them with `--nodes 3 --min-nodes 2` (the e2e job's shape).
The global batch is 4 x nodes (micro-batch 2), so both world sizes split it.

Join time (in process): per event, signal -> the first step at the full world again (`full
world` in the table). Without a spare that is the replacement's start, imports and join; with
one, the regroup and the spare's heal from a live peer.

In process, an event's resume is the coordinator's first `regroup` record after it (reason
leave or fail; start when too few nodes were left and every node restarted from the step they
saved): steps lost = last step trained before it - its step; recovery = signal -> first
step after it. The replacement's later join (a `join` regroup) pauses the survivors briefly;
that pause is in the run's wall time, hence in its cost per event.

P counts seconds of *training* between events: an event fires P s after the first step that
followed the previous recovery. Goodput = wall(a) / wall(run), wall = cluster start -> the
trainers' `finished` record. Per event, from the trainers' JSON records: steps lost = last step
trained before the resume - the step the resume loaded; recovery = signal sent -> first step
after that resume. cost = (wall(run) - wall(a)) / events; `goodput_at_300s` = 300 / (300 +
cost), the goodput a preemption every 5 minutes of training would give at that cost.

Steps are paced with ELASTRAIN_STEP_SLEEP_SECONDS (standing in for accelerator time, and
keeping the shared CPU free for the recoveries being measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Record = dict[str, Any]
NOTICE_PERIOD_S = 300.0  # the goal's cadence: a preemption every 5 minutes of training
PHASES = ("saved", "workers_up", "resumed", "first_step")


# ---- pure: what the records say -------------------------------------------------------------

@dataclass(frozen=True)
class EventOutcome:
    """One worker loss: when, what the resume loaded, what it cost."""

    at: float
    resumed_step: int | None
    steps_lost: int | None
    recovery_s: float | None


def first_resume_after(records: Sequence[Record], at: float) -> Record | None:
    resumes = [r for r in records if r["event"] == "resumed" and float(r["time"]) > at]
    return min(resumes, key=lambda r: float(r["time"])) if resumes else None


def first_step_after(records: Sequence[Record], at: float) -> Record | None:
    steps = [r for r in records if r["event"] == "step" and float(r["time"]) > at]
    return min(steps, key=lambda r: float(r["time"])) if steps else None


def first_regroup_after(records: Sequence[Record], at: float) -> Record | None:
    """In process: the generation that answered a loss at `at` (not a later join's): the
    smaller world (leave, fail), or a start from the checkpoint when too few nodes were left
    and every node saved and restarted (start)."""
    regroups = [r for r in records if r["event"] == "regroup" and float(r["time"]) > at
                and r.get("reason") in ("leave", "fail", "start")]
    return min(regroups, key=lambda r: float(r["time"])) if regroups else None


def analyse_event(records: Sequence[Record], at: float, *,
                  resume_after: Callable[[Sequence[Record], float], Record | None]
                  = first_resume_after) -> EventOutcome:
    """Steps lost and recovery time of the loss at wall time `at` (time.time()); the resume is
    a restart's `resumed` record, or in process (first_regroup_after) the next generation."""
    resume = resume_after(records, at)
    if resume is None:
        return EventOutcome(at, None, None, None)
    t_resume = float(resume["time"])
    before = [int(r["step"]) for r in records
              if r["event"] == "step" and float(r["time"]) < t_resume]
    lost = max(0, max(before, default=0) - int(resume["step"]))
    step = first_step_after(records, t_resume)
    recovery = None if step is None else round(float(step["time"]) - at, 3)
    return EventOutcome(at, int(resume["step"]), lost, recovery)


def analyse_inprocess_event(records: Sequence[Record], at: float) -> EventOutcome:
    return analyse_event(records, at, resume_after=first_regroup_after)


def full_world_after(records: Sequence[Record], at: float, world: int) -> float | None:
    """Seconds from the loss at `at` to the first step trained at `world` again after the
    loss's own regroup (pure; None when the world never came back)."""
    resume = first_regroup_after(records, at)
    if resume is None:
        return None
    steps = [float(r["time"]) for r in records if r["event"] == "step"
             and float(r["time"]) > float(resume["time"]) and r.get("world_size") == world]
    return round(min(steps) - at, 3) if steps else None


def recovery_phases(records: Sequence[Record], at: float) -> dict[str, float | None]:
    """Seconds from the loss at `at` to each milestone of its recovery (pure): the SIGTERM
    save committed (`saved`, None without notice), the new workers up (their checkpoint
    location check passed: rendezvous done, processes started), the checkpoint loaded
    (`resumed`) and the first step trained."""
    resume = first_resume_after(records, at)
    end = float(resume["time"]) if resume is not None else float("inf")

    def first(event: str, until: float) -> float | None:
        times = [float(r["time"]) for r in records
                 if r["event"] == event and at < float(r["time"]) <= until]
        return round(min(times) - at, 3) if times else None

    stop = first("stopping", end)
    saved = None
    if stop is not None:
        saved = first("checkpoint_saved", end)
    step = None if resume is None else first_step_after(records, end)
    return {"saved": saved, "workers_up": first("checkpoint_location_ok", end),
            "resumed": None if resume is None else round(end - at, 3),
            "first_step": None if step is None else round(float(step["time"]) - at, 3)}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank-free linear percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def goodput_at(period_s: float, cost_s: float) -> float:
    """Goodput with one event per `period_s` of training, each costing `cost_s` of wall time."""
    return period_s / (period_s + max(0.0, cost_s))


def summarize_run(name: str, wall_s: float, baseline_s: float,
                  outcomes: Sequence[EventOutcome]) -> dict[str, Any]:
    """The row of the results table for one run (pure)."""
    lost = [o.steps_lost for o in outcomes if o.steps_lost is not None]
    rec = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    cost = (wall_s - baseline_s) / len(outcomes) if outcomes else 0.0
    return {
        "variant": name, "wall_s": round(wall_s, 2), "events": len(outcomes),
        "goodput": round(baseline_s / wall_s, 4) if wall_s else None,
        "cost_per_event_s": round(cost, 2),
        "goodput_at_300s": round(goodput_at(NOTICE_PERIOD_S, cost), 4) if outcomes else 1.0,
        "steps_lost_per_event": lost,
        "steps_lost_mean": round(statistics.fmean(lost), 2) if lost else None,
        "steps_lost_max": max(lost) if lost else None,
        "recovery_p50_s": _round(percentile(rec, 0.5)),
        "recovery_max_s": _round(max(rec) if rec else None),
        "recovery_s": rec,
        "unresolved_events": sum(o.recovery_s is None for o in outcomes),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


# ---- shell: clusters and events ------------------------------------------------------------

def job_env(run_dir: Path, steps: int, interval: int, step_sleep: float,
            nodes: int = 2) -> dict[str, str]:
    return {"ELASTRAIN_MODEL": "gpt-tiny", "ELASTRAIN_SEQ_LEN": "32",
            "ELASTRAIN_GLOBAL_BATCH_SIZE": str(4 * nodes), "ELASTRAIN_MICRO_BATCH_SIZE": "2",
            "ELASTRAIN_STEPS": str(steps), "ELASTRAIN_WARMUP_STEPS": "4",
            "ELASTRAIN_LR": "3e-3", "ELASTRAIN_METRICS_PORT": "0",
            "ELASTRAIN_CHECKPOINT_KEEP": "2",
            "ELASTRAIN_CHECKPOINT_INTERVAL_STEPS": str(interval),
            "ELASTRAIN_STEP_SLEEP_SECONDS": str(step_sleep),
            "ELASTRAIN_CHECKPOINT_URI": f"file://{run_dir}/ckpt", "OMP_NUM_THREADS": "1"}


def hosted_cluster_class() -> type:
    """LocalCluster with no store of its own: slot 0's agent hosts the c10d store
    (is_host=true), the others connect to it, and a crashed slot is restarted."""
    from elastrain_trainer.launch.cluster import RDZV_CONF, Agent, LocalCluster

    @dataclass
    class HostedCluster(LocalCluster):
        restart_delay: float = 0.5
        slots: dict[int, Agent] = field(default_factory=dict)
        restarts: int = 0
        _lock: threading.RLock = field(default_factory=threading.RLock)
        _done: threading.Event = field(default_factory=threading.Event)

        def ensure_store(self) -> None:  # the store lives in slot 0's agent
            return

        def store_alive(self) -> bool:
            return True

        def start(self, workers: int) -> None:
            super().start(workers)
            threading.Thread(target=self._watch, daemon=True).start()

        def add_agent(self, slot: int | None = None) -> Agent:
            with self._lock:
                slot = len(self.slots) if slot is None else slot
                conf = RDZV_CONF.replace("is_host=false", f"is_host={str(slot == 0).lower()}")
                env = {**os.environ, **self.env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                       "PYTHONUNBUFFERED": "1"}
                cmd = [sys.executable, "-m", "elastrain_trainer.launch",
                       f"--nnodes={self.min_nodes}:{self.max_nodes}", "--nproc-per-node=1",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self._port}",
                       f"--rdzv-id={self.job_id}", f"--rdzv-conf={conf}",
                       "--max-restarts=100", "--monitor-interval=0.5", *self.entry]
                name = f"agent-{len(self.agents)}-slot{slot}"
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                agent = Agent(name, proc, self.out_dir / f"{name}.log")
                self.agents.append(agent)
                self.slots[slot] = agent
            threading.Thread(target=self._pump, args=(agent,), daemon=True).start()
            return agent

        def slot_of(self, agent: Agent) -> int:
            return next(s for s, a in self.slots.items() if a is agent)

        def _watch(self) -> None:
            while not self._done.is_set():
                with self._lock:
                    crashed = [s for s, a in self.slots.items()
                               if a.proc.poll() not in (None, 0) and a not in self.preempted]
                    finished = any(a.proc.poll() == 0 for a in self.agents)
                if crashed and not finished:
                    time.sleep(self.restart_delay)
                    for slot in crashed:
                        self.restarts += 1
                        self.add_agent(slot)
                time.sleep(0.1)

        def stop(self) -> None:
            self._done.set()
            super().stop()

    return HostedCluster


def inprocess_env(env: dict[str, str], name: str, nodes: int, min_nodes: int,
                  spares: int) -> dict[str, str]:
    """What an InProcess worker pod's trainer reads (the operator's rendering, in short): with
    it, LocalCluster's agents run the launcher standalone on the cluster's store, as
    `elastrain run --local` does for an InProcess spec."""
    return {**env, "PET_STANDALONE": "1", "PET_NNODES": "1", "PET_NPROC_PER_NODE": "1",
            "PET_MAX_RESTARTS": "100", "PET_MONITOR_INTERVAL": "0.5",
            "ELASTRAIN_RECOVERY": "inProcess", "ELASTRAIN_RUN_ID": name,
            "ELASTRAIN_REPLICAS": str(nodes), "ELASTRAIN_MAX_REPLICAS": str(nodes + spares),
            "ELASTRAIN_MIN_REPLICAS": str(min_nodes), "ELASTRAIN_SPARES": str(spares)}


def lose_worker(cluster: Any, kind: str) -> None:
    """SIGTERM (term) or SIGKILL (kill) the oldest live agent (slot 0 when hosted) and start
    its replacement at once."""
    hosted = hasattr(cluster, "slots")
    if hosted:
        victim = cluster.slots[0]
    else:
        with cluster._cond:
            spares = waiting_spares(cluster.records)
        victim = next(a for a in cluster.agents
                      if a.proc.poll() is None and a.name not in spares)
    (cluster.preempt if kind == "term" else cluster.kill)(victim)
    if hosted:
        cluster.add_agent(0)
    else:
        cluster.add_agent()


def waiting_spares(records: Sequence[tuple[str, Record]]) -> set[str]:
    """Agents whose last `spare` record (named beyond the world) has no `regroup` of theirs
    after it (a spare taken into the world is healed, and says so in a regroup record)."""
    state: dict[str, bool] = {}
    for agent, r in records:
        if r["event"] in ("spare", "regroup"):
            state[agent] = r["event"] == "spare"
    return {a for a, spare in state.items() if spare}


def finished(records: Sequence[tuple[str, Record]]) -> bool:
    return any(r["event"] == "finished" for _, r in records)


def recovered_step(cluster: Any, at: float) -> Record | None:
    with cluster._cond:
        recs = [r for _, r in cluster.records]
    resume = (first_regroup_after(recs, at) if getattr(cluster, "in_process", False)
              else first_resume_after(recs, at))
    return None if resume is None else first_step_after(recs, float(resume["time"]))


def drive_events(cluster: Any, kind: str, events: int, period: float,
                 timeout: float) -> list[float]:
    """Lose a worker each `period` s of training; the times the signals were sent."""
    if not cluster.wait_for(lambda rs: any(r["event"] == "step" for _, r in rs), timeout):
        raise RuntimeError("no training step")
    with cluster._cond:
        anchor = min(float(r["time"]) for _, r in cluster.records if r["event"] == "step")
    times: list[float] = []
    while len(times) < events:
        if cluster.wait_for(finished, timeout=max(0.0, anchor + period - time.time())):
            break
        at = time.time()
        lose_worker(cluster, kind)
        times.append(at)
        if not cluster.wait_for(lambda rs, at=at: recovered_step(cluster, at) is not None
                                or finished(rs), timeout):
            raise RuntimeError(f"no recovery {timeout} s after the event at {at}")
        step = recovered_step(cluster, at)
        if step is None:
            break
        anchor = float(step["time"])
    return times


def run_one(name: str, env: dict[str, str], run_dir: Path, kind: str | None, hosted: bool,
            events: int, period: float, timeout: float, restart_delay: float,
            nodes: int = 2, min_nodes: int = 2, in_process: bool = False, spares: int = 0,
            ) -> tuple[float, list[Record], list[float], dict[str, Any]]:
    from elastrain_trainer.launch.cluster import LocalCluster

    cls: Callable[..., Any] = hosted_cluster_class() if hosted else LocalCluster
    kwargs: dict[str, Any] = {"restart_delay": restart_delay} if hosted else {}
    if in_process:
        env = inprocess_env(env, name, nodes, min_nodes, spares)
    cluster = cls(env, min_nodes, nodes, run_dir / "logs", job_id=name,
                  on_record=lambda a, r: None, **kwargs)
    start = time.time()
    times: list[float] = []
    try:
        cluster.start(nodes + spares)
        if kind is not None:
            times = drive_events(cluster, kind, events, period, timeout)
        if not cluster.wait_for(finished, timeout):
            raise RuntimeError(f"{name}: not finished in {timeout} s")
        with cluster._cond:
            recs = [r for _, r in cluster.records]
        end = min(float(r["time"]) for r in recs if r["event"] == "finished")
        if hosted:
            cluster._done.set()
        cluster.wait_agents(timeout=60)
    finally:
        cluster.stop()
    extra = {"agent_restarts": getattr(cluster, "restarts", 0),
             "resumes": sum(r["event"] == "resumed" for r in recs),
             "regroups": sum(r["event"] == "regroup" for r in recs)}
    return end - start, recs, times, extra


def machine_load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


@dataclass
class Plan:
    steps: int
    events: int
    period: float
    intervals: list[int]
    step_sleep: float
    nodes: int
    min_nodes: int
    restart_delay: float
    timeout: float
    out: Path
    work: Path
    runs: list[dict[str, Any]] = field(default_factory=list)


def run_variant(plan: Plan, interval: int, name: str, kind: str | None, hosted: bool,
                baseline: float | None) -> float:
    label = f"{name}/i{interval}"
    run_dir = plan.work / f"{name}-i{interval}"
    in_process = name.startswith("ip-")
    spares = 1 if name.endswith("-spare") else 0
    env = job_env(run_dir, plan.steps, interval, plan.step_sleep, plan.nodes)
    wall, recs, times, extra = run_one(label.replace("/", "-"), env, run_dir, kind, hosted,
                                       plan.events, plan.period, plan.timeout,
                                       plan.restart_delay, plan.nodes, plan.min_nodes,
                                       in_process, spares)
    analyse = analyse_inprocess_event if in_process else analyse_event
    outcomes = [analyse(recs, t) for t in times]
    row = summarize_run(name, wall, baseline if baseline is not None else wall, outcomes)
    phases = [recovery_phases(recs, t) for t in times]
    if in_process:
        full = [v for t in times if (v := full_world_after(recs, t, plan.nodes)) is not None]
        row.update(full_world_s=full, full_world_p50_s=_round(percentile(full, 0.5)),
                   full_world_max_s=_round(max(full) if full else None))
    row.update(interval_steps=interval, **extra, event_times=[round(t, 3) for t in times],
               recovery_phases_p50_s={k: _round(percentile(
                   [v for p in phases if (v := p[k]) is not None], 0.5)) for k in PHASES})
    plan.runs.append(row)
    print(f"{label:>16}: wall {wall:6.1f} s  events {len(times):2d}  goodput "
          f"{row['goodput']:.3f}  lost/event {row['steps_lost_per_event']}  recovery p50 "
          f"{row['recovery_p50_s']} max {row['recovery_max_s']}  full world p50 "
          f"{row.get('full_world_p50_s', '-')}", flush=True)
    return wall


def print_table(runs: Sequence[dict[str, Any]]) -> None:
    head = (f"{'variant':<14}{'ckpt':>5}{'events':>7}{'wall s':>8}{'goodput':>9}"
            f"{'cost/ev s':>10}{'@300s':>8}{'lost mean':>10}{'lost max':>9}"
            f"{'rec p50':>8}{'rec max':>8}{'full world p50':>15}")
    print(head)
    for r in runs:
        if "error" in r:
            print(f"{r['variant']:<14}{r['interval_steps']:>5}  FAILED: {r['error']}")
            continue
        print(f"{r['variant']:<14}{r['interval_steps']:>5}{r['events']:>7}{r['wall_s']:>8.1f}"
              f"{r['goodput']:>9.3f}{r['cost_per_event_s']:>10.2f}{r['goodput_at_300s']:>8.3f}"
              f"{_fmt(r['steps_lost_mean']):>10}{_fmt(r['steps_lost_max']):>9}"
              f"{_fmt(r['recovery_p50_s']):>8}{_fmt(r['recovery_max_s']):>8}"
              f"{_fmt(r.get('full_world_p50_s')):>15}")


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--period", type=float, default=6.0,
                        help="seconds of training between worker losses")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--intervals", default="10,25",
                        help="ELASTRAIN_CHECKPOINT_INTERVAL_STEPS values, comma separated")
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--restart-delay", type=float, default=0.5,
                        help="hosted variant: seconds before a crashed agent is restarted")
    parser.add_argument("--variants", default="term,kill,host-term,host-kill",
                        help="of term, kill, ip-term, ip-kill, ip-term-spare, ip-kill-spare, "
                             "host-term, host-kill")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--min-nodes", type=int, default=None, help="default: --nodes")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "goodput.json")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-goodput")
    args = parser.parse_args()
    plan = Plan(args.steps, args.events, args.period,
                [int(x) for x in args.intervals.split(",")], args.step_sleep,
                args.nodes, args.min_nodes or args.nodes, args.restart_delay, args.timeout,
                args.out, args.work)
    wanted = args.variants.split(",")
    load_before = machine_load()
    started = time.time()
    print(f"load before: {load_before}", flush=True)
    for i, interval in enumerate(plan.intervals):
        base = run_variant(plan, interval, "a", None, False, None)
        for name in wanted:
            hosted = name.startswith("host-")
            if hosted and i > 0:
                continue  # the store comparison needs one interval only
            try:
                kind = name.removeprefix("host-").removeprefix("ip-").removesuffix("-spare")
                run_variant(plan, interval, name, kind, hosted, base)
            except RuntimeError as e:  # record it and go on: the other variants still count
                print(f"{name}/i{interval}: FAILED: {e}", flush=True)
                plan.runs.append({"variant": name, "interval_steps": interval, "error": str(e)})
    load_after = machine_load()
    print(f"load after: {load_after}")
    print_table(plan.runs)
    doc = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
           "duration_s": round(time.time() - started, 1),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "python": platform.python_version()},
           "load_before": load_before, "load_after": load_after,
           "settings": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in asdict(plan).items() if k != "runs"},
           "runs": plan.runs}
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    plan.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {plan.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
