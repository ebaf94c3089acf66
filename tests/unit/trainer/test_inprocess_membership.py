"""inprocess.membership, pure: the plan of each generation change (docs/recovery.md sections 2,
3 and 6), the world-size rule that keeps the global batch, liveness on the watcher's clock, and
the store's key names. No store, no process."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastrain_trainer.inprocess import membership as m
from elastrain_trainer.inprocess.membership import (
    Liveness,
    NoQuorumError,
    Plan,
    PlanConfig,
    Requests,
    choose_world_size,
    plan_generation,
    plan_stop,
)

CFG = PlanConfig(global_batch=12, micro_batch=2, max_world=3, min_world=1)


def started(*nodes: str, step: int = 0) -> Plan:
    return plan_generation(None, Requests(step=step, joining=nodes), CFG)


def test_the_first_generation_takes_the_joiners_in_request_order() -> None:
    plan = started("a", "b", "c")
    assert (plan.gen, plan.step, plan.nodes, plan.reason) == (1, 0, ("a", "b", "c"), "start")
    assert plan.world_size == 3 and plan.accum == 2 and plan.heal == {} and plan.spares == ()
    assert [plan.rank_of(n) for n in "abcx"] == [0, 1, 2, None]


def test_a_leave_keeps_survivors_in_their_rank_order_and_the_step() -> None:
    plan = plan_generation(started("a", "b", "c"), Requests(step=10, leaving=frozenset("a")),
                           CFG)
    assert (plan.gen, plan.step, plan.nodes, plan.reason) == (2, 10, ("b", "c"), "leave")
    assert plan.accum == 3 and plan.heal == {} and plan.coordinator == "b"


def test_joiners_come_after_survivors_and_heal_round_robin_from_them() -> None:
    cfg = PlanConfig(global_batch=24, micro_batch=2, max_world=4)
    two = plan_generation(None, Requests(step=0, joining=("a", "b")), cfg)
    plan = plan_generation(two, Requests(step=20, joining=("x", "y")), cfg)
    assert plan.nodes == ("a", "b", "x", "y") and plan.reason == "join"
    assert plan.heal == {"x": "a", "y": "b"} and plan.step == 20


def test_nodes_beyond_the_largest_batch_preserving_world_wait_as_spares() -> None:
    # 12 / (2 * 4) is not whole: four nodes train as three, the fourth waits.
    cfg = PlanConfig(global_batch=12, micro_batch=2, max_world=4)
    plan = plan_generation(None, Requests(step=0, joining=("a", "b", "c", "d")), cfg)
    assert plan.nodes == ("a", "b", "c") and plan.spares == ("d",)
    # A spare is taken at the next loss, before any new joiner, and healed.
    after = plan_generation(plan, Requests(step=7, dead=frozenset("b"), joining=("e",)), cfg)
    assert after.nodes == ("a", "c", "d") and after.spares == ("e",)
    assert after.heal == {"d": "a"} and after.reason == "fail"


def test_a_smaller_desired_world_sets_the_last_members_aside_as_spares_and_back() -> None:
    """spec.spares: the world is the desired one (a PlanConfig with max_world = desired); a
    member set aside waits first among the spares and is healed when taken back."""
    three = started("a", "b", "c", "d")
    two = dataclasses.replace(CFG, max_world=2)
    down = plan_generation(three, Requests(step=7), two)
    assert (down.nodes, down.spares, down.reason, down.heal) == (("a", "b"), ("c", "d"),
                                                                 "resize", {})
    up = plan_generation(down, Requests(step=9), CFG)
    assert (up.nodes, up.spares, up.reason) == (("a", "b", "c"), ("d",), "resize")
    assert up.heal == {"c": "a"} and up.step == 9


def test_a_dead_or_leaving_spare_is_dropped_without_failing_the_world() -> None:
    plan = started("a", "b", "c", "d", "e")
    assert plan.spares == ("d", "e")
    after = plan_generation(plan, Requests(step=4, dead=frozenset("d"),
                                           leaving=frozenset("e")), CFG)
    assert (after.nodes, after.spares, after.reason, after.heal) == (("a", "b", "c"), (),
                                                                     "resize", {})


def test_a_failure_resumes_at_the_newest_committed_step_and_heals_those_behind() -> None:
    # The step in flight committed on "c" but not on "b" (a ring all-reduce that ended on some
    # ranks only): the plan starts at 8 and "b" receives the state from "c".
    plan = plan_generation(started("a", "b", "c"),
                           Requests(step=7, dead=frozenset("a"), steps={"b": 7, "c": 8}), CFG)
    assert (plan.step, plan.nodes, plan.heal, plan.reason) == (8, ("b", "c"), {"b": "c"}, "fail")


def test_world_size_keeps_the_global_batch() -> None:
    assert choose_world_size(3, CFG) == 3
    assert choose_world_size(5, CFG) == 3  # max_world
    cfg = PlanConfig(global_batch=8, micro_batch=2, max_world=4)
    assert choose_world_size(3, cfg) == 2  # 8 % 6 != 0
    with pytest.raises(NoQuorumError, match="no world size"):
        choose_world_size(0, cfg)
    with pytest.raises(NoQuorumError):
        choose_world_size(1, PlanConfig(global_batch=8, micro_batch=2, max_world=4,
                                        min_world=2))


def test_no_survivor_at_the_step_means_no_plan() -> None:
    with pytest.raises(NoQuorumError, match="cannot be healed"):
        plan_generation(started("a", "b"), Requests(step=5, leaving=frozenset("ab"),
                                                    joining=("x",)), CFG)


def test_a_stop_generation_has_nobody_names_its_savers_and_round_trips() -> None:
    old = started("a", "b", "c")
    with pytest.raises(NoQuorumError):  # every node leaves: no world to plan
        plan_generation(old, Requests(step=12, leaving=frozenset("abc")), CFG)
    stop = plan_stop(old, Requests(step=12, leaving=frozenset("ab")))
    assert (stop.gen, stop.step, stop.nodes, stop.world_size, stop.reason) == (
        2, 12, (), 0, "stop")
    assert stop.saving == ("a", "b", "c")  # the next start waits for their save
    assert Plan.from_json(stop.to_json()) == stop and stop.reason in m.REASONS
    # A plan written before `saving` existed (a store restored across an upgrade) still reads.
    raw = json.loads(stop.to_json())
    del raw["saving"]
    assert Plan.from_json(json.dumps(raw)).saving == ()


def test_a_stop_after_a_failure_is_saved_by_one_live_node_that_holds_the_step() -> None:
    # The group is gone: the first live node in plan order at the newest committed step saves
    # it alone (b's step 12 did not commit on c; a is dead).
    old = started("a", "b", "c")
    stop = plan_stop(old, Requests(step=12, dead=frozenset("a"), steps={"c": 11, "b": 12}))
    assert (stop.step, stop.saving) == (12, ("b",))
    stop = plan_stop(old, Requests(step=12, dead=frozenset("ab"), steps={"c": 12}))
    assert stop.saving == ("c",)
    # Only joiners (no state) survived: nobody saves, the newest checkpoint stays.
    assert plan_stop(old, Requests(step=-1, steps={"x": -1})).saving == ()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="micro"):
        PlanConfig(global_batch=1, micro_batch=2, max_world=1)
    with pytest.raises(ValueError, match="world sizes"):
        PlanConfig(global_batch=4, micro_batch=1, max_world=2, min_world=3)


def test_pods_planned_out_without_notice_stay_lost_until_a_node_of_theirs_is_back() -> None:
    """Plan.lost is what members tell the operator (it replaces such a pod): pods, not nodes;
    a leave (notice) is never lost; a dead spare is; the list survives later plans until the
    pod's worker, restarted in place as <pod>.<n>, is planned in again."""
    world = started("job-w-0-0", "job-w-1-0", "job-w-2-0", "job-w-3-0")
    assert world.lost == ()
    failed = plan_generation(world, Requests(step=5, dead=frozenset({"job-w-2-0", "job-w-3-0"}),
                                             steps={"job-w-0-0": 5, "job-w-1-0": 5}), CFG)
    assert failed.lost == ("job-w-2-0", "job-w-3-0")
    joined = plan_generation(failed, Requests(step=9, joining=("job-w-4-0",)), CFG)
    assert joined.lost == ("job-w-2-0", "job-w-3-0")  # another pod's join brings none back
    back = plan_generation(joined, Requests(step=12, joining=("job-w-2-0.1",)), CFG)
    assert back.lost == ("job-w-3-0",)
    left = plan_generation(back, Requests(step=14, leaving=frozenset({"job-w-0-0"})), CFG)
    assert left.lost == ("job-w-3-0",)
    assert Plan.from_json(left.to_json()) == left
    assert m.pod_of("job-w-2-0.12") == "job-w-2-0" and m.pod_of("a.b-w-0-0") == "a.b-w-0-0"
    stop = plan_stop(left, Requests(step=15, dead=frozenset({"job-w-1-0"}),
                                    steps={"job-w-4-0": 15}))
    assert stop.lost == ("job-w-3-0", "job-w-1-0")


def test_plans_round_trip_through_the_store_as_json() -> None:
    plan = plan_generation(started("a", "b", "c"),
                           Requests(step=3, dead=frozenset("a"), steps={"b": 3, "c": 4}), CFG)
    assert Plan.from_json(plan.to_json()) == plan
    assert '"ranks": {"b": 0, "c": 1}' in plan.to_json()


def test_every_plan_after_the_first_carries_its_lineage_on() -> None:
    """The lineage the first plan was founded with goes through joins, failures and stops (a
    store restored copies the plan whole), so commits of one line of generations compare
    across stores; a plan written before lineages reads as ""."""
    first = dataclasses.replace(started("a", "b", "c"), lineage="found:a:n0")  # admission's
    assert first.lineage == "found:a:n0"
    failed = plan_generation(first, Requests(step=5, dead=frozenset("c"),
                                             steps={"a": 5, "b": 5}), CFG)
    joined = plan_generation(failed, Requests(step=9, joining=("d",)), CFG)
    stop = plan_stop(joined, Requests(step=12, leaving=frozenset("abd")))
    assert [p.lineage for p in (failed, joined, stop)] == ["found:a:n0"] * 3
    assert Plan.from_json(stop.to_json()) == stop
    raw = json.loads(joined.to_json())
    del raw["lineage"]
    assert Plan.from_json(json.dumps(raw)).lineage == ""


def test_liveness_judges_by_counter_change_on_the_watchers_clock() -> None:
    live = Liveness(timeout_s=5.0)
    live.observe({"a": 1, "b": 7}, now=100.0)
    live.observe({"a": 2, "b": 7}, now=104.0)
    assert live.dead(104.9) == frozenset()
    assert live.dead(105.0) == frozenset("b")  # b's counter has not moved for 5 s
    assert live.is_alive("a", 108.9) and not live.is_alive("a", 109.0)
    live.observe({"b": 8}, now=105.5)
    assert live.is_alive("b", 106.0) and not live.is_alive("never-seen", 106.0)
    # A shorter bound for callers that already know a collective failed.
    assert live.dead(108.0, timeout_s=4.5) == frozenset()  # a silent 4 s, b 2.5 s
    assert live.dead(108.0, timeout_s=3.0) == frozenset("a")


def test_successors_skip_the_dead_in_plan_order() -> None:
    assert m.successor_order(started("a", "b", "c"), {"a"}) == ["b", "c"]


def test_key_names() -> None:
    assert m.store_prefix("uid-1") == "elastrain/uid-1/"
    with pytest.raises(ValueError, match="run id"):
        m.store_prefix("")
    assert m.plan_key(3) == "gen/3/plan" and m.pg_prefix(3) == "gen/3/pg/"
    assert m.ack_key(3, "w-0") == "gen/3/ack/w-0" and m.failed_key(2) == "gen/2/failed"
    assert m.heartbeat_key("w-1") == "hb/w-1" and m.leave_key("w-1") == "leave/w-1"
    assert m.join_key(4) == "join/4" and m.report_key(2, "w-0") == "gen/2/report/w-0"


def test_a_store_claim_says_who_claimed_it_and_whether_a_world_keeps_it() -> None:
    kept = m.Epoch(True, "job-worker-1-0", "9f3c")
    founded = m.Epoch(False, "a.1", "07aa")
    assert kept.text() == "keep:job-worker-1-0:9f3c" and founded.text() == "found:a.1:07aa"
    assert m.Epoch.parse(kept.text()) == kept and m.Epoch.parse(founded.text()) == founded
    assert m.Epoch.parse("keep:host:port:ab").node == "host:port"  # the nonce is last
    for bad in ("", "3f1e9c", "lost:a:1", "keep::1", "found:a:"):
        with pytest.raises(ValueError, match="not an epoch claim"):
            m.Epoch.parse(bad)
