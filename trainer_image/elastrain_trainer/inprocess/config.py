"""In-process recovery settings, from the environment the operator renders (section 10).

    ELASTRAIN_RECOVERY=inProcess            opt in (default: restart, today's path, unchanged)
    ELASTRAIN_STORE=<job>-store:<port>      the job's store (a TCPStore no worker hosts)
    ELASTRAIN_NODE_ID=<pod name>            unique per pod attempt; a worker the launcher
                                            restarted in place (TORCHELASTIC_RESTART_COUNT=n > 0)
                                            joins as the new node <pod name>.<n>; with
                                            several local ranks (torchrun's LOCAL_WORLD_SIZE,
                                            nprocPerNode) local rank r is node <...>/<r>
    ELASTRAIN_RUN_ID=<job uid>              the store prefix elastrain/<run_id>/
    ELASTRAIN_REPLICAS=3                    the first generation waits for this many nodes
                                            (spec.replicas when the pod was created)
    ELASTRAIN_MAX_REPLICAS=4                the largest world (spec.maxReplicas; default
                                            ELASTRAIN_REPLICAS), the same for every pod of the
                                            job: a scale-up pod joins the world, not the spares
    ELASTRAIN_MIN_REPLICAS=1                below this no generation forms
    ELASTRAIN_SPARES=0                      spec.spares: > 0, the world is the desired one
                                            (ELASTRAIN_REPLICAS until the operator's
                                            POST /control says otherwise) and the
                                            nodes beyond it wait as spares
    ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS=5   a silent node is dead after this (min 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from elastrain_trainer.inprocess.heartbeat import DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S
from elastrain_trainer.inprocess.membership import local_node_id, restarted_node_id

MODES = ("restart", "inProcess")


@dataclasses.dataclass(frozen=True)
class InProcessConfig:
    store_host: str
    store_port: int
    node_id: str
    run_id: str
    replicas: int
    min_replicas: int = 1
    heartbeat_timeout_s: float = DEFAULT_TIMEOUT_S
    max_replicas: int = 0  # 0: replicas
    spares: int = 0
    ranks_per_node: int = 1  # the pod's local ranks (replicas and spares count pods)

    def __post_init__(self) -> None:
        if self.max_replicas == 0:
            object.__setattr__(self, "max_replicas", self.replicas)
        if not self.node_id:
            raise ValueError("ELASTRAIN_RECOVERY=inProcess needs ELASTRAIN_NODE_ID")
        if not self.run_id:
            raise ValueError("ELASTRAIN_RECOVERY=inProcess needs ELASTRAIN_RUN_ID")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"ELASTRAIN_MIN_REPLICAS={self.min_replicas}, ELASTRAIN_REPLICAS="
                             f"{self.replicas}: need 1 <= min <= replicas")
        if self.max_replicas < self.replicas:
            raise ValueError(f"ELASTRAIN_MAX_REPLICAS={self.max_replicas}, ELASTRAIN_REPLICAS="
                             f"{self.replicas}: need replicas <= max")
        if self.ranks_per_node < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={self.ranks_per_node}: need >= 1")
        if self.spares < 0:
            raise ValueError(f"ELASTRAIN_SPARES={self.spares}: need >= 0")
        if self.heartbeat_timeout_s < MIN_TIMEOUT_S:
            raise ValueError(f"ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS={self.heartbeat_timeout_s}: "
                             f"at least {MIN_TIMEOUT_S}")


def read_inprocess_config(env: Mapping[str, str]) -> InProcessConfig | None:
    """The settings when in-process recovery is chosen; None in restart mode."""
    mode = env.get("ELASTRAIN_RECOVERY", "restart")
    if mode not in MODES:
        raise ValueError(f"ELASTRAIN_RECOVERY={mode!r}: one of {', '.join(MODES)}")
    if mode == "restart":
        return None
    host, sep, port = env.get("ELASTRAIN_STORE", "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError("ELASTRAIN_RECOVERY=inProcess needs ELASTRAIN_STORE=<host>:<port>, "
                         f"got {env.get('ELASTRAIN_STORE', '')!r}")
    node_id = env.get("ELASTRAIN_NODE_ID", "")
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ranks = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if node_id:  # the launcher restarted this worker in place when it exited EXIT_RESTART
        node_id = local_node_id(restarted_node_id(node_id, restart),
                                int(env.get("LOCAL_RANK", "0")), ranks)
    return InProcessConfig(
        store_host=host, store_port=int(port), node_id=node_id,
        run_id=env.get("ELASTRAIN_RUN_ID", ""), replicas=int(env.get("ELASTRAIN_REPLICAS", "1")),
        min_replicas=int(env.get("ELASTRAIN_MIN_REPLICAS", "1")),
        heartbeat_timeout_s=float(env.get("ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS",
                                          str(DEFAULT_TIMEOUT_S))),
        max_replicas=int(env.get("ELASTRAIN_MAX_REPLICAS", "0")),
        spares=int(env.get("ELASTRAIN_SPARES", "0")), ranks_per_node=ranks)
