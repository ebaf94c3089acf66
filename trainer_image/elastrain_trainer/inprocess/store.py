"""The job's store as the membership protocol sees it: one adapter over a TCPStore client.

Every key is membership's, under `elastrain/<run_id>/`. A TCPStore client is one socket, so a
thread that needs the store (the heartbeat) opens its own `MembershipStore` with `connect`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from elastrain_trainer.inprocess import membership as m
from elastrain_trainer.inprocess.membership import Plan

# One wait on the store; callers loop and re-check liveness and `done` between waits.
WAIT = timedelta(seconds=30)


class MembershipStore:
    def __init__(self, store: Store, run_id: str) -> None:
        self.raw = store
        self.run_id = run_id
        self.kv = PrefixStore(m.store_prefix(run_id), store)

    @classmethod
    def connect(cls, host: str, port: int, run_id: str,
                timeout: timedelta = timedelta(seconds=60),
                connect_within: timedelta | None = None) -> MembershipStore:
        """A client; `timeout` bounds each later request. `connect_within` bounds the connect
        alone (default: `timeout`): TCPStore retries a failed connect with a backoff that grows
        to seconds, so a reconnect that starts while the port answers but the store does not
        (a proxy or Service in front of a store that is gone) would otherwise come back only
        seconds after the store did, or a minute later."""
        client = TCPStore(host, port, is_master=False, timeout=connect_within or timeout,
                          use_libuv=True)
        if connect_within is not None:
            client.set_timeout(timeout)
        return cls(client, run_id)

    @staticmethod
    def reachable(host: str, port: int, timeout_s: float = 0.5) -> bool:
        """Whether the store's port accepts a connection (a cheap probe before a client, whose
        connect retries for its whole timeout and logs each try)."""
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return True
        except OSError:
            return False

    # -- the store's incarnation (docs/recovery.md section 7) ----------------------------
    def epoch(self) -> m.Epoch | None:
        if not self.kv.check([m.EPOCH_KEY]):
            return None
        return m.Epoch.parse(self.kv.get(m.EPOCH_KEY).decode())

    def claim_epoch(self, candidate: m.Epoch) -> m.Epoch:
        """This store's incarnation: the first claim wins, later ones read the winner's."""
        return self._swap_epoch("", candidate)

    def replace_epoch(self, old: m.Epoch, new: m.Epoch) -> m.Epoch:
        """`new` if the claim is still `old` (else whatever replaced it first)."""
        return self._swap_epoch(old.text(), new)

    def _swap_epoch(self, expected: str, new: m.Epoch) -> m.Epoch:
        return m.Epoch.parse(bytes(self.kv.compare_set(m.EPOCH_KEY, expected,
                                                       new.text())).decode())

    def restore(self, plan: Plan) -> bool:
        """The store came back empty: the current generation again, its number and its plan.
        Only into a store that has no generation yet (compare_set): a world's coordinator
        that was dark while the rest of its world restored and moved on must not put its
        stale generation back. Whether it did."""
        got = self.kv.compare_set(m.GEN_KEY, "", str(plan.gen))
        if bytes(got).decode() != str(plan.gen):
            return False
        self.publish(plan)
        return True

    # -- registration and heartbeat ------------------------------------------------------
    def register(self, node_id: str, info: dict[str, Any]) -> None:
        self.kv.set(m.node_key(node_id), json.dumps(info))

    def beat(self, node_id: str) -> int:
        return int(self.kv.add(m.heartbeat_key(node_id), 1))

    def heartbeats(self, nodes: Iterable[str]) -> dict[str, int | None]:
        """Each node's counter; a node that never beat reads 0. Two requests however many
        nodes are watched (every rank of a job beats, and a pod of 8 ranks is 8 counters): a
        check that every counter exists, then one multi_get (a get of a missing key would
        wait for it). Counters are never deleted, so only a node that has not beaten yet makes
        this read each one with `add(key, 0)`, which creates it."""
        names = list(dict.fromkeys(nodes))
        keys = [m.heartbeat_key(n) for n in names]
        if keys and self.kv.check(keys):
            return {n: int(v) for n, v in zip(names, self.kv.multi_get(keys), strict=True)}
        return {n: int(self.kv.add(k, 0)) for n, k in zip(names, keys, strict=True)}

    def announce_rejoin(self, pod: str, gen: int) -> None:
        self.kv.set(m.rejoin_key(pod), str(gen))

    def rejoins(self, pods: Iterable[str]) -> dict[str, int]:
        """Each pod's newest rejoin announcement (the generation it found itself out of), for
        the pods that made one."""
        return {p: int(self.kv.get(m.rejoin_key(p))) for p in pods
                if self.kv.check([m.rejoin_key(p)])}

    # -- change requests -----------------------------------------------------------------
    def pending(self) -> int:
        return int(self.kv.add(m.PENDING_KEY, 0))

    def request_leave(self, node_id: str, step: int) -> None:
        self.kv.set(m.leave_key(node_id), json.dumps({"step": step}))
        self.kv.add(m.PENDING_KEY, 1)

    def desired(self) -> int | None:
        """The world the operator last asked for (a node that heard it wrote it), if any."""
        return int(self.kv.get(m.DESIRED_KEY)) if self.kv.check([m.DESIRED_KEY]) else None

    def record_desired(self, replicas: int) -> None:
        self.kv.set(m.DESIRED_KEY, str(replicas))

    def request_desired(self, replicas: int) -> None:
        """A new desired world: written, then `pending` bumped so the coordinator plans it."""
        self.record_desired(replicas)
        self.kv.add(m.PENDING_KEY, 1)

    def leaving(self, nodes: Iterable[str]) -> frozenset[str]:
        return frozenset(n for n in nodes if self.kv.check([m.leave_key(n)]))

    def request_join(self, node_id: str) -> int:
        """Number this node's join request, then announce it (written before the bump, so a
        coordinator that sees the new `pending` finds the request)."""
        seq = int(self.kv.add(m.JOIN_SEQ_KEY, 1))
        self.kv.set(m.join_key(seq), node_id)
        self.kv.add(m.PENDING_KEY, 1)
        return seq

    def joins_after(self, seq: int) -> tuple[int, list[str]]:
        """Join requests numbered above `seq`, and the newest number."""
        last = int(self.kv.add(m.JOIN_SEQ_KEY, 0))
        nodes = [self.kv.get(m.join_key(i)).decode() for i in range(seq + 1, last + 1)]
        return last, nodes

    # -- generations ---------------------------------------------------------------------
    def generation(self) -> int:
        return int(self.kv.get(m.GEN_KEY)) if self.kv.check([m.GEN_KEY]) else 0

    def try_advance(self, gen: int) -> bool:
        """Win generation gen + 1 (compare_set: exactly one would-be coordinator wins)."""
        expected = str(gen) if gen > 0 else ""
        got = self.kv.compare_set(m.GEN_KEY, expected, str(gen + 1))
        return bytes(got).decode() == str(gen + 1)

    def publish(self, plan: Plan) -> None:
        self.kv.set(m.plan_key(plan.gen), plan.to_json())

    def has_plan(self, gen: int) -> bool:
        return self.kv.check([m.plan_key(gen)])

    def read_plan(self, gen: int) -> Plan:
        return Plan.from_json(self.kv.get(m.plan_key(gen)))

    def wait_plan(self, gen: int, timeout_s: float) -> Plan | None:
        """The plan of `gen`, polled (a store wait cannot be interrupted to re-check peers)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.has_plan(gen):
                return self.read_plan(gen)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def ack(self, gen: int, node_id: str, step: int) -> None:
        self.kv.set(m.ack_key(gen, node_id), json.dumps({"step": step}))

    def arrive(self, gen: int, node_id: str) -> None:
        self.kv.set(m.arrive_key(gen, node_id), "1")

    def arrived(self, gen: int, nodes: Iterable[str]) -> frozenset[str]:
        return frozenset(n for n in nodes if self.kv.check([m.arrive_key(gen, n)]))

    def report(self, gen: int, node_id: str, step: int) -> None:
        self.kv.set(m.report_key(gen, node_id), json.dumps({"step": step}))

    def reports(self, gen: int, nodes: Iterable[str]) -> dict[str, int]:
        out = {}
        for n in nodes:
            if self.kv.check([m.report_key(gen, n)]):
                out[n] = int(json.loads(self.kv.get(m.report_key(gen, n)))["step"])
        return out

    def saved(self, gen: int, node_id: str) -> None:
        self.kv.set(m.saved_key(gen, node_id), "1")

    def saved_by(self, gen: int, nodes: Iterable[str]) -> frozenset[str]:
        return frozenset(n for n in nodes if self.kv.check([m.saved_key(gen, n)]))

    def publish_listeners(self, gen: int, node_id: str, text: str) -> None:
        self.kv.set(m.listen_key(gen, node_id), text)

    def listeners(self, gen: int, nodes: Iterable[str]) -> dict[str, str]:
        """What each of the `nodes` that published under `gen` published."""
        keys = {n: m.listen_key(gen, n) for n in nodes}
        return {n: self.kv.get(k).decode() for n, k in keys.items() if self.kv.check([k])}

    def mark_failed(self, gen: int, node_id: str, error: str) -> None:
        """The first writer wins; later ones leave its record."""
        record = json.dumps({"node_id": node_id, "error": error[:300]})
        self.kv.compare_set(m.failed_key(gen), "", record)

    def failed(self, gen: int) -> bool:
        return self.kv.check([m.failed_key(gen)])

    def pg_store(self, gen: int) -> Store:
        return PrefixStore(m.pg_prefix(gen), self.kv)

    def finish(self, step: int) -> None:
        self.kv.set(m.DONE_KEY, json.dumps({"step": step}))

    def done(self) -> bool:
        return self.kv.check([m.DONE_KEY])

    def forget(self, gen: int, nodes: Iterable[str]) -> None:
        """Best effort: generation `gen`'s keys (the coordinator calls it two generations on)."""
        keys = [m.plan_key(gen), m.failed_key(gen)]
        keys += [k for n in nodes
                 for k in (m.ack_key(gen, n), m.report_key(gen, n), m.arrive_key(gen, n),
                           m.listen_key(gen, n))]
        with contextlib.suppress(RuntimeError):  # a stop's savers, when it was one
            if self.has_plan(gen):  # (a get of a missing key waits for the store's timeout)
                keys += [m.saved_key(gen, n) for n in self.read_plan(gen).saving]
        for key in keys:
            with contextlib.suppress(RuntimeError):
                self.kv.delete_key(key)
