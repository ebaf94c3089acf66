"""inprocess.membership with several ranks per pod (nprocPerNode > 1, issue 35 item 1), pure: a
pod's local ranks are one unit of the world. It is admitted only whole, kept in local-rank
order, dropped whole when any of its ranks leaves or dies (once, as one lost pod), counted by
the world's sizes as one member, and healed rank by rank from the same position of a source
pod. No store, no process."""

from __future__ import annotations

import pytest

from elastrain_trainer.inprocess import membership as m
from elastrain_trainer.inprocess.membership import (
    NoQuorumError,
    Plan,
    PlanConfig,
    Requests,
    plan_generation,
)

# 3 pods x 2 ranks: world 6 at full size, 4 after a loss; 24 / (2 * 6) and 24 / (2 * 4) whole.
CFG = PlanConfig(global_batch=24, micro_batch=2, max_world=3, min_world=2, ranks_per_node=2)


def ranks(*pods: str) -> tuple[str, ...]:
    return tuple(f"{p}/{r}" for p in pods for r in range(2))


def started(*pods: str) -> Plan:
    return plan_generation(None, Requests(step=0, joining=ranks(*pods)), CFG)


def test_node_ids_of_local_ranks_and_their_pod() -> None:
    assert m.local_node_id("w-0", 1, 2) == "w-0/1"
    assert m.local_node_id("w-0.3", 0, 2) == "w-0.3/0"
    assert m.local_node_id("w-0", 0, 1) == "w-0"  # one rank per pod: the name as before
    assert [m.unit_of(n) for n in ("w-0.3/1", "w-0/0", "w-0.3")] == ["w-0.3", "w-0", "w-0.3"]
    assert [m.pod_of(n) for n in ("w-0.3/1", "w-0/0", "w-0.3", "w-0")] == ["w-0"] * 4
    assert [m.local_rank_of(n) for n in ("w-0.3/1", "w-0/0", "w-0")] == [1, 0, 0]


def test_a_pods_ranks_are_contiguous_in_local_rank_order_and_the_world_counts_pods() -> None:
    # Requests arrive interleaved and out of order; the plan groups them.
    plan = plan_generation(None, Requests(step=0, joining=(
        "a/1", "b/0", "a/0", "c/1", "b/1", "c/0")), CFG)
    assert plan.nodes == ranks("a", "b", "c") and plan.world_size == 6
    assert plan.accum == 2 and plan.spares == ()
    assert [plan.rank_of(n) for n in ranks("b")] == [2, 3]


def test_a_pod_not_all_of_whose_ranks_asked_waits_beyond_the_world_until_they_have() -> None:
    plan = plan_generation(None, Requests(step=0, joining=(*ranks("a", "b"), "c/1")), CFG)
    assert plan.nodes == ranks("a", "b") and plan.spares == ("c/1",)
    after = plan_generation(plan, Requests(step=5, joining=("c/0",)), CFG)
    assert after.nodes == ranks("a", "b", "c") and after.spares == ()
    assert after.heal == {"c/0": "a/0", "c/1": "a/1"} and after.reason == "join"


def test_one_dead_rank_drops_its_whole_pod_once() -> None:
    plan = started("a", "b", "c")
    after = plan_generation(plan, Requests(step=9, dead=frozenset({"b/1"}),
                                           steps={n: 9 for n in ranks("a", "c")} | {"b/0": 9}),
                            CFG)
    assert after.nodes == ranks("a", "c") and after.world_size == 4 and after.accum == 3
    assert after.reason == "fail" and after.lost == ("b",) and after.heal == {}


def test_one_leaving_rank_takes_its_pod_with_it() -> None:
    after = plan_generation(started("a", "b", "c"), Requests(step=4, leaving=frozenset({"a/0"})),
                            CFG)
    assert after.nodes == ranks("b", "c") and after.reason == "leave" and after.lost == ()
    assert after.coordinator == "b/0"


def test_a_replacement_pod_heals_rank_by_rank_from_the_same_position() -> None:
    plan = plan_generation(started("a", "b", "c"), Requests(step=9, leaving=frozenset({"b/0",
                                                                                        "b/1"})),
                           CFG)
    # A pod restarted in place (its ranks are new processes) joins as a new unit.
    back = plan_generation(plan, Requests(step=12, joining=("b.1/0", "b.1/1", "d/1", "d/0")),
                           CFG)
    assert back.nodes == (*ranks("a", "c"), "b.1/0", "b.1/1") and back.spares == ranks("d")
    assert back.heal == {"b.1/0": "a/0", "b.1/1": "a/1"}
    # Two joining pods pull from two source pods.
    cfg = PlanConfig(global_batch=48, micro_batch=2, max_world=4, min_world=2, ranks_per_node=2)
    two = plan_generation(None, Requests(step=0, joining=ranks("a", "c")), cfg)
    grown = plan_generation(two, Requests(step=7, joining=ranks("x", "y")), cfg)
    assert grown.nodes == ranks("a", "c", "x", "y") and grown.accum == 3
    assert grown.heal == {"x/0": "a/0", "x/1": "a/1", "y/0": "c/0", "y/1": "c/1"}


def test_a_survivor_rank_whose_step_did_not_commit_heals_from_the_same_rank_elsewhere() -> None:
    after = plan_generation(started("a", "b", "c"),
                            Requests(step=8, dead=frozenset({"c/0"}),
                                     steps={"a/0": 8, "a/1": 8, "b/0": 8, "b/1": 7}), CFG)
    assert after.step == 8 and after.nodes == ranks("a", "b") and after.heal == {"b/1": "a/1"}


def test_below_the_smallest_world_of_pods_there_is_no_plan() -> None:
    with pytest.raises(NoQuorumError, match="of 2 ranks"):
        plan_generation(started("a", "b"), Requests(step=1, dead=frozenset({"a/0"}),
                                                    steps={"b/0": 1, "b/1": 1}), CFG)


def test_pods_are_the_unit_of_the_batch_rule() -> None:
    # 8 / (2 * 3 pods * 2 ranks) is not whole, 8 / (2 * 2 * 2) is: two pods train.
    cfg = PlanConfig(global_batch=8, micro_batch=2, max_world=3, ranks_per_node=2)
    plan = plan_generation(None, Requests(step=0, joining=ranks("a", "b", "c")), cfg)
    assert plan.nodes == ranks("a", "b") and plan.spares == ranks("c") and plan.accum == 1
    with pytest.raises(ValueError, match="ranks per node"):
        PlanConfig(global_batch=12, micro_batch=2, max_world=3, ranks_per_node=0)
