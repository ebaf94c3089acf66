"""Restart mode: a peer that goes dark is found by a heartbeat, not by gloo's collective timeout
(issue 34; docs/recovery.md section 8, "Restart mode").

A rank whose peer went dark without closing its sockets (a partition, a frozen or hung host)
waits in its collective for the whole collective timeout (5 minutes): gloo has no abort, and
only a closed socket ends the wait early. In Restart mode every lost peer restarts the whole
worker group anyway (torchrun's rendezvous, then the resume from the newest checkpoint), so a
rank need not be released from that wait: it ends its process with the lost-peer exit code
(EXIT_RESTART), which also closes its own sockets, so every other rank blocked on it fails at
once; its launcher then rendezvouses again, and the dark node is left out once its keep-alive
lapses (spec.rendezvous keepAliveIntervalSeconds x keepAliveMaxAttempts).

Each rank beats on the job's rendezvous store (PET_RDZV_ENDPOINT: the store pod, which outlives
every worker, where a rank-0-hosted store would go dark with rank 0) under the prefix of its
group's incarnation (a nonce rank 0 draws and broadcasts when the group forms), and judges its
two ring neighbours with `membership.Liveness` on its own clock: silent for
ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS (5 s by default) is dark. A slow step never is (the beat is
this thread's, whatever the training thread does); a rank that cannot reach the store judges
nobody (its silence is its own).

The dark pod is told to the operator (issue 34, item 4): before it ends its process, the rank
that judged a peer dark marks the peer's pod (ELASTRAIN_POD_NAME, which the operator renders)
on the job's store; when the next group forms, rank 0 reads the marks of the pods it does
not hold (and drops those it holds: a pod that came back), and every member reports them as
planned out (`/progress` plannedOut, aged from the group's start by its own clock), as in-process
members report their plan's lost pods. A frozen or cut-off pod's node can stay Ready and its pod
Running for ever: only this tells the operator to count it and replace it.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import cast

import torch.distributed as dist

from elastrain_trainer import metrics
from elastrain_trainer.events import emit
from elastrain_trainer.inprocess.heartbeat import BEATS_PER_TIMEOUT, DEFAULT_TIMEOUT_S
from elastrain_trainer.inprocess.membership import Liveness
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.session.restart_fence import STORE_RUN, RestartFence, claim_generation
from elastrain_trainer.signals import EXIT_RESTART

ENDPOINT_ENV = "PET_RDZV_ENDPOINT"
TIMEOUT_ENV = "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS"
POD_NAME_ENV = "ELASTRAIN_POD_NAME"
# Under STORE_RUN: {pod: the generation of the group it went dark in}, as JSON. Kept to the
# newest MAX_MARKS: a mark outlives its pod (replaced under a new name), and is then harmless.
DARK_KEY = "dark"
MAX_MARKS = 32


def mark_dark(store: MembershipStore, pods: Iterable[str], gen: int) -> None:
    """Mark `pods` as gone dark from the group of generation `gen`."""
    pods = list(pods)
    _update_marks(store, lambda marks: {**marks, **dict.fromkeys(pods, gen)})


def out_of_group(store: MembershipStore, group: Collection[str]) -> list[str]:
    """The pods marked dark that `group` (the forming group's pods) does not hold; the marks
    of those it holds are dropped (they came back)."""
    return sorted(_update_marks(store, lambda marks: {p: g for p, g in marks.items()
                                                      if p not in group}))


def _update_marks(store: MembershipStore,
                  change: Callable[[dict[str, int]], dict[str, int]]) -> dict[str, int]:
    """Read, change and write the marks atomically (compare-and-set: two neighbours of one
    dark rank mark it at the same moment)."""
    for _ in range(50):
        raw = bytes(store.kv.get(DARK_KEY)).decode() if store.kv.check([DARK_KEY]) else ""
        marks = {str(p): int(g) for p, g in json.loads(raw).items()} if raw else {}
        new = dict(sorted(change(marks).items(), key=lambda kv: kv[1])[-MAX_MARKS:])
        if new == marks:
            return new
        text = json.dumps(new)
        if bytes(store.kv.compare_set(DARK_KEY, raw, text)) == text.encode():
            return new
    raise RuntimeError("the dark marks kept changing under this writer")


class DarkPeerWatch:
    """`connect()`: a client of the job's store under this group's prefix; `exit`: what ends
    the process (os._exit)."""

    def __init__(self, connect: Callable[[], MembershipStore], rank: int, world_size: int, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 exit: Callable[[int], None] = os._exit,
                 pods: Sequence[str] = (),
                 mark: Callable[[list[str]], None] | None = None) -> None:
        self._connect, self.rank = connect, rank
        # The pod of each rank, and what marks pods dark on the job's store (mark_dark).
        self.pods, self._mark = list(pods), mark
        # Its ring neighbours only (the store serves 2 reads per rank and beat, not N): once a
        # neighbour of the dark rank ends its process, its closed sockets fail the collectives
        # of every rank waiting on it, and torchrun's agents restart the whole group.
        self.peers = sorted({str((rank + d) % world_size) for d in (-1, 1)} - {str(rank)},
                            key=int)
        self.timeout_s, self.interval_s = timeout_s, timeout_s / BEATS_PER_TIMEOUT
        self._exit = exit
        self.fence: RestartFence | None = None  # this group's (start_dark_peer_watch)
        self._judging = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastrain-dark-peers",
                                        daemon=True)

    def start(self) -> DarkPeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def quiet(self) -> None:
        """The training loop ended (finished, or a stop agreed at a step boundary): judge
        nobody from now on, but beat on until the process ends. Ranks leave at slightly
        different times (the coordinator commits the last save after the others are done),
        and a rank whose neighbour had already ended must not take the end for darkness."""
        self._judging = False

    def _run(self) -> None:
        store: MembershipStore | None = None
        liveness = Liveness(self.timeout_s)
        looked = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                store = store or self._connect()
                store.beat(str(self.rank))
                counters = store.heartbeats(self.peers)
            except Exception:  # the store away: judge nobody, start over once it answers
                store, liveness = None, Liveness(self.timeout_s)
                continue
            now = time.monotonic()
            if now - looked >= self.timeout_s:
                # This process was itself stopped (a frozen host, now thawed): the peers'
                # silence over that time is not theirs. Judge from now on; a group that went
                # on without this worker is gone for good, so the silence comes again.
                liveness = Liveness(self.timeout_s)
            looked = now
            liveness.observe(counters, now)
            if self._judging and (dark := sorted(liveness.dead(now), key=int)):
                emit("dark_peer", rank=self.rank, peers=[int(p) for p in dark],
                     silent_s=self.timeout_s,
                     action="restart the worker group (a peer went dark: no socket closed)")
                self._tell(dark)
                self._exit(EXIT_RESTART)
                return

    def _tell(self, dark: Iterable[str]) -> None:
        """Mark the dark ranks' pods for the next group to report (not this rank's own)."""
        own = self.pods[self.rank] if self.rank < len(self.pods) else ""
        names = sorted({self.pods[int(p)] for p in dark if int(p) < len(self.pods)}
                       - {"", own})
        if not names or self._mark is None:
            return
        try:
            self._mark(names)
        except Exception as e:  # the group re-forms anyway; the operator then sees no mark
            emit("dark_peer_unmarked", pods=names, error=str(e)[:200])


def start_dark_peer_watch(rank: int, world_size: int, group: dist.ProcessGroup,
                          env: Mapping[str, str] = os.environ) -> DarkPeerWatch | None:
    """The watch of a torchrun worker group of more than one rank (collective: every rank of
    `group` calls it once the group formed), with the group's checkpoint fence
    (`watch.fence`, session.restart_fence); None outside torchrun's rendezvous."""
    endpoint = env.get(ENDPOINT_ENV, "")
    host, _, port = endpoint.rpartition(":")
    if world_size < 2 or not host or not port.isdigit():
        return None
    timeout_s = float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))

    def client(run: str) -> MembershipStore:
        return MembershipStore.connect(host, int(port), run,
                                       timeout=timedelta(seconds=timeout_s),
                                       connect_within=timedelta(seconds=timeout_s / 5))

    # The pod's name (the operator renders it; a worker's HOSTNAME is its stable hostname,
    # the same for every attempt of its slot).
    pod = env.get(POD_NAME_ENV) or env.get("HOSTNAME", "")
    pods: list[object] = [None] * world_size
    dist.all_gather_object(pods, pod, group=group)
    group_pods = [str(p or "") for p in pods]
    # [the watch's prefix, the store's epoch, this group's generation, the pods marked dark
    # and not in it] from rank 0
    formed: list[object] = [uuid.uuid4().hex, "", 0, []] if rank == 0 else ["", "", 0, []]
    if rank == 0:
        try:
            store = client(STORE_RUN)
            formed[1], formed[2] = claim_generation(store, pod)
        except Exception as e:  # unfenced (as before), the bucket's rule still applies
            emit("checkpoint_fence_unavailable", error=str(e)[:200],
                 note="this worker group's commits are not checked against the store")
        else:
            try:
                formed[3] = out_of_group(store, set(group_pods) - {""})
            except Exception as e:  # the operator is not told of a dark pod this time
                emit("dark_marks_unavailable", error=str(e)[:200])
    dist.broadcast_object_list(formed, src=0, group=group)
    nonce, epoch, gen = str(formed[0]), str(formed[1]), int(str(formed[2]))
    out = [str(p) for p in cast(list[str], formed[3])]
    metrics.record_world_pods(sorted(set(group_pods) - {""}), ())
    metrics.record_planned_out(out)
    if out and rank == 0:
        emit("planned_out", pods=out, generation=gen,
             note="pods an earlier group found dark are not in this one: the operator "
                  "replaces them")
    watch = DarkPeerWatch(lambda: client(f"restart-{nonce}"), rank, world_size,
                          timeout_s=timeout_s, pods=group_pods,
                          mark=lambda names: mark_dark(client(STORE_RUN), names, gen))
    watch.fence = RestartFence(lambda: client(STORE_RUN), epoch, gen) if gen else None
    return watch.start()
