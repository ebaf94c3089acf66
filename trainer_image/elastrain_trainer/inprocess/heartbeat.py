"""No-notice detection on the job's store (docs/recovery.md section 8): a thread per node.

Every `interval_s` it bumps this node's counter, reads the counters of the nodes it watches and
judges them with `membership.Liveness` on its own clock (a counter that has not moved for
`timeout_s` is dead: 5 s by default, `spec.recovery.heartbeatTimeoutSeconds`). A dead peer marks
the current generation failed (`gen/<g>/failed`), which is what every other node's thread
watches.

It beats every timeout/20. A watcher measures a silence from the tick at which it first saw the
last beat, and the beat before a pause came up to one interval before the pause: a node paused
for 0.8 of the timeout (a stop-the-world pause, a frozen cgroup) reads as up to 0.8 of it plus
an interval plus the time it takes to beat again once it runs. At /20 that leaves 0.15 of the
timeout (0.75 s of the default 5) for the latter; at /5 nothing.

On a failed generation (judged here, or by any node) the thread calls `on_failed(gen, store)`
once: the member severs its own sockets of that generation's groups (`inprocess.sever`), which
is what ends a collective blocked on a peer that went dark without closing its sockets (a
killed process's kernel closes them itself: gloo fails at once then).

While the store answers, it also reads what the peers of the current generation published for
the sever (their listeners), so a sever after the store went dark with a peer (a store's node
that hosts a worker too, replaced by an empty store) still finds every pair.

A tick's requests are waited for at most twice the timeout (inprocess.store_client): a store
that answers nothing (its node dark, its process frozen) is lost to this node then, as one that
refuses is at once. A tick that comes more than the timeout after the previous one judges
nobody on what it read: the silence it would see was this node's own.

It also watches the pods the plan names lost (planned out without notice, not back since;
section 10) for a sign of life: a dropped node that finds itself out of the plan announces
its pod's rejoin before its process ends to be restarted in place (`rejoin/<pod>`: the
generation it found itself out of). A new announcement, of that generation or a later one
than this node first saw the pod lost in, calls `on_rejoin(pod)` once: the member's /progress
then gives the pod more time before the operator replaces it (metrics.record_rejoining),
since a thawed or reconnected pod's restart (a new process, torch imported again) can take
longer than the grace on a loaded node, and a pod replaced meanwhile would lose its rejoin.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

from elastrain_trainer.events import emit
from elastrain_trainer.inprocess.membership import Epoch, Liveness
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.inprocess.store_client import BoundedCalls

DEFAULT_TIMEOUT_S = 5.0
MIN_TIMEOUT_S = 2.0
BEATS_PER_TIMEOUT = 20
# Once a collective has failed (a peer is gone for sure), a node that neither reported its step
# nor beat for this share of the timeout is planned without (3 s of the default 5): a live node
# beats many times meanwhile, even on a loaded machine. A live node misjudged so only pays a
# rejoin (it finds itself out of the plan and restarts in place); waiting for the full timeout
# would cost every survivor the whole timeout on every loss without notice.
FAILED_SILENCE_SHARE = 0.6


class Heartbeat:
    """`connect(connect_within)`: a client of the job's store; its connect bounded by
    `connect_within` when given (a reconnect tries for one beat, then probes again)."""

    def __init__(self, connect: Callable[[timedelta | None], MembershipStore], node_id: str, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 probe: Callable[[], bool] = lambda: True,
                 claim: Callable[[], Epoch | None] = lambda: None,
                 on_failed: Callable[[int, MembershipStore], None] = lambda gen, store: None,
                 on_rejoin: Callable[[str], None] = lambda pod: None,
                 learn: Callable[[int, MembershipStore], bool] = lambda gen, store: True,
                 ) -> None:
        if timeout_s < MIN_TIMEOUT_S:
            raise ValueError(f"heartbeat timeout {timeout_s} s: at least {MIN_TIMEOUT_S} s")
        self._connect, self.node_id = connect, node_id
        self.timeout_s, self.interval_s = timeout_s, timeout_s / BEATS_PER_TIMEOUT
        # How long a connect to the store may take before this thread probes again.
        self.beat = timedelta(seconds=timeout_s / 5)
        self._lock = threading.Lock()
        self._gen, self._watched = 0, frozenset[str]()
        self._spares = frozenset[str]()  # observed, never failing a generation
        # Lost pods -> the generation this node first saw each lost in; and the announcement
        # of each that on_rejoin was called for.
        self._lost: dict[str, int] = {}
        self._rejoins: dict[str, int] = {}
        self._on_rejoin = on_rejoin
        self._liveness = Liveness(timeout_s)
        self._failed_gen = 0
        self._stop = threading.Event()
        # Each tick's requests (and a reconnect's) waited for at most twice the timeout: a
        # store that does not answer (its node dark, its process frozen) is lost to this node
        # then, as one that refuses is at once; TCPStore's own timeouts never end such a wait.
        self._calls = BoundedCalls(2 * timeout_s, "elastrain-heartbeat-store")
        self._thread = threading.Thread(target=self._run, name="elastrain-heartbeat",
                                        daemon=True)
        self.errors = 0
        # The store lost (section 7): training goes on; this thread probes the store's port
        # each beat and reconnects once it answers (`reconnects` counts it, for the training
        # thread's client).
        self._probe = probe
        # What this node claims a store that came back with (section 7): a node of a live
        # world claims it at once, before any fresh node may found it.
        self._claim = claim
        self.lost = False
        self.reconnects = 0
        # When this thread last heard the store (monotonic): a tick whose requests all came
        # back. The training thread follows a store it gave up on once this moves past that.
        self._answered_at = time.monotonic()
        self._on_failed = on_failed
        self._severed_gen = 0
        # What the sever needs of the store, read ahead (sever.Held.learn): each tick until
        # every peer's is there, then once a timeout.
        self._learn = learn
        self._learned: tuple[int, float] = (0, 0.0)  # the generation and when, if complete

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> Heartbeat:
        self._store = self._connect(None)
        self._store.beat(self.node_id)
        self._answered_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def watch(self, gen: int, nodes: Iterable[str], spares: Iterable[str] = (),
              lost: Iterable[str] = ()) -> None:
        """Watch `nodes` (liveness restarts for nodes not watched before) in generation `gen`;
        observe `spares` too, whose silence fails nothing: the next plan leaves them out; and
        the `lost` pods' rejoin announcements."""
        with self._lock:
            self._gen = gen
            self._watched = frozenset(nodes) - {self.node_id}
            self._spares = frozenset(spares) - {self.node_id}
            self._lost = {p: self._lost.get(p, gen) for p in lost}

    def dead_spares(self) -> frozenset[str]:
        return self._silent_for(self.timeout_s) & self._spares

    def dead(self) -> frozenset[str]:
        return self._silent_for(self.timeout_s) & self._watched

    def silent(self) -> frozenset[str]:
        """Watched nodes silent for FAILED_SILENCE_SHARE of the timeout: dead, once a
        collective of theirs has failed."""
        return self._silent_for(FAILED_SILENCE_SHARE * self.timeout_s) & self._watched

    def _silent_for(self, bound_s: float) -> frozenset[str]:
        """Observed nodes whose counter has not moved for `bound_s`. While this node has lost
        the store it sees no beat at all: it judges nobody (their silence is its own), and once
        it reconnects each peer is judged from then on (_reconnect); the collective timeout
        still bounds a peer that is gone meanwhile. Before, a node whose heartbeat had not yet
        reconnected found every peer silent and failed the next generation's entry."""
        with self._lock:
            if self.lost:
                return frozenset()
            return self._liveness.dead(time.monotonic(), bound_s)

    def unanswered_s(self) -> float | None:
        """Seconds since this thread last heard the store (None before it started): what the
        node's /progress tells the operator, which replaces a store that every trainer it asks
        has not heard for two heartbeat timeouts (its node dark, its process frozen) without
        waiting for the node to be marked lost (operator policy.store)."""
        if not self.started:
            return None
        with self._lock:
            return time.monotonic() - self._answered_at

    def answered_after(self, moment: float) -> bool:
        """Whether this thread heard the store after `moment` (monotonic)."""
        with self._lock:
            return self._answered_at > moment

    def generation_failed(self) -> bool:
        with self._lock:
            return self._failed_gen == self._gen > 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.lost and not self._reconnect():
                continue
            try:
                self._calls.call(self._tick)
            except Exception as e:  # the store lost: train on, reconnect later (section 7)
                self.errors += 1
                if not self.lost:
                    with self._lock:
                        self.lost = True
                    emit("store_lost", node=self.node_id, error=f"{type(e).__name__}: "
                                                               f"{' '.join(str(e).split())[:200]}")

    def _reconnect(self) -> bool:
        if not self._probe():
            return False
        try:
            self._store, claim, epoch = self._calls.call(self._connect_and_claim)
        except Exception:
            return False
        with self._lock:
            self._liveness = Liveness(self.timeout_s)
            self._answered_at = time.monotonic()
            self.lost = False
        self.reconnects += 1
        emit("store_back", node=self.node_id,
             epoch=epoch.text() if epoch is not None else None,
             claimed=epoch is not None and epoch == claim)
        return True

    def _connect_and_claim(self) -> tuple[MembershipStore, Epoch | None, Epoch | None]:
        """A new client, and the store's epoch after this node's claim (None: no claim)."""
        store = self._connect(self.beat)
        claim = self._claim()
        return store, claim, store.claim_epoch(claim) if claim is not None else None

    def _tick(self) -> None:
        """On the calls' worker (BoundedCalls): one given up while its store did not answer
        changes nothing when the answer comes after all."""
        self._store.beat(self.node_id)
        with self._lock:
            gen, watched, spares = self._gen, self._watched, self._spares
        counters = self._store.heartbeats(watched | spares)
        failed = gen > 0 and self._store.failed(gen)
        now = time.monotonic()
        if not self._calls.on_current_worker():
            return
        with self._lock:
            if now - self._answered_at > self.timeout_s:
                # This node heard nothing for longer than the timeout (the store did not
                # answer, or this process was paused): its peers' silence was its own. Judge
                # each from now on, as after a reconnect.
                self._liveness = Liveness(self.timeout_s)
            self._answered_at = now
            self._liveness.observe(counters, now)
            dead = self._liveness.dead(now) & watched
            if failed:
                self._failed_gen = gen
        if dead and gen > 0 and not failed:
            self._store.mark_failed(gen, self.node_id, f"heartbeat: {sorted(dead)} silent "
                                                       f"for {self.timeout_s} s")
            failed = True
        if failed and gen != self._severed_gen:
            self._severed_gen = gen
            try:
                self._on_failed(gen, self._store)
            except Exception as e:  # not the store's loss: the collective timeout still bounds
                emit("sever_failed", node=self.node_id, gen=gen,
                     error=f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
        self._watch_rejoins()  # after the sever: nothing delays a release
        learned_gen, learned_at = self._learned
        if gen > 0 and not failed and (gen != learned_gen or now - learned_at > self.timeout_s):
            self._learned = (gen, now) if self._learn(gen, self._store) else (0, 0.0)

    def _watch_rejoins(self) -> None:
        with self._lock:
            lost = dict(self._lost)
        if not lost:
            return
        for pod, gen in self._store.rejoins(lost).items():
            if gen >= lost[pod] and self._rejoins.get(pod) != gen:
                self._rejoins[pod] = gen
                emit("peer_rejoining", node=self.node_id, peer=pod, gen=gen)
                self._on_rejoin(pod)
