"""Workers the operator replaces on evidence other than their own exit: the progress watchdog
(a job that completed no step for spec.hangTimeoutSeconds restarts its workers as one counted
failure, policy.hang), and in-process pods the trainers' world planned out without notice.

Planned out (issue 34, item 4). A pod whose node went dark (packets dropped, the host hung, its
kubelet gone) keeps its `Running` phase: its node is marked NotReady only after the node
controller's grace period, and its pods are evicted only after their node-loss toleration
(render.node_loss). In-process survivors know much sooner: their heartbeat judged the pod dead
and the world planned it out (fenced: it can neither train beside the world nor commit). Each
member's /progress names such pods with how long ago it saw them planned out (`plannedOut`).
Once one is out for PLANNED_OUT_GRACE, the operator counts it once as a failure (no notice),
advances its slot (the replacement is created at once, no backoff: a lost node is not a crash
loop) and removes the old pod as any stale one (policy.stale: force-deleted where its node is
lost, since a pod there would stay Terminating until its node answers). The grace lets a
pod that was planned out but lives (a worker restarted in place by its launcher after a freeze
or a crash) rejoin instead, which takes seconds; it is also why a replacement is never made
for a pod still in the world: a pod that rejoined is no longer named. A planned-out pod that
announced its rejoin (alive, restarting in place) is reported younger by the members for a while
(the trainer's metrics.REJOIN_ALLOWANCE_S), so a slow restart on a loaded node is not replaced.

Restart mode has no plan, but a group that re-forms without a pod its dark-peer watch found dark
names that pod planned out the same way (trainer session.dark_peers), aged from the group's
start: a frozen or cut-off pod on a node that stays Ready would otherwise run on uncounted and
never be replaced (seen on the real node, bench/RESULTS.md "Dark workers").

On a lost node (issue 34, item 4). A node whose kubelet and container runtime stopped is marked
NotReady while its containers run on: such a pod's trainer still beats, trains and is in the
world, so no heartbeat plans it out. The operator tells the members the pods on nodes it knows
lost (probe.told_lost, `POST /control`'s "lost"); they ask it to leave at the next step boundary
on its behalf, as its own SIGTERM would (it takes part, finds itself out of the plan and exits).
Once no member's plan names it, it is counted once as a failure and replaced at once, without
the grace (it cannot rejoin: it has ended) and before its node-loss toleration lets the taint
manager evict it, and the stale pod is force-deleted (policy.stale).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.model.status import TrainingJobStatus, WorkerLoss, WorkerSlot
from elastrain_operator.policy.failures import Exit, WorkerPod, aware_time, classify_pod_exit
from elastrain_operator.policy.hang import progressing_again, stalled_seconds
from elastrain_operator.policy.progress import ProgressReport
from elastrain_operator.policy.restarts import backoff_until
from elastrain_operator.policy.round import MAX_RECENT_LOSSES, Observed, Round, current_pods
from elastrain_operator.policy.stale import lost_under
from elastrain_operator.policy.status import (
    EventSpec,
    find_condition,
    make_condition,
    set_condition,
)

# A planned-out pod is replaced once this long has passed since the world planned it out (or
# PLANNED_OUT_TIMEOUTS heartbeat timeouts, if longer): long enough for a worker restarted in
# place (its launcher's restart, torch's import, the join) to rejoin first.
PLANNED_OUT_GRACE_SECONDS = 15.0
PLANNED_OUT_TIMEOUTS = 3


def planned_out_grace(job: TrainingJob) -> float:
    return max(PLANNED_OUT_GRACE_SECONDS,
               PLANNED_OUT_TIMEOUTS * job.spec.recovery.heartbeat_timeout_seconds)


def replace_planned_out(r: Round, job: TrainingJob, observed: Observed,
                        reports: Sequence[ProgressReport] | None, *, pods: int,
                        now: datetime) -> None:
    """Count and replace each current worker pod that the members' reports name planned out
    for at least planned_out_grace, or that is on a lost node and no longer in their plan
    (`reports`: the members', polled this round). In Restart mode, each current worker pod on
    a lost node at once: its group re-forms without it anyway (the survivors' dark-peer watch,
    torchrun's keep-alive), and otherwise it would wait out its node-loss toleration and be
    counted as the taint manager's preemption, although nobody gave notice; and, as in process,
    a pod the members name planned out (a group re-formed without the pod its dark-peer watch
    found dark, on a node that may stay Ready: trainer session.dark_peers)."""
    if reports is None and job.spec.in_process:
        return
    reports = reports or ()
    since: dict[str, float] = {}
    for report in reports:
        for name, seconds in report.planned_out.items():
            since[name] = max(seconds, since.get(name, 0.0))
    grace = planned_out_grace(job)
    world = frozenset().union(*(report.world_pods for report in reports))
    current = current_pods(r.acct.slots, observed.workers)
    doomed: dict[int, tuple[WorkerPod, str]] = {}
    for index, pod in current.items():
        if index >= pods or pod.deleting or classify_pod_exit(pod) not in (Exit.RUNNING,
                                                                           Exit.PENDING):
            continue
        lost = lost_under(aware_time(pod.created), pod.node, observed.lost_nodes,
                          observed.lost_since)
        if since.get(pod.name, 0.0) >= grace:
            by = ("planned out by the in-process world" if job.spec.in_process
                  else "left out of the re-formed worker group")
            doomed[index] = (pod, f"{by} {since[pod.name]:.0f}s ago: no heartbeat for "
                                  f"spec.recovery.heartbeatTimeoutSeconds="
                                  f"{job.spec.recovery.heartbeat_timeout_seconds} (its node went "
                                  "dark, or it hung)")
        elif lost and not job.spec.in_process:
            doomed[index] = (pod, f"node {pod.node} lost ({lost}): the worker group re-forms "
                                  "without it (its processes may still run; a commit of its "
                                  "old group is fenced)")
        elif lost and world and pod.name not in world:
            # Told lost (probe.told_lost), the world asked it to leave: it is out now.
            doomed[index] = (pod, f"node {pod.node} lost ({lost}): planned out by the "
                                  "in-process world at the operator's word (its processes may "
                                  "still run)")
    if not doomed:
        return
    acct = r.acct
    for index, (pod, why) in sorted(doomed.items()):
        loss = WorkerLoss(index=index, pod=pod.name, kind="Failed", reason=why[:256], time=now)
        acct = replace(acct, restarts=acct.restarts + 1, last_loss_reason=c.WORKER_FAILED,
                       losses=(*acct.losses, loss)[-MAX_RECENT_LOSSES:],
                       recovering_since=acct.recovering_since or now)
        r.counted_restarts += 1
        lost = observed.lost_nodes.get(pod.node)
        gone = (f"force-deleted (node {pod.node}: {lost})" if lost
                else "deleted (force-deleted if its kubelet never confirms)")
        r.events.append(EventSpec("Warning", c.WORKER_FAILED,
                                  f"worker {index} (pod {pod.name}) {why}; replaced, the old "
                                  f"pod {gone}"))
    # New attempts in the status write that counts the losses: the old pods are then stale,
    # cleaned up (forced) and never counted again.
    slots = tuple(WorkerSlot(index=s.index, attempt=s.attempt + 1) if s.index in doomed else s
                  for s in acct.slots)
    r.acct = replace(acct, slots=slots)


def restart_if_hung(r: Round, job: TrainingJob, observed: Observed,
                     reports: Sequence[ProgressReport] | None, *, pods: int,
                     now: datetime) -> float | None:
    """Restart every running worker (spares too) as one counted failure when no step
    completed for spec.hangTimeoutSeconds (policy.hang); the seconds without a step, or None.
    `reports`: the members' (a spare steps no step)."""
    timeout = job.spec.hang_timeout_seconds
    stalled = stalled_seconds(reports, timeout_seconds=timeout, now=now)
    if stalled is None:
        return None
    current = current_pods(r.acct.slots, observed.workers)
    running = {i: p for i, p in current.items()
               if i < pods and classify_pod_exit(p) is Exit.RUNNING}
    if not running:
        return None
    why = (f"no training step completed for {stalled:.0f}s "
           f"(spec.hangTimeoutSeconds={timeout})")
    restarts = r.acct.restarts + 1
    after = backoff_until(job.spec.restart_policy, restarts, now)
    first = min(running)
    loss = WorkerLoss(index=first, pod=running[first].name, kind="Failed",
                      reason=f"hung: {why}"[:256], time=now)
    # New attempts in the status write that counts the hang: the pods deleted below are then
    # stale ones being cleaned up, never preemptions.
    slots = tuple(WorkerSlot(index=s.index, attempt=s.attempt + 1, replace_after=after)
                  if s.index in running else s for s in r.acct.slots)
    r.counted_restarts += 1
    r.acct = replace(r.acct, slots=slots, restarts=restarts, last_loss_reason=c.WORKER_FAILED,
                     backoff_until=after or r.acct.backoff_until,
                     losses=(*r.acct.losses, loss)[-MAX_RECENT_LOSSES:],
                     recovering_since=r.acct.recovering_since or now)
    r.events.append(EventSpec("Warning", c.NO_TRAINING_PROGRESS,
                              f"{why}; restarting {len(running)} worker(s) as one counted "
                              "failure"))
    return stalled


def hung_condition(status: TrainingJobStatus, job: TrainingJob, hung: float | None,
                    reports: Sequence[ProgressReport] | None,
                    now: datetime) -> TrainingJobStatus:
    """Hung=True when the watchdog fired this round; False once a step ended after that."""
    gen = job.metadata.generation
    if hung is not None:
        cond = make_condition(c.HUNG, True, c.NO_TRAINING_PROGRESS,
                              f"no training step completed for {hung:.0f}s "
                              f"(spec.hangTimeoutSeconds={job.spec.hang_timeout_seconds}); "
                              "workers restarted", now=now, generation=gen)
    elif progressing_again(find_condition(status.conditions, c.HUNG), reports):
        cond = make_condition(c.HUNG, False, c.TRAINING_PROGRESSING,
                              "training steps complete again", now=now, generation=gen)
    else:
        return status
    return status.model_copy(update={"conditions": set_condition(status.conditions, cond)})


