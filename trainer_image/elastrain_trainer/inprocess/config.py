"""In-process recovery settings, from the environment the operator renders (section 10).

    ELASTRAIN_RECOVERY=inProcess            opt in (default: restart, today's path, unchanged)
    ELASTRAIN_STORE=<job>-store:<port>      the job's store (a TCPStore no worker hosts)
    ELASTRAIN_NODE_ID=<pod name>            unique per pod attempt
    ELASTRAIN_RUN_ID=<job uid>              the store prefix elastrain/<run_id>/
    ELASTRAIN_REPLICAS=3                    the first generation waits for this many nodes; the
                                            largest world (spec.replicas)
    ELASTRAIN_MIN_REPLICAS=1                below this no generation forms
    ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS=5   a silent node is dead after this (min 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from elastrain_trainer.inprocess.heartbeat import DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S

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

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("ELASTRAIN_RECOVERY=inProcess needs ELASTRAIN_NODE_ID")
        if not self.run_id:
            raise ValueError("ELASTRAIN_RECOVERY=inProcess needs ELASTRAIN_RUN_ID")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"ELASTRAIN_MIN_REPLICAS={self.min_replicas}, ELASTRAIN_REPLICAS="
                             f"{self.replicas}: need 1 <= min <= replicas")
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
    return InProcessConfig(
        store_host=host, store_port=int(port), node_id=env.get("ELASTRAIN_NODE_ID", ""),
        run_id=env.get("ELASTRAIN_RUN_ID", ""), replicas=int(env.get("ELASTRAIN_REPLICAS", "1")),
        min_replicas=int(env.get("ELASTRAIN_MIN_REPLICAS", "1")),
        heartbeat_timeout_s=float(env.get("ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS",
                                          str(DEFAULT_TIMEOUT_S))))
