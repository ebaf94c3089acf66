"""The standalone rendezvous store: a TCPStore that no worker hosts.

    python -m elastrain_trainer.rdzv_store --host 0.0.0.0 --port 29400

Agents point --rdzv-endpoint at it with is_host=false, so losing any worker (even the
one that was rank 0) never takes the rendezvous down with it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastrain_trainer.rdzv_store")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=29400)
    args = parser.parse_args(argv)
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                     use_libuv=True, timeout=timedelta(hours=1))
    print(f"rendezvous store listening on {args.host}:{store.port}", flush=True)
    done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
