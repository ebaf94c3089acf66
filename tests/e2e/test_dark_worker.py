"""Scenario 19 (issue 34, item 2): a worker that goes dark, on a real kubelet, in InProcess mode.

Every process of one worker pod's trainer container is stopped (SIGSTOP: no heartbeat and no
socket closed, what peers see of a hung host or of a partition, without the kernel's RST a
killed process gets). The survivors' gloo all-reduce would wait out its timeout (5 minutes in
both modes now); instead the heartbeat judges the pod gone within heartbeatTimeoutSeconds and
each survivor severs its own sockets of that generation (docs/recovery.md section 8): they
train on at world 2 in their processes, redoing at most the step in flight. Then the pod
thaws, as a partition lifts: its own collective fails on the reset sockets, it finds itself
planned out, restarts its worker in place and rejoins healed from a live peer; the world is
whole again without a new pod. A second worker then stays frozen: past the grace
(policy.replace) the operator force-deletes it and its replacement joins (issue 34 item 4).

Scenario 19r, the same freeze in Restart mode, runs on the Restart-mode job that is already up on
the two nodes (test_node_notice_restart.py): a job of its own here cost ~80 s of the issue's
10 minutes, most of it the job's start.
"""

from __future__ import annotations

import signal
import time

from tests.e2e.conftest import NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    LogCollector,
    Training,
    container_pid,
    first_step_after_change,
    make_job,
    process_tree,
    record_recovery,
    signal_all,
    steps_retrained,
    wait_for,
)

JOB = "dark"


def test_19_a_frozen_worker_is_planned_out_by_the_heartbeat_and_rejoins_when_it_thaws(
        operator: NodeCluster, job_namespace: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    k.apply(make_job(JOB, ns, image=node.images["trainer"], steps=100_000,
                     s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket,
                     recovery={"mode": INPROCESS}))
    with LogCollector(k, ns, Training.worker_selector(JOB), ARTIFACTS / JOB) as logs:
        t = Training(k, ns, JOB, logs, INPROCESS)
        t.settle()
        processes = t.processes()
        pod = t.worker(2)
        uid = processes[pod].uid
        frozen = process_tree(container_pid(k, ns, pod))
        at = time.time()
        signal_all(frozen, signal.SIGSTOP)
        try:
            # Far below the collective timeout (300 s): only the heartbeat's path is this fast.
            first = wait_for("a step at world 2", lambda: first_step_after_change(logs, at),
                             timeout=60)
            recovery_s = float(first["time"]) - at
            assert first["world_size"] == 2, first
            fails = [r for r in logs.events("regroup")
                     if float(r["time"]) > at and r["reason"] == "fail"]
            assert fails and fails[0]["world_size"] == 2, fails
            survivors = {n: inc for n, inc in processes.items() if n != pod}
            now = t.processes()
            assert {n: now.get(n) for n in survivors} == survivors, \
                "a survivor's trainer process was restarted"
            assert steps_retrained(logs, at) <= 1
        finally:
            signal_all(frozen, signal.SIGCONT)
        thawed = time.time()
        joined = wait_for("the thawed node back in the world, healed from a peer", lambda: next(
            (r for r in logs.events("regroup") if float(r["time"]) > thawed
             and r.get("healed_from") and r["world_size"] == 3), None), timeout=180)
        whole = wait_for("a step at world 3 after the join", lambda: next(
            (r for r in logs.events("step") if float(r["time"]) > float(joined["time"])
             and r.get("world_size") == 3), None), timeout=120)
        # It announced its rejoin before its restart, and the survivors saw it (so the
        # operator gave it time: policy.replace); the same pod came back (its worker
        # restarted in place), never a checkpoint load.
        assert {r["node"] for r in logs.events("peer_rejoining") if r["peer"] == pod
                and float(r["time"]) > thawed - 1} == set(survivors), logs.events("peer_rejoining")
        assert t.processes()[pod].uid == uid
        assert not [r for r in logs.events("resumed") if float(r["time"]) > at]
        record_recovery("19-frozen-worker-2", recovery_s, mode=INPROCESS, pod=pod,
                        frozen_s=round(thawed - at, 2),
                        whole_after_thaw_s=round(float(whole["time"]) - thawed, 2))
        print(f"{pod} frozen: world 2 after {recovery_s:.2f} s; thawed after "
              f"{thawed - at:.2f} s; world 3 again {float(whole['time']) - thawed:.2f} s later")

        # A worker that stays dark: the world plans it out as above, and the operator, told so
        # by the members' control answers (plannedOut), replaces it (issue 34 item 4): counted
        # once as a failure, the old pod force-deleted, the world whole again with a new pod.
        dark = t.worker(1)
        before = t.counters()
        frozen = process_tree(container_pid(k, ns, dark))
        at = time.time()
        signal_all(frozen, signal.SIGSTOP)
        try:
            replacement = wait_for("worker 1's replacement pod", lambda: next(
                (p["metadata"]["name"] for p in t.workers()
                 if p["metadata"]["labels"]["elastrain.dev/worker-index"] == "1"
                 and p["metadata"]["name"] != dark), None), timeout=120)
            replaced_s = time.time() - at
        finally:
            signal_all(frozen, signal.SIGCONT)  # the pod is being force-deleted: let it go
        back = wait_for("the replacement in the world, healed from a peer", lambda: next(
            (r for r in logs.events("regroup") if float(r["time"]) > at
             and r.get("node") == replacement and r["world_size"] == 3), None), timeout=180)
        assert t.counters() == (before[0], before[1] + 1)
        loss = t.status()["recentLosses"][-1]
        assert (loss["pod"], loss["kind"]) == (dark, "Failed"), loss
        assert loss["reason"].startswith("planned out by the in-process world"), loss
        print(f"{dark} stayed dark: replaced by {replacement} after {replaced_s:.1f} s, world 3 "
              f"again {float(back['time']) - at:.1f} s after it froze")
        record_recovery("19-dark-worker-1-replaced", float(back["time"]) - at, mode=INPROCESS,
                        pod=dark, replaced_after_s=round(replaced_s, 1))
    k("delete", "trainingjob", JOB, "-n", ns, "--wait=true", "--timeout=120s", check=False)

