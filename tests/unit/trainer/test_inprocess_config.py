"""ELASTRAIN_RECOVERY and the in-process settings, read from the environment (pure)."""

from __future__ import annotations

import pytest

from elastrain_trainer.inprocess.config import InProcessConfig, read_inprocess_config

BASE = {"ELASTRAIN_RECOVERY": "inProcess", "ELASTRAIN_STORE": "job-store:29400",
        "ELASTRAIN_NODE_ID": "job-worker-1-0", "ELASTRAIN_RUN_ID": "uid-1",
        "ELASTRAIN_REPLICAS": "3"}


def test_restart_is_the_default_and_reads_nothing_else() -> None:
    assert read_inprocess_config({}) is None
    assert read_inprocess_config({"ELASTRAIN_RECOVERY": "restart"}) is None


def test_in_process_settings() -> None:
    cfg = read_inprocess_config({**BASE, "ELASTRAIN_MIN_REPLICAS": "2",
                                 "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": "2.5"})
    assert cfg == InProcessConfig(store_host="job-store", store_port=29400,
                                  node_id="job-worker-1-0", run_id="uid-1", replicas=3,
                                  min_replicas=2, heartbeat_timeout_s=2.5)
    assert read_inprocess_config(BASE) == InProcessConfig(
        "job-store", 29400, "job-worker-1-0", "uid-1", 3, 1, 5.0)


def test_max_replicas_is_the_largest_world_and_defaults_to_replicas() -> None:
    cfg = read_inprocess_config(BASE)
    assert cfg is not None and cfg.max_replicas == 3
    cfg = read_inprocess_config({**BASE, "ELASTRAIN_MAX_REPLICAS": "5"})
    assert cfg is not None and (cfg.replicas, cfg.max_replicas) == (3, 5)


def test_a_worker_restarted_in_place_joins_as_a_new_node() -> None:
    first = read_inprocess_config({**BASE, "TORCHELASTIC_RESTART_COUNT": "0"})
    again = read_inprocess_config({**BASE, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert first is not None and first.node_id == "job-worker-1-0"
    assert again is not None and again.node_id == "job-worker-1-0.2"


@pytest.mark.parametrize(("override", "message"), [
    ({"ELASTRAIN_RECOVERY": "inprocess"}, "one of restart, inProcess"),
    ({"ELASTRAIN_STORE": "job-store"}, "ELASTRAIN_STORE=<host>:<port>"),
    ({"ELASTRAIN_NODE_ID": ""}, "ELASTRAIN_NODE_ID"),
    ({"ELASTRAIN_RUN_ID": ""}, "ELASTRAIN_RUN_ID"),
    ({"ELASTRAIN_MIN_REPLICAS": "4"}, "min <= replicas"),
    ({"ELASTRAIN_MAX_REPLICAS": "2"}, "replicas <= max"),
    ({"ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": "1"}, "at least 2"),
])
def test_bad_settings_are_configuration_errors(override: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_inprocess_config({**BASE, **override})
