"""A generation forms after a failed one (inprocess/regroup.py), on real processes and gloo.

c10d names each process group by a per-process counter that only destroying the default group
resets. A generation's init that fails (a planned peer never came: gloo's rendezvous timed out)
counts a group but leaves no default group to destroy, so that process's next generation would
look for its peers under another group name than theirs, and every later generation fails
too. Seen in a CI run: after one node bailed out of a generation the other two had started to
init, all three failed every generation for three minutes (keys `gen/N/pg//1//...` against
`gen/N/pg//0//...`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.timeout(120)]

NODE = r"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from elastrain_trainer.inprocess import regroup

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
if rank == 1:  # generation 1: its peer never comes, the init times out
    try:
        regroup.init_generation(dist.PrefixStore("gen/1/pg/", store), 1, 2,
                                init_timeout=timedelta(seconds=1))
        raise SystemExit("generation 1 formed without its peer")
    except dist.DistError:
        print("generation 1 failed", flush=True)
    regroup.destroy()
    store.set("gen1-over", "1")
else:
    store.wait(["gen1-over"])
regroup.init_generation(dist.PrefixStore("gen/2/pg/", store), rank, 2,
                        init_timeout=timedelta(seconds=10))
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"generation 2 sum {total.item():.0f}", flush=True)
regroup.destroy()
"""


def test_a_generation_forms_after_this_node_failed_to_form_the_last_one() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                          wait_for_workers=False, use_libuv=True, timeout=timedelta(seconds=60))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-c", NODE, str(rank), str(store.port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "generation 1 failed" in outs[1], outs[1]
    assert all("generation 2 sum 3" in out for out in outs), outs
