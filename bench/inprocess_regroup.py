"""In-process recovery primitives vs torchft vs today's restart path (issue 21's engine choice).

    .venv/bin/python bench/inprocess_regroup.py [--rounds 5] [--models gpt-tiny,gpt-small,gpt-100m]
                                               [--torchft-python /tmp/tfv/bin/python]
    make bench-inprocess                          # the same, ~7 min here under load

Everything runs on loopback (127.0.0.1, GLOO_SOCKET_IFNAME=lo), one thread per process, and
each wait is bounded (--timeout). One job store (a TCPStore, as the job's store pod) in this
process; measurements interleaved round by round (perf.md), medians and ratios printed at the end:

  regroup   (a) long-lived worker processes A, B, C (torch imported, models built) re-form the
            gloo default group in the same process: destroy_process_group(), then
            init_process_group(store=PrefixStore("p/gen/<g>", store)), then one all_reduce.
            Per round: 3->2 and 2->1 (with notice), 1->2 and 2->3 (C joins, warm), and a
            no-notice 3->2: C is SIGKILLed while all three run all_reduces; measured to the
            survivors' first all_reduce at world 2 (kill -> error seen on every survivor ->
            regrouped), then a fresh warm C is started off the clock.
  state     (b) a joiner receives model + AdamW state (+ step) from one peer: one flat fp32 buffer
            per model sent point to point (send/recv) on the new group; pack, wire, unpack and a
            checksum compared; beside a memory copy of the same bytes (the ceiling).
  torchft   (c) if --torchft-python runs torchft (a separate venv: it is not a project
            dependency): a Lighthouse and 3 replica groups of one process each (Manager,
            ProcessGroupGloo, PGTransport, use_async_quorum=False, steps paced at --ft-pace-s);
            per round the newest replica leaves (3->2, Manager.shutdown) and a warm process joins
            (2->3) and heals gpt-small from a peer. Leave = leave signal -> every survivor's first
            committed step at 2 participants; join = go -> the joiner's first committed step.
  restart   (d) today's path without torchrun's rendezvous round: 2 new processes start, import
            torch (and elastrain_trainer.api, as the trainer does) and init a gloo group, one
            all_reduce: spawn -> both done.

Writes bench/results/inprocess_regroup.json; summarised in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer_image"))
HOST = "127.0.0.1"
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MASTER_ADDR": HOST}
GROUP_TIMEOUT = timedelta(seconds=10)  # bounds any collective that would hang in this bench
SEQ_LEN = 256


# ---------------------------------------------------------------- shared: model + AdamW state
def build_state(name: str) -> tuple[Any, Any]:
    """The preset with AdamW state materialised (one step on zero grads), as a live trainer has."""
    import torch

    from elastrain_trainer.model import build_model

    torch.manual_seed(0)
    model = build_model(name, SEQ_LEN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def state_tensors(model: Any, opt: Any) -> list[Any]:
    """Every tensor a joiner needs, in an order both sides derive from the same model."""
    out = [p.data for p in model.parameters()]
    for p in model.parameters():
        st = opt.state[p]
        out += [st["exp_avg"], st["exp_avg_sq"], st["step"]]
    return out


# ---------------------------------------------------------------- (a, b) primitives worker
def primitives_worker(wid: str, port: int, models: list[str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=120))
    states = {m: build_state(m) for m in models}
    store.set(f"p/ready/{wid}", "1")
    seq = 0
    while True:
        seq += 1
        cmd = json.loads(store.get(f"p/cmd/{wid}/{seq}"))
        res: dict[str, Any] = {"op": cmd["op"]}
        op = cmd["op"]
        if op == "exit":
            store.set(f"p/res/{wid}/{seq}", json.dumps(res))
            return
        if op in ("group", "leave"):
            t0 = time.perf_counter()
            if dist.is_initialized():
                dist.destroy_process_group()
            t1 = time.perf_counter()
            res["destroy_s"] = t1 - t0
            if op == "group":
                prefixed = dist.PrefixStore(f"p/gen/{cmd['gen']}", store)
                dist.init_process_group("gloo", store=prefixed, rank=cmd["rank"],
                                        world_size=cmd["world"], timeout=GROUP_TIMEOUT)
                t2 = time.perf_counter()
                dist.all_reduce(torch.ones(1))
                t3 = time.perf_counter()
                res.update(init_s=t2 - t1, first_all_reduce_s=t3 - t2)
        elif op in ("send", "recv"):
            model, opt = states[cmd["model"]]
            tensors = state_tensors(model, opt)
            t0 = time.perf_counter()
            if op == "send":
                buf = torch.cat([t.reshape(-1).float() for t in tensors])
                t1 = time.perf_counter()
                dist.send(buf, dst=cmd["peer"])
                t2 = time.perf_counter()
                t3 = t2
            else:
                buf = torch.empty(sum(t.numel() for t in tensors))
                t1 = time.perf_counter()
                dist.recv(buf, src=cmd["peer"])
                t2 = time.perf_counter()
                offset = 0
                for t in tensors:
                    t.view(-1).copy_(buf[offset:offset + t.numel()])
                    offset += t.numel()
                t3 = time.perf_counter()
            # the ceiling: one memory copy of the same bytes (timed on <= 64 MiB, scaled)
            part = buf[: 16 << 20]
            t4 = time.perf_counter()
            copy = part.clone()
            memcpy_s = (time.perf_counter() - t4) * buf.numel() / part.numel()
            res.update(pack_s=t1 - t0, wire_s=t2 - t1, unpack_s=t3 - t2,
                       total_s=t3 - t0, memcpy_s=memcpy_s,
                       bytes=buf.numel() * 4, checksum=float(buf.sum(dtype=torch.float64)))
            del copy, part, buf
        elif op == "steady":
            # the per-step agreement the Session already pays: one small all_reduce
            times = []
            for _ in range(cmd["n"]):
                t0 = time.perf_counter()
                dist.all_reduce(torch.ones(4096))
                times.append(time.perf_counter() - t0)
            res["all_reduce_s"] = statistics.median(times)
        elif op == "spin":
            # all_reduce until a peer is gone; then tear down at once, which closes our sockets
            # and turns the other survivors' blocked collective into an error too.
            store.set(f"p/spinning/{wid}", "1")
            try:
                while True:
                    dist.all_reduce(torch.ones(1))
                    time.sleep(0.005)
            except Exception as e:
                res.update(error_at=time.time(), error=str(e).splitlines()[0][:160])
            t0 = time.perf_counter()
            dist.destroy_process_group()
            res["destroy_s"] = time.perf_counter() - t0
        store.set(f"p/res/{wid}/{seq}", json.dumps(res))


# ---------------------------------------------------------------- (c) torchft replica
def torchft_worker(wid: str, port: int, lighthouse: str, model_name: str, pace: float) -> None:
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    torch.set_num_threads(1)
    ctl = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=120))
    own = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)  # the group's store
    model, opt = build_state(model_name)
    ctl.set(f"ft/ready/{wid}", "1")
    ctl.wait([f"ft/go/{wid}"])
    t_go = time.time()

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg, load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        min_replica_size=1, use_async_quorum=False, rank=0, world_size=1,
        store_addr=HOST, store_port=own.port, lighthouse_addr=lighthouse, replica_id=wid,
        hostname=HOST, timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=30),
                                         device=torch.device("cpu")))
    grad = torch.ones(4096)
    records: list[list[Any]] = []
    while True:
        state = ctl.get("ft/state").decode()
        if ctl.check([f"ft/leave/{wid}"]) or state == "stop":
            break
        if state == "pause":
            time.sleep(0.05)
            continue
        t0 = time.time()
        manager.start_quorum()
        manager.allreduce(grad.clone()).wait()
        ok = manager.should_commit()
        records.append([t0, time.time(), manager.num_participants(), bool(ok),
                        manager.current_step()])
        time.sleep(pace)
    manager.shutdown(wait=False)
    ctl.set(f"ft/rec/{wid}", json.dumps({"go": t_go, "steps": records}))


# ---------------------------------------------------------------- (d) restart path child
RESTART_CHILD = """
import sys, time, json
t0 = time.time()
import torch, torch.distributed as dist
t1 = time.time()
import elastrain_trainer.api
t2 = time.time()
from datetime import timedelta
port, gen, rank = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore(gen, store), rank=rank, world_size=2,
                        timeout=timedelta(seconds=10))
dist.all_reduce(torch.ones(1))
t3 = time.time()
store.set(f"{gen}/done/{rank}", json.dumps({"start": t0, "import_torch_s": t1 - t0,
          "import_trainer_s": t2 - t1, "group_s": t3 - t2, "done": t3}))
dist.destroy_process_group()
"""


# ---------------------------------------------------------------- the driver
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.args = args
        self.store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                                   use_libuv=True, timeout=timedelta(seconds=args.timeout))
        self.port = self.store.port
        self.env = {**os.environ, **LOOPBACK_ENV,
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "trainer_image"),
                                                   os.environ.get("PYTHONPATH", "")])}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.seq: dict[str, int] = {}
        self.gen = 0
        self.rows: dict[str, list[Any]] = {}
        self.spawned = 0

    # -- processes
    def spawn(self, kind: str, wid: str, *extra: str, python: str = sys.executable) -> None:
        cmd = [python, str(Path(__file__).resolve()), "--worker", kind, "--id", wid,
               "--port", str(self.port), *extra]
        self.procs[wid] = subprocess.Popen(cmd, env=self.env, cwd=ROOT)
        self.seq[wid] = 0

    def spawn_primitive(self, wid: str) -> None:
        # only A (the source) and the C joiners hold the models: B never sends or receives
        self.spawn("primitives", wid, "--models", "" if wid == "B" else self.args.models)

    def wait_key(self, key: str) -> bytes:
        self.store.wait([key], timedelta(seconds=self.args.timeout))
        return self.store.get(key)

    def send(self, wid: str, **cmd: Any) -> int:
        self.seq[wid] += 1
        self.store.set(f"p/cmd/{wid}/{self.seq[wid]}", json.dumps(cmd))
        return self.seq[wid]

    def result(self, wid: str, seq: int) -> dict[str, Any]:
        return dict(json.loads(self.wait_key(f"p/res/{wid}/{seq}")))

    def add(self, name: str, value: Any) -> None:
        self.rows.setdefault(name, []).append(value)

    # -- (a) regroup
    def regroup(self, members: list[str], leavers: Sequence[str] = ()) -> float:
        self.gen += 1
        t0 = time.perf_counter()
        seqs = {w: self.send(w, op="group", gen=self.gen, rank=r, world=len(members))
                for r, w in enumerate(members)}
        seqs.update({w: self.send(w, op="leave") for w in leavers})
        results = {w: self.result(w, s) for w, s in seqs.items()}
        wall = time.perf_counter() - t0
        for w in members:
            for k in ("destroy_s", "init_s", "first_all_reduce_s"):
                self.add(f"part_{k}", results[w][k])
        return wall

    def transfer(self, model: str, src: str, dst: str, ranks: dict[str, int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        s = self.send(src, op="send", model=model, peer=ranks[dst])
        r = self.send(dst, op="recv", model=model, peer=ranks[src])
        sent, got = self.result(src, s), self.result(dst, r)
        assert sent["checksum"] == got["checksum"], (sent, got)
        return {"wall_s": time.perf_counter() - t0, "bytes": got["bytes"],
                "pack_s": sent["pack_s"], "wire_s": got["wire_s"], "unpack_s": got["unpack_s"],
                "memcpy_s": got["memcpy_s"]}

    def no_notice(self, members: list[str], victim: str) -> dict[str, float]:
        seqs = {w: self.send(w, op="spin") for w in members}
        for w in members:
            self.wait_key(f"p/spinning/{w}")
            self.store.delete_key(f"p/spinning/{w}")
        time.sleep(0.05)
        t_kill = time.time()
        t0 = time.perf_counter()
        self.procs[victim].send_signal(signal.SIGKILL)
        survivors = [w for w in members if w != victim]
        errs = {w: self.result(w, seqs[w]) for w in survivors}
        detected = max(e["error_at"] for e in errs.values()) - t_kill
        self.procs[victim].wait(timeout=10)
        regroup = self.regroup(survivors)
        return {"detect_all_s": detected, "kill_to_regrouped_s": time.perf_counter() - t0,
                "regroup_s": regroup, "error": errs[survivors[0]]["error"]}

    def primitives_round(self, first: bool) -> None:
        a, b, c = "A", "B", f"C{self.spawned}"
        if first:
            self.add("regroup_start_3", self.regroup([a, b, c]))
        self.add("regroup_3to2_notice", self.regroup([a, b], [c]))
        self.add("regroup_2to1_notice", self.regroup([a], [b]))
        self.add("regroup_1to2", self.regroup([a, b]))
        self.add("regroup_2to3_warm_joiner", self.regroup([a, b, c]))
        seqs = {w: self.send(w, op="steady", n=20) for w in (a, b, c)}
        self.add("steady_all_reduce_4096_at_3",
                 max(self.result(w, q)["all_reduce_s"] for w, q in seqs.items()))
        for model in self.args.models.split(","):
            self.add(f"state_{model}", self.transfer(model, a, c, {a: 0, b: 1, c: 2}))
        self.add("no_notice_3to2", self.no_notice([a, b, c], c))
        self.spawned += 1
        c2 = f"C{self.spawned}"
        self.spawn_primitive(c2)
        self.wait_key(f"p/ready/{c2}")
        self.add("regroup_2to3_warm_joiner", self.regroup([a, b, c2]))

    # -- (d) restart path
    def restart_sample(self, i: int) -> None:
        gen = f"r/{i}"
        t0 = time.time()
        procs = [subprocess.Popen([sys.executable, "-c", RESTART_CHILD, str(self.port), gen,
                                   str(r)], env=self.env, cwd=ROOT) for r in range(2)]
        done = [json.loads(self.wait_key(f"{gen}/done/{r}")) for r in range(2)]
        for p in procs:
            p.wait(timeout=self.args.timeout)
        self.add("restart_spawn_to_group", max(d["done"] for d in done) - t0)
        for k in ("import_torch_s", "import_trainer_s", "group_s"):
            self.add(f"restart_{k}", max(d[k] for d in done))

    # -- (c) torchft
    def torchft_start(self) -> bool:
        py = self.args.torchft_python
        if not py or not Path(py).exists():
            self.rows["torchft_skipped"] = [f"no python at {py!r}"]
            return False
        check = subprocess.run([py, "-c", "import torchft"], env=self.env, capture_output=True)
        if check.returncode != 0:
            self.rows["torchft_skipped"] = [check.stderr.decode()[-300:]]
            return False
        from elastrain_trainer.ports import free_port

        lport = free_port()
        self.lighthouse = subprocess.Popen(
            [str(Path(py).parent / "torchft_lighthouse"), "--bind", f"{HOST}:{lport}",
             "--min_replicas", "1", "--quorum_tick_ms", str(self.args.ft_tick_ms),
             "--join_timeout_ms", str(self.args.ft_join_timeout_ms),
             "--heartbeat_timeout_ms", str(self.args.ft_heartbeat_timeout_ms)],
            env=self.env, stderr=subprocess.DEVNULL)
        self.ft_addr = f"http://{HOST}:{lport}"
        self.store.set("ft/state", "pause")
        self.ft_alive: list[str] = []
        for i in range(3):
            self.ft_spawn(f"ft{i}")
        for w in self.ft_alive:
            self.wait_key(f"ft/ready/{w}")
        self.store.set("ft/state", "run")
        for w in self.ft_alive:
            self.store.set(f"ft/go/{w}", "1")
        self.ft_next = 3
        self.ft_events: list[dict[str, Any]] = []
        time.sleep(3.0)  # first quorum + init_sync heal
        self.store.set("ft/state", "pause")
        return True

    def ft_spawn(self, wid: str) -> None:
        self.spawn("torchft", wid, "--lighthouse", self.ft_addr, "--ft-model",
                   self.args.ft_model, "--ft-pace-s", str(self.args.ft_pace_s),
                   python=self.args.torchft_python)
        self.ft_alive.append(wid)

    def torchft_round(self) -> None:
        joiner = f"ft{self.ft_next}"
        self.ft_next += 1
        self.ft_spawn(joiner)
        self.wait_key(f"ft/ready/{joiner}")  # warm: imports done, model built
        self.store.set("ft/state", "run")
        time.sleep(1.0)
        leaver = self.ft_alive[-2]
        t_leave = time.time()
        self.store.set(f"ft/leave/{leaver}", "1")
        time.sleep(self.args.ft_settle_s)
        t_go = time.time()
        self.store.set(f"ft/go/{joiner}", "1")
        time.sleep(self.args.ft_settle_s)
        self.store.set("ft/state", "pause")
        self.ft_alive.remove(leaver)
        self.procs[leaver].wait(timeout=self.args.timeout)
        self.ft_events.append({"leaver": leaver, "joiner": joiner, "t_leave": t_leave,
                               "t_go": t_go})

    def torchft_finish(self) -> None:
        self.store.set("ft/state", "stop")
        recs = {}
        for w in list(self.procs):
            if w.startswith("ft"):
                recs[w] = json.loads(self.wait_key(f"ft/rec/{w}"))
                self.procs[w].wait(timeout=self.args.timeout)
        self.lighthouse.terminate()
        self.lighthouse.wait(timeout=10)
        for ev in self.ft_events:
            survivors = ["ft0", "ft1"]  # never leave; ft2, ft3, ... leave in turn
            firsts = [next((s[1] for s in recs[w]["steps"] if s[0] >= ev["t_leave"]
                            and s[2] == 2 and s[3]), None) for w in survivors]
            if firsts and None not in firsts:
                self.add("torchft_leave_3to2", max(firsts) - ev["t_leave"])
            lost = sum(1 for w in survivors for s in recs[w]["steps"]
                       if ev["t_leave"] <= s[0] < ev["t_go"] and not s[3])
            self.add("torchft_uncommitted_steps_on_leave", lost)
            j = recs[ev["joiner"]]["steps"]
            first = next((s[1] for s in j if s[3]), None)
            if first is not None:
                self.add("torchft_join_2to3_with_heal", first - ev["t_go"])
                gaps = [s2[1] - s1[1] for w in survivors
                        for s1, s2 in zip(recs[w]["steps"], recs[w]["steps"][1:], strict=False)
                        if ev["t_go"] - 0.5 <= s1[1] <= first + 0.5]
                if gaps:
                    self.add("torchft_survivor_max_gap_on_join", max(gaps))
        steady = [s[1] - s[0] for r in recs.values() for s in r["steps"] if s[2] == 3 and s[3]]
        if steady:
            self.rows["torchft_steady_step_s_at_3"] = steady

    def close(self) -> None:
        for w, p in self.procs.items():
            if p.poll() is None and not w.startswith("ft"):
                self.send(w, op="exit")
        deadline = time.time() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()


def summarize(rows: dict[str, list[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, vals in rows.items():
        if vals and isinstance(vals[0], dict):
            keys = [k for k, v in vals[0].items() if isinstance(v, int | float)]
            out[name] = {k: {"median": statistics.median(v[k] for v in vals),
                             "min": min(v[k] for v in vals), "max": max(v[k] for v in vals)}
                         for k in keys}
            out[name]["n"] = len(vals)
            errs = {v["error"] for v in vals if "error" in v}
            if errs:
                out[name]["errors"] = sorted(errs)
        elif vals and isinstance(vals[0], int | float):
            out[name] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
                         "n": len(vals)}
        else:
            out[name] = vals
    return out


def ratios(s: dict[str, Any]) -> dict[str, float]:
    restart = s["restart_spawn_to_group"]["median"]
    r = {f"restart_over_{k}": restart / s[k]["median"]
         for k in ("regroup_3to2_notice", "regroup_2to1_notice", "regroup_2to3_warm_joiner")}
    no_notice = s["no_notice_3to2"]["kill_to_regrouped_s"]["median"]
    r["restart_over_no_notice_3to2"] = restart / no_notice
    if "torchft_leave_3to2" in s:
        r["torchft_leave_over_primitives_3to2"] = (
            s["torchft_leave_3to2"]["median"] / s["regroup_3to2_notice"]["median"])
    small = s.get(f"state_{'gpt-small'}")
    if "torchft_join_2to3_with_heal" in s and small:
        join = s["regroup_2to3_warm_joiner"]["median"] + small["wall_s"]["median"]
        r["torchft_join_over_primitives_join_plus_gpt_small_state"] = (
            s["torchft_join_2to3_with_heal"]["median"] / join)
    return r


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="gpt-tiny,gpt-small,gpt-100m")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--torchft-python", default="/tmp/tfv/bin/python")
    parser.add_argument("--ft-model", default="gpt-small")
    parser.add_argument("--ft-pace-s", type=float, default=0.1)
    parser.add_argument("--ft-tick-ms", type=int, default=100)
    parser.add_argument("--ft-join-timeout-ms", type=int, default=1000)
    parser.add_argument("--ft-heartbeat-timeout-ms", type=int, default=1000)
    parser.add_argument("--ft-settle-s", type=float, default=6.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/inprocess_regroup.json")
    # worker modes (this file re-executed)
    parser.add_argument("--worker", choices=("primitives", "torchft"))
    parser.add_argument("--id", default="")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lighthouse", default="")
    args = parser.parse_args()
    if args.worker == "primitives":
        primitives_worker(args.id, args.port, [m for m in args.models.split(",") if m])
        return 0
    if args.worker == "torchft":
        torchft_worker(args.id, args.port, args.lighthouse, args.ft_model, args.ft_pace_s)
        return 0

    import torch

    os.environ.update(LOOPBACK_ENV)
    started = time.time()
    bench = Bench(args)
    try:
        for w in ("A", "B", "C0"):
            bench.spawn_primitive(w)
        for w in ("A", "B", "C0"):
            bench.wait_key(f"p/ready/{w}")
        has_ft = bench.torchft_start()
        for i in range(args.rounds):
            bench.primitives_round(first=i == 0)
            bench.restart_sample(i)
            if has_ft:
                bench.torchft_round()
            print(f"round {i + 1}/{args.rounds} done at +{time.time() - started:.0f} s",
                  flush=True)
        if has_ft:
            bench.torchft_finish()
    finally:
        bench.close()
    summary = summarize(bench.rows)
    result = {"date": time.strftime("%Y-%m-%d"), "summary": summary, "ratios": ratios(summary),
              "raw": bench.rows, "wall_s": time.time() - started,
              "args": {k: str(v) for k, v in vars(args).items() if k not in
                       ("worker", "id", "port", "lighthouse")},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "torch": torch.__version__}}
    print(json.dumps({"summary": summary, "ratios": result["ratios"]}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
