"""Membership, pure: the store's key names, the plan of a generation change, liveness.

Nothing here talks to a store or a process group (docs/recovery.md sections 2, 3 and 6); the
adapter (`inprocess.store`) reads the keys, and `plan_generation` decides from what it read.

Unit of membership: a node is one rank's process; a pod's launcher runs `ranks_per_node` of
them (nprocPerNode), named <pod>[.<restart>]/<local rank> when there are several. A plan admits,
keeps and drops a launcher's local ranks together (a "unit": one member of the world as the
operator and spec.replicas count it), so a pod never trains with some of its ranks, and the
world's sizes (min, max, desired) count units. A generation is one process group: its members,
their ranks (a unit's contiguous, in local-rank order), the step it starts at, which joiner is
healed from which survivor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Keys, relative to store_prefix(run_id). Values are JSON unless noted.
EPOCH_KEY = "epoch"      # the store's incarnation (section 7)
GEN_KEY = "gen"          # the current generation (int as text); won by compare_set
PENDING_KEY = "pending"  # a counter bumped with each change request (add)
JOIN_SEQ_KEY = "join/seq"  # a counter: join requests are numbered (a store cannot list keys)
DONE_KEY = "done"        # {"step"}: training finished; waiting joiners exit 0
DESIRED_KEY = "desired"  # the world the operator wants (spec.replicas), with spares (section 9)

# "resize": only the desired world changed (a spare taken in or a member set aside as one).
REASONS = ("start", "leave", "join", "fail", "stop", "resize")


@dataclasses.dataclass(frozen=True)
class Epoch:
    """A store incarnation's claim (docs/recovery.md section 7). An empty store is either the
    job's first or one that came back empty while a world trains; who claims it says which.
    `kept`: a node of a live world claimed it, and that world restores its generation into it;
    otherwise a fresh node founded it, after waiting for such a claim in vain, and no world
    may restore into it (its survivors end their pods instead: two worlds of one job never
    train side by side)."""

    kept: bool
    node: str
    nonce: str

    def text(self) -> str:
        return f"{'keep' if self.kept else 'found'}:{self.node}:{self.nonce}"

    @classmethod
    def parse(cls, text: str) -> Epoch:
        kind, _, rest = text.partition(":")
        node, _, nonce = rest.rpartition(":")
        if kind not in ("keep", "found") or not node or not nonce:
            raise ValueError(f"not an epoch claim: {text!r}")
        return cls(kind == "keep", node, nonce)


def store_prefix(run_id: str) -> str:
    """Every key of a job lives under this prefix of the job's store."""
    if not run_id:
        raise ValueError("in-process recovery needs a run id (ELASTRAIN_RUN_ID)")
    return f"elastrain/{run_id}/"


def node_key(node_id: str) -> str:
    return f"node/{node_id}"


def heartbeat_key(node_id: str) -> str:
    return f"hb/{node_id}"


def leave_key(node_id: str) -> str:
    return f"leave/{node_id}"


def join_key(seq: int) -> str:
    """The node_id of join request number `seq` (1-based, from JOIN_SEQ_KEY)."""
    return f"join/{seq}"


def rejoin_key(pod: str) -> str:
    """The generation whose plan a live pod found itself planned out of (set by that pod's
    dropped node on its way to a restart in place): the pod is alive and rejoining."""
    return f"rejoin/{pod}"


def plan_key(gen: int) -> str:
    return f"gen/{gen}/plan"


def ack_key(gen: int, node_id: str) -> str:
    return f"gen/{gen}/ack/{node_id}"


def arrive_key(gen: int, node_id: str) -> str:
    """A node of generation `gen`'s plan is about to init its process group (section 4)."""
    return f"gen/{gen}/arrive/{node_id}"


def report_key(gen: int, node_id: str) -> str:
    """A survivor of generation `gen`'s failure: its committed step (no-notice path)."""
    return f"gen/{gen}/report/{node_id}"


def saved_key(gen: int, node_id: str) -> str:
    """A node of a stop generation's old group has saved and left it (section 3, "stop")."""
    return f"gen/{gen}/saved/{node_id}"


def listen_key(gen: int, node_id: str) -> str:
    """The gloo listeners (JSON ["ip:port", ...]) node_id's groups of generation gen made."""
    return f"gen/{gen}/listen/{node_id}"


def failed_key(gen: int) -> str:
    return f"gen/{gen}/failed"


def pg_prefix(gen: int) -> str:
    """The process group of generation `gen` (old generations' keys are never reused)."""
    return f"gen/{gen}/pg/"


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What bounds a generation's world: the global batch is fixed for the whole job."""

    global_batch: int
    micro_batch: int
    max_world: int                  # units (pods): a world of w units has w * ranks_per_node
    min_world: int = 1              # units
    ranks_per_node: int = 1

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks per node {self.ranks_per_node}: need >= 1")
        if self.micro_batch < 1 or self.global_batch < self.micro_batch:
            raise ValueError(f"global batch {self.global_batch} and micro batch "
                             f"{self.micro_batch}: need 1 <= micro <= global")
        if not 1 <= self.min_world <= self.max_world:
            raise ValueError(f"world sizes: need 1 <= min {self.min_world} <= max "
                             f"{self.max_world}")


@dataclasses.dataclass(frozen=True)
class Requests:
    """What the coordinator read from the store at a change.

    `joining` in request order; `dead` judged by liveness or a failed collective; `steps` each
    reporting node's committed step (the no-notice path; empty with notice: every member is at
    the same step boundary)."""

    step: int
    leaving: frozenset[str] = frozenset()
    joining: tuple[str, ...] = ()
    dead: frozenset[str] = frozenset()
    steps: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One generation: who trains, at which rank, from which step; who heals from whom."""

    gen: int
    step: int
    world_size: int
    nodes: tuple[str, ...]            # in rank order
    heal: Mapping[str, str]           # node -> the live node it receives the state from
    reason: str
    global_batch: int
    accum: int
    spares: tuple[str, ...] = ()      # available nodes beyond the world size: they keep waiting
    pending: int = 0                  # the store's `pending` counter this plan answered
    join_seq: int = 0                 # the last join request this plan read
    # A stop: the old group's nodes, which save `step` before they end. The next start waits
    # for each to have saved or died, so it resumes from that save, not from an older one.
    saving: tuple[str, ...] = ()
    # Pods (not nodes: a pod restarted in place comes back as node <pod>.<n>) planned out
    # without notice in this or an earlier generation and not back since, oldest first: what
    # members tell the operator, which replaces such a pod (docs/recovery.md section 10).
    lost: tuple[str, ...] = ()
    # The store incarnation that founded this line of generations (its Epoch.text()): every
    # plan after it carries it on, through stores kept and restored (section 7), so the
    # generations of one lineage compare across those stores, and commits record it for the
    # bucket's fence (checkpoint/catalog.py). "": a plan from before lineages.
    lineage: str = ""

    def rank_of(self, node_id: str) -> int | None:
        return self.nodes.index(node_id) if node_id in self.nodes else None

    @property
    def coordinator(self) -> str:
        return self.nodes[0]

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "ranks": {n: i for i, n in
                                                                  enumerate(self.nodes)}})

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        raw: dict[str, Any] = json.loads(text)
        raw.pop("ranks", None)
        return cls(**{**raw, "nodes": tuple(raw["nodes"]), "spares": tuple(raw["spares"]),
                      "saving": tuple(raw.get("saving", ())), "heal": dict(raw["heal"]),
                      "lost": tuple(raw.get("lost", ()))})


class NoQuorumError(RuntimeError):
    """Too few live nodes for min_world (or for any split of the global batch)."""


def choose_world_size(available: int, cfg: PlanConfig) -> int:
    """The largest world of units <= available units and <= max_world whose ranks split the
    global batch into whole micro-batches on every rank
    (`global % (micro * units * ranks_per_node) == 0`)."""
    for world in range(min(available, cfg.max_world), cfg.min_world - 1, -1):
        if cfg.global_batch % (cfg.micro_batch * world * cfg.ranks_per_node) == 0:
            return world
    per = f" of {cfg.ranks_per_node} ranks" if cfg.ranks_per_node > 1 else ""
    raise NoQuorumError(f"{available} live node(s){per}: no world size in [{cfg.min_world}, "
                        f"{cfg.max_world}] splits global batch {cfg.global_batch} into "
                        f"micro-batches of {cfg.micro_batch}")


def plan_generation(current: Plan | None, req: Requests, cfg: PlanConfig) -> Plan:
    """The next generation: survivors in their old rank order, then spares and joiners in
    request order; the world is the largest that keeps the global batch; every node that is
    behind the newest committed step (a joiner, or a survivor whose step did not commit) heals
    from a survivor at that step, round robin so k joiners pull from k sources.

    Units: a unit with any node leaving or dead is gone whole (its other ranks end with it);
    a unit not all of whose local ranks have asked yet waits among the spares until they have;
    a behind node heals from the node at its local rank in its source unit (the same position:
    the same shards where a pod's ranks shard the model). A later plan carries `current`'s
    lineage on (a first plan's is its publisher's: inprocess.admission)."""
    old = current.nodes + current.spares if current is not None else ()
    gone = {unit_of(n) for n in req.leaving | req.dead}
    survivors = [n for n in old if unit_of(n) not in gone]
    joiners = [n for n in dict.fromkeys(req.joining)
               if unit_of(n) not in gone and n not in survivors]
    units: dict[str, list[str]] = {}
    for n in survivors + joiners:
        units.setdefault(unit_of(n), []).append(n)
    whole = [u for u, ns in units.items()
             if sorted(map(local_rank_of, ns)) == list(range(cfg.ranks_per_node))]
    world = choose_world_size(len(whole), cfg)
    ordered = {u: tuple(sorted(units[u], key=local_rank_of)) for u in units}
    nodes = tuple(n for u in whole[:world] for n in ordered[u])
    spares = tuple(n for u in whole[world:] for n in ordered[u]) + tuple(
        n for u in units if u not in whole for n in ordered[u])
    members = set(current.nodes) if current is not None else set()
    step = max([req.step, *(req.steps.get(n, req.step) for n in nodes if n in members)])
    # A source holds the state at `step`: a member of the old generation that committed it.
    held = {n for n in nodes if n in members and req.steps.get(n, req.step) == step}
    behind = [n for n in nodes if n not in held]
    sources = [u for u in whole[:world] if set(ordered[u]) <= held]
    if current is not None and behind and not sources:
        raise NoQuorumError(f"no live member holds step {step}: {behind} cannot be healed")
    behind_units = list(dict.fromkeys(unit_of(n) for n in behind))
    heal = ({n: ordered[sources[behind_units.index(unit_of(n)) % len(sources)]]
             [local_rank_of(n)] for n in behind} if current else {})
    return Plan(gen=(current.gen if current is not None else 0) + 1, step=step,
                world_size=len(nodes), nodes=nodes, heal=heal,
                reason=_reason(current, req, joiners), global_batch=cfg.global_batch,
                accum=cfg.global_batch // (cfg.micro_batch * len(nodes)), spares=spares,
                lost=planned_out(current, req, nodes + spares),
                lineage=current.lineage if current is not None else "")


# A pod's name is a DNS label, so it never holds this.
LOCAL_SEP = "/"
# Plans carry at most this many lost pods (the newest): the operator replaces one within
# seconds, after which its pod is gone and its name means nothing.
MAX_LOST = 16


def restarted_node_id(pod: str, restart: int) -> str:
    """The node a pod's worker is after its launcher restarted it in place `restart` times: a
    new process holds none of the old one's state or generation, so it joins as a new node."""
    return f"{pod}.{restart}" if restart > 0 else pod


def local_node_id(unit: str, local_rank: int, ranks_per_node: int) -> str:
    """The node of local rank `local_rank` of a launcher (`unit`: restarted_node_id's) that runs
    `ranks_per_node` ranks; one rank per node keeps the unit's name."""
    return f"{unit}{LOCAL_SEP}{local_rank}" if ranks_per_node > 1 else unit


def unit_of(node_id: str) -> str:
    """The launcher incarnation a node belongs to (local_node_id's inverse)."""
    return node_id.partition(LOCAL_SEP)[0]


def local_rank_of(node_id: str) -> int:
    _, sep, tail = node_id.partition(LOCAL_SEP)
    return int(tail) if sep and tail.isdigit() else 0


def pod_of(node_id: str) -> str:
    """The pod a node runs in (restarted_node_id's and local_node_id's inverse)."""
    head, dot, tail = unit_of(node_id).rpartition(".")
    return head if dot and tail.isdigit() else unit_of(node_id)


def planned_out(current: Plan | None, req: Requests, kept: Iterable[str]) -> tuple[str, ...]:
    """`current`'s lost pods and the pods of its nodes and spares judged dead (not leaving:
    a leave has notice), less every pod with a node in the next plan (`kept`: it is back)."""
    if current is None:
        return ()
    back = {pod_of(n) for n in kept}
    dead = [pod_of(n) for n in current.nodes + current.spares
            if n in req.dead and n not in req.leaving]
    return tuple(p for p in dict.fromkeys([*current.lost, *dead]) if p not in back)[-MAX_LOST:]


def plan_stop(current: Plan, req: Requests) -> Plan:
    """The generation after `current` when too few nodes remain for the smallest world (a
    drain, a SIGTERM to every node, a second loss): nobody trains in it. Its savers save
    `req.step` and end; the next nodes to join wait until each saver (`saving`) has saved or
    gone silent, then start a new generation from that checkpoint.

    With notice (no reported steps) `current`'s group is intact and every node saves on it.
    After a failure (`req.steps`: the live nodes' committed steps) the group is gone, so one
    live node holding `req.step`, the first in plan order, saves it alone: the state nobody
    else holds is not lost to the restart (docs/recovery.md section 8, "below the smallest
    world")."""
    if req.steps:
        holders = [n for n in current.nodes if req.step >= 0
                   and req.steps.get(n) == req.step and n not in req.dead]
        saving = tuple(holders[:1])
    else:
        saving = current.nodes
    return Plan(gen=current.gen + 1, step=req.step, world_size=0, nodes=(), heal={},
                reason="stop", global_batch=current.global_batch, accum=0, saving=saving,
                lost=planned_out(current, req, ()), lineage=current.lineage)


def _reason(current: Plan | None, req: Requests, joiners: Sequence[str]) -> str:
    if current is None:
        return "start"
    if req.dead & set(current.nodes):  # a dead spare alone is no failure of the group
        return "fail"
    if req.leaving & set(current.nodes):
        return "leave"
    return "join" if joiners else "resize"


def successor_order(plan: Plan, dead: Iterable[str]) -> list[str]:
    """Who coordinates the next change when the coordinator may be gone: the plan's nodes in
    order, the dead left out (deterministic: no election round)."""
    gone = set(dead)
    return [n for n in plan.nodes if n not in gone]


@dataclasses.dataclass
class Liveness:
    """Judges peers by whether their heartbeat counter moved, on the watcher's own clock (no
    clock skew between nodes). A node never seen to beat is judged from when watching began."""

    timeout_s: float
    _seen: dict[str, tuple[int | None, float]] = dataclasses.field(default_factory=dict)

    def observe(self, counters: Mapping[str, int | None], now: float) -> None:
        for node, value in counters.items():
            last = self._seen.get(node)
            if last is None or last[0] != value:
                self._seen[node] = (value, now)

    def dead(self, now: float, timeout_s: float | None = None) -> frozenset[str]:
        """Nodes silent for the timeout (or for `timeout_s`, a shorter bound some callers
        apply when they already know something failed)."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        return frozenset(n for n, (_, since) in self._seen.items() if now - since >= bound)

    def is_alive(self, node: str, now: float) -> bool:
        last = self._seen.get(node)
        return last is not None and now - last[1] < self.timeout_s
