"""A node the operator knows lost while its process runs (issue 34 item 4): a kubelet and
container runtime that stopped leave the pod's trainer beating and training in the world, so
no heartbeat plans it out. The operator tells the members (`POST /control`'s "lost"); they ask
it to leave at a step boundary on its behalf: it ends, and the others train on in their
processes at the smaller world, every step once."""

from __future__ import annotations

from pathlib import Path

from tests.warmstart import started_pid

from .test_inprocess import Nodes, events, job_store, nodes, pids, steps_of, wait_for

__all__ = ["job_store", "nodes"]  # the fixtures, used by name


def test_a_pod_told_lost_leaves_at_a_step_boundary_while_its_process_runs(
        nodes: Nodes, tmp_path: Path) -> None:
    # Only a hears it (the operator polls the Ready pods; c's node is NotReady): c still runs.
    procs = {n: nodes.node(n, "--steps", "60", "--sleep", "0.05",
                           *(["--told-lost", "c", "--told-lost-at", "10"] if n == "a" else []))
             for n in "abc"}
    wait_for(lambda: len(steps_of(events(tmp_path, "a"))) >= 10, "a at step 10")
    codes = nodes.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: nodes.log_of(n) for n in codes}
    ev = {n: events(tmp_path, n) for n in "abc"}
    (left,) = [e for e in ev["c"] if e["event"] == "left"]
    assert steps_of(ev["c"])[-1] == left["step"] < 60  # it never trained past its leave
    for n in "ab":
        assert pids(ev[n]) == {started_pid(procs[n].pid)}, n  # never restarted
        assert steps_of(ev[n]) == list(range(1, 61)), n
        regroups = [(e["world"], e["reason"], e["step"]) for e in ev[n] if e["event"] == "regroup"]
        assert regroups == [(2, "leave", left["step"])], regroups
    assert "lost_node_leave" in nodes.log_of("a")
