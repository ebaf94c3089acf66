"""Warm spares (`spec.spares`, docs/recovery.md section 9) under the launcher, as the operator
renders the pods: `replicas + spares` launchers with ELASTRAIN_REPLICAS=2 and ELASTRAIN_SPARES=1
against one real TCPStore. The world is the desired one (2); the third node waits as a spare,
torch imported and its model built, and answers /progress with `"role": "spare"`.

- a member killed without notice: the survivor and the spare form the next generation at
  world 2, the spare healed from the survivor (no checkpoint load), the survivor's worker kept;
- a member's SIGTERM (notice): the spare takes its place at that step boundary, 0 steps lost;
- the desired world the operator says on its control channel (`POST /control` with the job's
  token, the file its pods mount): 3 takes the spare in, 2 sets a member aside as a spare again
  (in its process); a SIGTERM to a spare ends it with exit 0 and the world goes on.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from typing import Any

import pytest

from elastrain_trainer.ports import free_port

from .test_inprocess import wait_for
from .test_inprocess_builtin import job_store
from .test_inprocess_launcher import Pods, pods, progress

pytestmark = [pytest.mark.timeout(300)]
__all__ = ["job_store", "pods"]  # the fixtures, imported for the tests below


def start_with_a_spare(pods: Pods, steps: int = 120) -> dict[str, int]:
    """a, b, c started together: replicas 2, spares 1 (the pods the operator creates). Returns
    each node's /progress port once 10 steps trained and one node reports itself a spare."""
    ports = {n: free_port() for n in ("a", "b", "c")}
    (pods.root / "control-token").write_text(TOKEN)  # the job's Secret, as its pods mount it
    for node in ("a", "b", "c"):
        pods.start(node, 2, SPARES="1", MAX_REPLICAS="3", STEPS=str(steps),
                   METRICS_PORT=str(ports[node]),
                   CONTROL_TOKEN_FILE=str(pods.root / "control-token"))
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 2", timeout=180)
    wait_for(lambda: sorted(map(str, roles(ports).values())) == ["member", "member", "spare"],
             "two members and a spare in /progress")
    # Each member names the plan's pods (what the operator waits for before it moves a worker
    # off a node with a notice: policy.notices).
    spare = spare_of(ports)
    for node in set(ports) - {spare}:
        told = progress(ports[node])
        assert sorted(told["members"]) == sorted(set(ports) - {spare}) and \
            told["spares"] == [spare], told
    return ports


def roles(ports: dict[str, int]) -> dict[str, str | None]:
    """Each node's role in /progress (None: not serving yet, a node still importing torch)."""
    return {n: role(p) for n, p in ports.items()}


def role(port: int) -> str | None:
    try:
        return progress(port).get("role")
    except OSError:
        return None


def spare_of(ports: dict[str, int]) -> str:
    return next(n for n, r in roles(ports).items() if r == "spare")


def steps_and_worlds(pods: Pods) -> list[tuple[int, int]]:
    return [(r["step"], r["world_size"]) for r in pods.all_records() if r["event"] == "step"]


def regroups_after(pods: Pods, t: float) -> list[dict[str, Any]]:
    return [r for r in pods.all_records() if r["event"] == "regroup" and r["time"] > t]


def test_a_spare_takes_a_killed_members_place_healed_from_the_survivor(pods: Pods) -> None:
    ports = start_with_a_spare(pods)
    spare = spare_of(ports)
    member, victim = (n for n in ("a", "b", "c") if n != spare)
    kept = pods.worker_pid(member)
    assert {w for _, w in steps_and_worlds(pods)} == {2}  # the spare never trained
    killed_at = time.time()
    pods.kill_pod(victim)
    wait_for(lambda: any(r["node"] == spare for r in regroups_after(pods, killed_at)),
             "the spare healed into the world")
    joined = next(r for r in regroups_after(pods, killed_at) if r["node"] == spare)
    assert (joined["reason"], joined["world_size"], joined["healed_from"]) == (
        "fail", 2, member), joined
    wait_for(lambda: pods.stepped() > joined["step"], "a step after the spare joined")
    first = next(r for r in pods.all_records() if r["event"] == "step"
                 and r["time"] > joined["time"])
    print(f"killed -> spare healed in {joined['time'] - killed_at:.2f} s, first step at world "
          f"2 {first['time'] - killed_at:.2f} s after the kill")
    assert roles({n: ports[n] for n in (member, spare)}) == {member: "member", spare: "member"}
    assert kept is not None and pods.worker_pid(member) == kept  # the survivor's worker kept
    codes = pods.wait_all()
    assert codes == {member: 0, spare: 0, victim: -signal.SIGKILL}, {
        n: pods.log(n) for n in codes}
    assert not any(r["event"] == "regroup" and "." in r["node"] for r in pods.all_records())
    assert not any(r["event"] == "resumed" for r in pods.all_records())  # no checkpoint load
    steps = steps_and_worlds(pods)
    assert sorted({s for s, _ in steps}) == list(range(1, 121))
    assert len(steps) - len({s for s, _ in steps}) <= 1  # <= 1 step (in flight) twice
    assert {w for _, w in steps} == {2}  # the world never shrank


def test_a_spare_takes_a_leaving_members_place_at_the_next_boundary(pods: Pods) -> None:
    ports = start_with_a_spare(pods)
    spare = spare_of(ports)
    member, leaver = (n for n in ("a", "b", "c") if n != spare)
    signalled = time.time()
    pods.procs[leaver].send_signal(signal.SIGTERM)
    wait_for(lambda: any(r["node"] == spare for r in regroups_after(pods, signalled)),
             "the spare healed into the world")
    joined = next(r for r in regroups_after(pods, signalled) if r["node"] == spare)
    assert (joined["reason"], joined["world_size"], joined["healed_from"]) == (
        "leave", 2, member), joined
    print(f"SIGTERM -> spare healed into the world in {joined['time'] - signalled:.2f} s")
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    steps = steps_and_worlds(pods)
    assert [s for s, _ in steps] == list(range(1, 121)), steps  # every step once: 0 lost
    assert {w for _, w in steps} == {2}


TOKEN = "the-jobs-control-token"


def tell_replicas(port: int, replicas: int) -> None:
    """The operator's poll of an in-process job, which carries the desired world
    (spec.replicas) on the control channel."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/control", method="POST",
        data=json.dumps({"replicas": replicas}).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as r:
        assert r.status == 200
        r.read()


def test_the_desired_world_from_the_operators_poll_takes_the_spare_in_and_sets_one_aside(
        pods: Pods) -> None:
    ports = start_with_a_spare(pods, steps=600)
    spare = spare_of(ports)
    said = time.time()
    tell_replicas(ports["a"], 3)  # kubectl scale --replicas=3: a spare is there already
    wait_for(lambda: any(r["world_size"] == 3 for r in regroups_after(pods, said)),
             "world 3 with the spare taken in")
    grown = next(r for r in regroups_after(pods, said) if r["world_size"] == 3)
    assert grown["reason"] == "resize", grown
    wait_for(lambda: set(roles(ports).values()) == {"member"}, "three members")
    print(f"replicas=3 -> world 3 in {grown['time'] - said:.2f} s")
    pids = {n: pods.worker_pid(n) for n in ports}
    said = time.time()
    tell_replicas(ports[spare], 2)  # any node that hears it tells the coordinator
    wait_for(lambda: any(r["world_size"] == 2 for r in regroups_after(pods, said)),
             "world 2 again")
    wait_for(lambda: sorted(map(str, roles(ports).values())) == ["member", "member", "spare"],
             "a member set aside as a spare")
    aside = spare_of(ports)
    assert {n: pods.worker_pid(n) for n in ports} == pids  # set aside in its process
    said = time.time()
    tell_replicas(ports[aside], 3)  # taken back: healed from a member, in the same process
    wait_for(lambda: any(r["node"] == aside and r["healed_from"]
                         for r in regroups_after(pods, said)), "the member set aside taken back")
    back = next(r for r in regroups_after(pods, said) if r["node"] == aside)
    assert back["world_size"] == 3 and back["reason"] == "resize", back
    assert {n: pods.worker_pid(n) for n in ports} == pids
    said = time.time()
    tell_replicas(ports["a"], 2)
    wait_for(lambda: any(r["world_size"] == 2 for r in regroups_after(pods, said)),
             "world 2 once more")
    wait_for(lambda: sorted(map(str, roles(ports).values())) == ["member", "member", "spare"],
             "a member set aside again")
    aside = spare_of(ports)
    pods.procs[aside].send_signal(signal.SIGTERM)  # a spare's pod deleted: it just ends
    assert pods.procs[aside].wait(timeout=60) == 0, pods.log(aside)
    assert [r for r in pods.records(aside) if r["event"] == "left"][-1]["waiting"] is True
    codes = pods.wait_all()
    assert set(codes.values()) == {0}, {n: pods.log(n) for n in codes}
    steps = steps_and_worlds(pods)
    assert [s for s, _ in steps] == list(range(1, 601)), steps  # every step once
    worlds = [w for i, (_, w) in enumerate(steps) if i == 0 or steps[i - 1][1] != w]
    assert worlds == [2, 3, 2, 3, 2], worlds


def test_a_spare_arriving_or_leaving_leaves_the_members_group_as_it_is(pods: Pods) -> None:
    """A plan that changes only the spares (a backfilled spare arrives, a spare leaves) keeps
    the members' group: no destroy and init, no heal, no DDP re-wrap; only the agreement."""
    ports = {n: free_port() for n in ("a", "b", "c")}
    for node in ("a", "b"):
        pods.start(node, 2, SPARES="1", MAX_REPLICAS="3", STEPS="200",
                   METRICS_PORT=str(ports[node]))
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 2", timeout=180)
    pids = {n: pods.worker_pid(n) for n in ("a", "b")}
    started = time.time()
    pods.start("c", 2, SPARES="1", MAX_REPLICAS="3", STEPS="200", METRICS_PORT=str(ports["c"]))
    wait_for(lambda: role(ports["c"]) == "spare", "c waiting as a spare", timeout=180)
    wait_for(lambda: regroups_after(pods, started), "the plan that names c a spare")
    arrived = regroups_after(pods, started)
    assert [(r["world_size"], r["kept_group"]) for r in arrived] == [(2, True)], arrived
    left_at = time.time()
    pods.procs["c"].send_signal(signal.SIGTERM)
    wait_for(lambda: regroups_after(pods, left_at), "the plan without the spare")
    assert {n: pods.worker_pid(n) for n in ("a", "b")} == pids
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    dropped = regroups_after(pods, left_at)
    assert [(r["world_size"], r["kept_group"]) for r in dropped] == [(2, True)], dropped
    steps = steps_and_worlds(pods)
    assert [s for s, _ in steps] == list(range(1, 201)), steps  # every step once
    assert {w for _, w in steps} == {2}
    print(f"spare arrived: members kept their group ({arrived[0]}); left: {dropped[0]}")
