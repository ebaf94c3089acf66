"""A job on the two real nodes (the `second_node` harness, tests/README.md): its workers 0 and 1
on node 1, worker 2 on node 2, its store pinned to node 1, and what the node-loss and notice
scenarios read of it (the processes a pod still runs on either node, the bucket's commits).

Placement without a node affinity of the job's: a NoSchedule taint of the test's own (HOLD, not
a notice the operator reads) keeps the scheduler off one node while a pod is created.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.e2e.conftest import (
    OPERATOR_NAMESPACE,
    NamespacePool,
    NodeCluster,
    SecondNode,
    added_second_node,
)
from tests.e2e.support import (
    ARTIFACTS,
    Incarnation,
    LogCollector,
    Training,
    child_processes,
    container_pid,
    make_job,
    wait_for,
)

NODE_1 = "elastrain-node"
HOLD = "elastrain.dev/e2e-hold"  # the test's own taint: not among the notices read
# The job's store is pinned to the node with this label (spec.rendezvous is immutable: moving
# the label moves the store's next pod).
STORE_NODE = "elastrain.dev/e2e-store"
KARPENTER = "karpenter.sh/disrupted"


class TwoNodeJob(Training):
    """A job on the two nodes."""

    node: NodeCluster
    second: SecondNode

    def hold(self, name: str) -> None:
        self.k("taint", "node", name, f"{HOLD}=:NoSchedule", "--overwrite")

    def release(self, name: str) -> None:
        self.k("taint", "node", name, f"{HOLD}:NoSchedule-", check=False)

    def pods_of(self, index: int) -> list[dict[str, Any]]:
        return [p for p in self.workers()
                if p["metadata"]["labels"]["elastrain.dev/worker-index"] == str(index)]

    def bound(self, index: int, node: str) -> str | None:
        """The name of worker `index`'s live pod once the scheduler bound it to `node`."""
        return next((p["metadata"]["name"] for p in self.pods_of(index)
                     if p["spec"].get("nodeName") == node), None)

    def node_of(self, pod: str) -> str:
        return str(self.k.json("get", "pod", pod, "-n", self.ns)["spec"].get("nodeName", ""))

    def survivors(self) -> dict[str, Incarnation]:
        """The trainer incarnations of the worker pods on node 1 (Training.processes reads
        node 1's containerd only)."""
        out = {}
        for pod in self.workers():
            name = pod["metadata"]["name"]
            if pod["spec"].get("nodeName") != NODE_1:
                continue
            statuses = pod.get("status", {}).get("containerStatuses") or []
            trainer = next((c for c in statuses if c["name"] == "trainer"), {})
            if trainer.get("state", {}).get("running"):
                out[name] = Incarnation(uid=pod["metadata"]["uid"],
                                        restart_count=int(trainer.get("restartCount", 0)),
                                        workers=child_processes(container_pid(self.k, self.ns,
                                                                              name)))
        return out

    def store_on(self, name: str) -> None:
        """The store's next pod on node `name` (the running one stays where it is)."""
        for node in (NODE_1, self.second.name):
            if node != name:
                self.k("label", "node", node, f"{STORE_NODE}-", check=False)
        self.k("label", "node", name, f"{STORE_NODE}=yes", "--overwrite")

    def operator_pods(self) -> list[dict[str, Any]]:
        """The operator's pods (the chart's release), going ones included."""
        return list(self.k.json("get", "pods", "-n", OPERATOR_NAMESPACE, "-l",
                                "app.kubernetes.io/name=elastrain")["items"])

    def operator_ready_on(self, node: str, *, besides: set[str]) -> dict[str, Any] | None:
        """An operator pod on `node`, Ready and not going, whose uid is not in `besides`."""
        for pod in self.operator_pods():
            statuses = pod.get("status", {}).get("containerStatuses") or []
            if (pod["metadata"]["uid"] not in besides and pod["spec"].get("nodeName") == node
                    and not pod["metadata"].get("deletionTimestamp")
                    and statuses and all(c.get("ready") for c in statuses)):
                return pod
        return None

    def move_operator(self, node: str) -> dict[str, Any]:
        """The operator's pod deleted with every other node held: its Deployment starts the
        next one on `node`. Returns that pod once it is Ready."""
        others = [n for n in (NODE_1, self.second.name) if n != node]
        old = {p["metadata"]["uid"] for p in self.operator_pods()}
        for name in others:
            self.hold(name)
        try:
            for uid in old:
                pod = next(p for p in self.operator_pods() if p["metadata"]["uid"] == uid)
                # A second of grace, not the chart's 30 s: how it stops is not under test here
                # (test_preemption.py's scenario 8 kills it mid-recovery).
                self.k("delete", "pod", pod["metadata"]["name"], "-n", OPERATOR_NAMESPACE,
                       "--grace-period=1", "--wait=false", check=False)
            moved: dict[str, Any] = wait_for(
                f"the operator Ready on {node}",
                lambda: self.operator_ready_on(node, besides=old), timeout=120)
        finally:
            for name in others:
                self.release(name)
        return moved

    def put_worker_2_on_node_2(self) -> str:
        """From a world of 2 on node 1: scaled to 3 with node 1 held, worker 2's new pod lands
        on node 2 and joins; returns its name."""
        # After a partition lifted, node 2's kubelet renews its Lease late, and the node
        # controller can mark it NotReady a moment after the heal: a pod placed then is
        # placed on a node the operator must call lost (seen: scenario 6's set-up, right
        # after scenario 5's heal).
        wait_for("node 2 back (Ready, untainted, its Lease renewed)",
                 lambda: node_back(self, self.second.name), timeout=120)
        self.hold(NODE_1)
        try:
            self.release(self.second.name)
            self.k("scale", "trainingjob", self.job, "-n", self.ns, "--replicas=3")
            pod = wait_for("worker 2 bound to node 2", lambda: self.bound(2, self.second.name),
                           timeout=120)
        finally:
            self.release(NODE_1)
        self.settle()
        return pod


def save_operator_logs(t: TwoNodeJob, into: Path) -> None:
    """The live operator pods' logs beside the workers' (what it decided, when a scenario
    fails); a pod on a node that cannot be reached is skipped."""
    into.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(Exception):
        for pod in t.operator_pods():
            name = pod["metadata"]["name"]
            with contextlib.suppress(Exception):
                done = t.k("logs", name, "-n", OPERATOR_NAMESPACE, "--timestamps",
                           check=False, timeout=30)
                (into / f"operator-{name}.log").write_text(done.stdout)


def pod_processes(uid: str) -> list[int]:
    """PIDs of the trainer's processes (python: the launcher and its worker) in the pod's
    cgroup (either node: cgroupfs names it pod<uid>), read from the host's /proc: what still
    runs of a pod whatever its kubelet knows. The sandbox's pause process is not one: with no
    kubelet to tear the sandbox down, it outlives the trainer."""
    marks = (f"pod{uid}", f"pod{uid.replace('-', '_')}")
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if any(m in (entry / "cgroup").read_text() for m in marks) \
                        and b"python" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def ended_after_heal(uid: str, pod: str, into: Path, timeout: float) -> float:
    """Wait for the pod's processes to end after its node came back (wait_for's failure if
    they do not); returns how long it took. What they were doing meanwhile goes to
    `into`/<pod>-after-heal.txt: each change in which of them run (and in what state), and the
    last of the trainer's log as its node's runtime writes it (the log collector cannot follow
    a pod that the API has deleted), so a slow end says where it waited."""
    start, last, lines, log, stacks = time.time(), None, [], "", ""
    with contextlib.suppress(OSError):
        into.mkdir(parents=True, exist_ok=True)

    def seen() -> bool:
        nonlocal last, log, stacks
        pids = pod_processes(uid)
        now = sorted(_describe(pid) for pid in pids)
        if now != last:
            lines.append(f"+{time.time() - start:.1f} s: " + ("; ".join(now) or "none"))
            last = now
        log = _container_log(uid) or log
        if pids and not stacks and time.time() - start > STACKS_AFTER_S:
            stacks = f"+{time.time() - start:.1f} s:\n" + "\n".join(map(_stacks, pids))
        return not pids

    try:
        wait_for(f"{pod}'s processes ended", seen, timeout=timeout)
    finally:
        with contextlib.suppress(OSError):
            (into / f"{pod}-after-heal.txt").write_text(
                "\n".join(lines) + "\n--- log\n" + log + "\n--- stacks\n" + stacks)
    return time.time() - start


# A dark pod still running this long after its heal has its threads' stacks dumped (py-spy,
# from the host: where it waits).
STACKS_AFTER_S = 5.0


def _stacks(pid: int) -> str:
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return f"{pid}: no py-spy"
    done = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True,
                          text=True, timeout=60, check=False)
    return done.stdout + done.stderr[-500:]


def _describe(pid: int) -> str:
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        return f"{pid} {state} {argv[:100]}"
    return f"{pid} gone"


def _container_log(uid: str) -> str:
    """The tail of the pod's container log, read through whichever node's containerd holds it
    (node 2's mount namespace has a /var/log/pods of its own)."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if not entry.name.isdigit() or \
                    not (entry / "cmdline").read_bytes().startswith(b"/usr/bin/containerd\0"):
                continue
            for log in sorted((entry / "root/var/log/pods").glob(f"*_{uid}/*/*.log")):
                return "\n".join(log.read_text().splitlines()[-40:])
    return ""


def node_back(t: TwoNodeJob, name: str) -> bool:
    """The node Ready, without the node controller's node-loss taints, and its kubelet's
    Lease renewed within the last lease period's quarter (what the node controller reads)."""
    node = t.k.json("get", "node", name)
    if not node_ready(t, name) or any(
            taint.get("key", "").startswith("node.kubernetes.io/unreachable") or
            taint.get("key", "").startswith("node.kubernetes.io/not-ready")
            for taint in node["spec"].get("taints") or ()):
        return False
    done = t.k("get", "lease", name, "-n", "kube-node-lease", "-o", "json", check=False)
    if done.returncode != 0:  # a node that just registered has none yet
        return False
    lease = json.loads(done.stdout)["spec"]
    renewed = datetime.fromisoformat(lease["renewTime"].replace("Z", "+00:00"))
    return (datetime.now(UTC) - renewed).total_seconds() < lease["leaseDurationSeconds"] / 4 + 1


def node_ready(t: TwoNodeJob, name: str) -> bool:
    node = t.k.json("get", "node", name)
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in node["status"]["conditions"])


def commits(node: NodeCluster, ns: str, job: str) -> tuple[list[dict[str, Any]], str]:
    """(every commit under the job's checkpoint root: dir, step, gen, when its marker was
    written, fenced or not; the `latest` pointer), as the trainers' own catalog reads them."""
    import boto3

    from elastrain_trainer.checkpoint.manifest import COMMIT_MARKER
    from elastrain_trainer.checkpoint.root import scan
    from elastrain_trainer.checkpoint.s3 import S3Storage

    client = boto3.client("s3", **node.s3.client_kwargs)
    root = f"{ns}/{job}"
    storage = S3Storage(f"s3://{node.s3.bucket}/{root}", client=client)
    catalog = scan(storage)
    written: dict[str, float] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=node.s3.bucket,
                                                                 Prefix=f"{root}/"):
        for obj in page.get("Contents", []):
            head, _, name = obj["Key"][len(root) + 1:].rpartition("/")
            if name == COMMIT_MARKER:
                written[head] = obj["LastModified"].timestamp()
    out = [{"dir": c.dir, "step": c.step, "gen": c.gen, "at": written.get(c.dir, 0.0),
            "fenced": False} for c in catalog.commits]
    out += [{"dir": d, "why": why, "fenced": True} for d, why in catalog.damaged.items()]
    return out, storage.read("latest").decode()


def settled_commits(node: NodeCluster, ns: str, job: str) -> tuple[list[dict[str, Any]], str,
                                                                     dict[str, Any]]:
    """commits(), and the newest unfenced commit, read again while `latest` and the newest
    differ (at most 5 reads, 0.5 s apart): the world commits on while the bucket is listed,
    so a commit that lands between the listing and the read of `latest` is no disagreement
    (seen once: `latest` named step 280, listed a moment before as absent). A `latest` that
    names an older commit stays so across the reads."""
    for _ in range(5):
        made, latest = commits(node, ns, job)
        newest = max((c for c in made if not c["fenced"]), key=lambda c: c["at"])
        if latest == newest["dir"]:
            break
        time.sleep(0.5)
    return made, latest, newest



@contextlib.contextmanager
def job_on_two_nodes(operator: NodeCluster, namespace_pool: NamespacePool, job: str, mode: str,
                     ) -> Iterator[TwoNodeJob]:
    """Node 2 with the trainer image, and the job in `mode`: workers 0 and 1 on node 1, worker
    2 on node 2, training at world 3."""
    with added_second_node(operator, images=("pause", "operator", "trainer")) as second:
        k = operator.kubectl
        ns = namespace_pool.take()
        # A grace long enough for a doomed trainer to hold its leave until its replacement (a
        # new pod: its start, torch's import, the model) waits beside it.
        manifest = make_job(job, ns, image=operator.images["trainer"], steps=100_000,
                            replicas=2, grace_seconds=120,
                            s3_endpoint=operator.s3.endpoint_url, bucket=operator.s3.bucket,
                            restartPolicy={"maxRestarts": 6, "backoffSeconds": 1},
                            recovery={"mode": mode},
                            rendezvous={"store": {"nodeSelector": {STORE_NODE: "yes"}}})
        with LogCollector(k, ns, Training.worker_selector(job), ARTIFACTS / job) as logs:
            t = TwoNodeJob(k, ns, job, logs, mode)
            t.node, t.second = operator, second
            try:
                t.store_on(NODE_1)
                t.hold(second.name)
                k.apply(manifest)
                for index in (0, 1):
                    wait_for(f"worker {index} bound to node 1", lambda i=index: t.bound(i, NODE_1),
                             timeout=120)
                t.put_worker_2_on_node_2()
                yield t
            finally:
                save_operator_logs(t, ARTIFACTS / job)
                for name in (NODE_1, second.name):
                    t.release(name)
                    k("label", "node", name, f"{STORE_NODE}-", check=False)
                    k("taint", "node", name, f"{KARPENTER}:NoSchedule-", check=False)
                    k("uncordon", name, check=False)
                namespace_pool.give_back(ns)
