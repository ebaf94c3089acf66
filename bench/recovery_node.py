"""Recovery on the real node, in both recovery modes: a TrainingJob's worker pods lost one at a
time, with notice (evicted, as a spot notice handler or a drain does) and without (the trainer
container SIGKILLed), on the one-node cluster the e2e tier uses (kubelet, containerd, the
operator installed by its chart, MinIO on the pod bridge).

    sudo .venv/bin/python bench/recovery_node.py [--events 6] [--modes restart,inprocess]
                                                 [--kinds evict,kill,freeze,partition]
                                                 [--spares 1] [--dark-cap 420] [--out ...]
                                                 [--nproc 2 [--strategy hsdp]]
    make bench-recovery-node          # root; 7 min here with the images cached (420 s)

Dark kinds (issue 34): `freeze` stops every process of one worker's trainer container (SIGSTOP,
a hung host), `partition` drops every packet into and out of its pod's network namespace but its
loopback (iptables in that namespace: no FIN, no RST). The pod stays dark until the job is whole
again (InProcess: planned out by the heartbeat, replaced by the operator after its grace, the
replacement joined, or a spare took its place; `whole_s`) and the operator has replaced it (a
dark pod back within its grace rejoins in place, uncounted), or in Restart mode until the
survivors resumed (their ring-neighbour watch, session/dark_peers.py, ends the group), at most
--dark-cap seconds; then it is thawed or reconnected. `--nproc N` runs N ranks per pod
(spec.nprocPerNode, the global batch 12 x N so that both 3 and 2 pods split it; the mode set
explicitly, as a job with several ranks per pod must ask for InProcess), `--strategy` its ddp,
fsdp or hsdp. `--spares N` gives the InProcess job N warm spares (a dark member's place is taken
at the failure's own regroup). A notice (a taint, a cordon) is not a kind here: on one node the
notice is on the node of every spare and of any replacement, so nothing can move (policy.notices
moves a worker only onto a spare or a new pod on another node); the notice-first move is
measured on the two real nodes by tests/e2e/test_node_loss.py (scenarios 2 and 4: `pause_s` in
runs/e2e/recovery.json).

The job is the e2e suite's (tests/e2e/support.make_job: the kind example, 3 workers, min 2,
DDP over gloo, the tiny GPT paced at 0.25 s a step, checkpoints to MinIO every 20 steps), once
per mode (spec.recovery.mode Restart, then InProcess: one job after the other on the same node,
the first deleted before the second starts, so they never share the CPU). Per mode, --events
losses of each kind, alternating kinds and rotating over worker indices 0, 1, 2. Each event
waits until the job is back at full size and training, then loses one worker. Per event, from
the trainers' own records (one JSON object per stdout line, followed from every pod's log):
recovery = loss -> first training step after the resume (Restart: every worker process
started again, a checkpoint loaded) or after the next generation (InProcess: the survivors
regroup in their processes); where the time went; steps lost (Restart: last step trained before
the loss - the step the resume loaded; InProcess: steps trained again after the loss); whether
the survivors kept their trainer processes (the node's /proc); what the operator counted.
Writes bench/results/recovery_node.json; summarised in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench.goodput import recovery_phases  # noqa: E402
from tests.e2e.conftest import (  # noqa: E402
    NodeCluster,
    create_job_namespace,
    install_operator,
    prepare_node,
    running_node,
)
from tests.e2e.support import (  # noqa: E402
    RECOVERY_MODES,
    RESTART,
    LogCollector,
    Training,
    container_pid,
    make_job,
    process_tree,
    recovery_spec,
    signal_all,
    steps_lost_at,
    steps_retrained,
    wait_for,
)
from tests.e2e.test_spares import waiting_spares  # noqa: E402

REPLICAS = 3
# With notice (Eviction API -> SIGTERM), without (SIGKILL: the kernel closes the sockets), and
# dark: every process of the trainer container stopped (SIGSTOP: a hung host), or every packet
# into and out of the pod's network namespace dropped (a partition: no FIN, no RST). A dark pod
# stays dark until the job is whole again or the cap passes, then is thawed or reconnected.
KINDS = ("evict", "kill", "freeze", "partition")
DARK = ("freeze", "partition")
DEFAULT_KINDS = ("evict", "kill")
Record = dict[str, Any]


def inprocess_phases(records: Sequence[Record], at: float) -> dict[str, float | None]:
    """Seconds from the loss at `at` to each milestone of an in-process recovery (pure): the
    leaver gone (`left`, notice) or a survivor's collective failed (`peer_lost`, no notice),
    the next generation formed (`regroup`: survivors at the smaller world) and the first step
    trained in it."""
    def first(events: tuple[str, ...], after: float) -> float | None:
        times = [float(r["time"]) for r in records
                 if r["event"] in events and float(r["time"]) > after]
        return min(times) if times else None

    regroup = first(("regroup", "resumed"), at)
    step = None if regroup is None else first(("step",), regroup)

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - at, 3)

    return {"noticed": since(first(("left", "peer_lost"), at)), "regrouped": since(regroup),
            "first_step": since(step)}


def _partition_rules(verb: str) -> list[list[str]]:
    """iptables commands (run in the pod's network namespace) that drop every packet but the
    pod's own loopback (its launcher and worker talk over it, as on a partitioned host)."""
    return [["iptables", verb, "INPUT", "!", "-i", "lo", "-j", "DROP"],
            ["iptables", verb, "OUTPUT", "!", "-o", "lo", "-j", "DROP"]]


def _in_netns(pid: int, argv: list[str]) -> None:
    subprocess.run(["nsenter", "-t", str(pid), "-n", *argv], check=True, capture_output=True)


def lose(t: Training, pod: str, kind: str) -> tuple[float, Any]:
    """Loses `pod` the way `kind` says; returns when, and how to lift a dark kind."""
    if kind == "evict":
        return t.evict(pod), None
    pid = container_pid(t.k, t.ns, pod)
    if kind == "freeze":
        frozen = process_tree(pid)
        at = time.time()
        signal_all(frozen, signal.SIGSTOP)
        return at, lambda: signal_all(frozen, signal.SIGCONT)
    if kind == "partition":
        at = time.time()
        for argv in _partition_rules("-I"):
            _in_netns(pid, argv)

        def lift() -> None:
            for argv in _partition_rules("-D"):
                with contextlib.suppress(subprocess.CalledProcessError):
                    _in_netns(pid, argv)
        return at, lift
    at = time.time()
    os.kill(pid, signal.SIGKILL)  # the whole container: no notice
    return at, None


def whole_again(t: Training, since: float, timeout: float, ranks: int = 1) -> float | None:
    """Seconds from `since` to a step at full size in a generation (or resume) after the
    loss's own recovery, or None within `timeout`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        marks = sorted(float(r["time"]) for kind in ("regroup", "resumed")
                       for r in t.logs.events(kind) if float(r["time"]) > since
                       and r.get("world_size") == REPLICAS * ranks)
        if marks and (step := next((r for r in t.logs.events("step")
                                    if float(r["time"]) >= marks[0]
                                    and r.get("world_size") == REPLICAS * ranks), None)):
            return round(float(step["time"]) - since, 3)
        time.sleep(0.5)
    return None


def measure(t: Training, events: int, kinds: Sequence[str], *, spares: int = 0,
            dark_cap: float = 420, ranks: int = 1) -> list[Record]:
    rows: list[Record] = []
    for i in range(events * len(kinds)):
        t.settle(REPLICAS, ranks=ranks)
        if spares:
            wait_for("the spares waiting", lambda: t.status().get("readySpares") == spares
                     and len(waiting_spares(t.logs)) == spares, timeout=300)
        before = t.counters()
        kind, index = kinds[i % len(kinds)], i % REPLICAS
        waiting = waiting_spares(t.logs)
        pod = next(t.worker(j % len(t.workers())) for j in range(index, index + 8)
                   if t.worker(j % len(t.workers())) not in waiting)  # a member, not a spare
        processes = t.processes()
        at, lift = lose(t, pod, kind)
        whole = None
        try:
            # The cap bounds a detector that fails (gloo's collective timeout is 5 min).
            first = t.recovered_after(at, timeout=dark_cap if kind in DARK else 240)
            if kind in DARK and t.mode != RESTART:
                whole = whole_again(t, at, timeout=dark_cap, ranks=ranks)
                # Dark until the operator has replaced it (a failure, counted once): lifted
                # sooner (a spare makes the world whole at once), it would rejoin in place
                # within its grace, which by design counts nothing.
                wait_for("the dark pod replaced",
                         lambda: t.counters()[1] > before[1],  # noqa: B023
                         timeout=dark_cap)
        finally:
            if lift is not None:
                lift()
        if kind not in DARK or t.mode != RESTART:
            counter = 0 if kind == "evict" else 1  # a preemption, or a failure by policy
            wait_for("the loss counted",
                     lambda: t.counters()[counter] > before[counter],  # noqa: B023
                     timeout=120)
        after = t.processes()
        survivors = {n: inc for n, inc in processes.items() if n != pod}
        records = list(t.logs.records)
        row = {"mode": t.mode, "kind": kind, "event": i + 1, "worker_index": index, "pod": pod,
               "recovery_s": round(float(first["time"]) - at, 3),
               **({"whole_s": whole} if kind in DARK else {}),
               "world_size": first["world_size"],
               "steps_lost": (steps_lost_at(t.logs, at) if t.mode == RESTART
                              else steps_retrained(t.logs, at)),
               "phases_s": (recovery_phases(records, at) if t.mode == RESTART
                            else inprocess_phases(records, at)),
               "survivors_kept_processes": all(after.get(n) == inc
                                               for n, inc in survivors.items()),
               "counted": [a - b for a, b in zip(t.counters(), before, strict=True)]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    t.settle(REPLICAS, ranks=ranks)
    return rows


def run_mode(node: NodeCluster, mode: str, events: int, kinds: Sequence[str],
             logs_dir: Path, *, spares: int = 0, dark_cap: float = 420, nproc: int = 1,
             strategy: str = "ddp") -> tuple[list[Record], list[Record]]:
    """One job in `mode` on its own namespace, measured, then deleted; (rows, join regroups).
    `spares`: warm spares for an InProcess job (Restart mode has none)."""
    job = f"recovery-{mode.lower()}"
    ns = f"bench-recovery-{uuid.uuid4().hex[:4]}"
    create_job_namespace(node, ns)
    # Several ranks per pod run in process only when the mode asks for it.
    shape = ({"nprocPerNode": nproc, "recovery": {"mode": mode}} if nproc > 1
             else recovery_spec(mode))
    # Failures (SIGKILL) are counted against maxRestarts: a budget the bench cannot spend.
    manifest = make_job(job, ns, image=node.images["trainer"], steps=1_000_000,
                        s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket,
                        restartPolicy={"maxRestarts": 10_000, "backoffSeconds": 1,
                                       "maxBackoffSeconds": 2}, strategy=strategy, **shape,
                        **({"spares": spares} if spares and mode != RESTART else {}))
    manifest["spec"]["trainer"]["globalBatchSize"] = 12 * nproc
    node.kubectl.apply(manifest)
    with LogCollector(node.kubectl, ns, Training.worker_selector(job), logs_dir / job) as logs:
        rows = measure(Training(node.kubectl, ns, job, logs, mode), events, kinds,
                       spares=spares if mode != RESTART else 0, dark_cap=dark_cap,
                       ranks=nproc)
        for row in rows:
            row["spares"] = spares if mode != RESTART else 0
            row["nproc_per_node"], row["strategy"] = nproc, strategy
        joins = [r for r in logs.events("regroup") if r.get("reason") == "join"]
    node.kubectl("delete", "namespace", ns, "--wait=true", timeout=300)
    return rows, joins


def _p50(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def summarize(rows: Sequence[Record], joins: Sequence[Record]) -> dict[str, Any]:
    """Per mode and kind: recovery p50/max, steps lost, what was counted, survivors kept;
    the ratio restart p50 / in-process p50 per kind."""
    out: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in rows}):
        for kind in KINDS:
            sel = [r for r in rows if r["mode"] == mode and r["kind"] == kind]
            if not sel:
                continue
            rec = [float(r["recovery_s"]) for r in sel]
            phases = {name: _p50([r["phases_s"][name] for r in sel
                                  if r["phases_s"].get(name) is not None])
                      for name in sel[0]["phases_s"]}
            out[f"{mode}/{kind}"] = {
                "events": len(sel), "recovery_p50_s": _p50(rec),
                "recovery_max_s": round(max(rec), 2), "phases_p50_s": phases,
                "steps_lost_max": max(int(r["steps_lost"]) for r in sel),
                **({"whole_p50_s": _p50([float(r["whole_s"]) for r in sel
                                         if r.get("whole_s") is not None])}
                   if kind in DARK else {}),
                "survivors_kept_processes": sum(bool(r["survivors_kept_processes"])
                                                for r in sel),
                "preemptions_counted": sum(r["counted"][0] for r in sel),
                "failures_counted": sum(r["counted"][1] for r in sel)}
    for kind in KINDS:
        a, b = out.get(f"Restart/{kind}"), out.get(f"InProcess/{kind}")
        if a and b and b["recovery_p50_s"]:
            out[f"ratio/{kind}"] = round(a["recovery_p50_s"] / b["recovery_p50_s"], 2)
    # A join is recorded by the coordinator (a survivor: its pause) and by the healed joiner.
    pauses = [float(r["regroup_s"]) + float(r["heal_s"]) for r in joins
              if r.get("healed_from") is None and r.get("regroup_s") is not None]
    if pauses:
        out["InProcess/join_pause_p50_s"] = _p50(pauses)
        out["InProcess/join_pause_max_s"] = round(max(pauses), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=6, help="losses per mode and kind")
    parser.add_argument("--modes", default=",".join(RECOVERY_MODES),
                        help="restart,inprocess (in that order by default)")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                        help="of evict,kill,freeze,partition (default evict,kill)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/recovery_node.json")
    parser.add_argument("--spares", type=int, default=0,
                        help="warm spares of the InProcess job (time back to full size)")
    parser.add_argument("--dark-cap", type=float, default=420,
                        help="seconds a dark pod may take to be recovered from")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per pod (nprocPerNode)")
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp", "hsdp"))
    args = parser.parse_args(argv)
    modes = [RECOVERY_MODES[m] for m in args.modes.split(",")]
    kinds = args.kinds.split(",")
    if unknown := [k for k in kinds if k not in KINDS]:
        parser.error(f"--kinds {','.join(unknown)}: not one of {','.join(KINDS)} (a notice "
                     "needs two nodes: tests/e2e/test_node_loss.py)")
    images = prepare_node()
    workdir = Path(tempfile.mkdtemp(prefix="elastrain-recovery-node-"))
    rows: list[Record] = []
    joins: list[Record] = []
    started = time.time()
    with running_node(workdir / "node", images) as node:
        install_operator(node)
        for mode in modes:
            mode_rows, mode_joins = run_mode(node, mode, args.events, kinds, workdir / "logs",
                                             spares=args.spares, dark_cap=args.dark_cap,
                                             nproc=args.nproc, strategy=args.strategy)
            rows += mode_rows
            joins += mode_joins
    result = {"bench": "recovery_node", "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
              "machine": report.machine(),
              "wall_s": round(time.time() - started, 1), "events_per_mode_and_kind": args.events,
              "summary": summarize(rows, joins), "events": rows, "joins": joins}
    return report.write(args.out, result, result["summary"], workdir)


if __name__ == "__main__":
    sys.exit(main())
