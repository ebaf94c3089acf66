"""The standalone rendezvous store: a TCPStore that no worker hosts.

    python3 -c "$(python3 -c \
        'from elastrain_trainer.launch.rdzv_store import PROGRAM; print(PROGRAM)')" 0.0.0.0 29400
    python3 -m elastrain_trainer.launch.rdzv_store --host 0.0.0.0 --port 29400

Agents point --rdzv-endpoint at it with is_host=false, so losing any worker (even the one that
was rank 0) never takes the rendezvous down with it. PROGRAM needs python3 and torch only: the
operator renders the same text into the store pod's command (`python3 -c PROGRAM HOST PORT`), so
the store runs in any image with torch, a user's own image without elastrain's code included.
The operator cannot import this module (it never imports the trainer), so it holds a copy;
tests/unit/test_store_program.py keeps the two equal.
"""

from __future__ import annotations

import argparse
import sys

PROGRAM = """\
import signal, sys, threading
from datetime import timedelta
from torch.distributed import TCPStore
host, port = sys.argv[1], int(sys.argv[2])
done = threading.Event()
for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda *_: done.set())
store = TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True,
                 timeout=timedelta(hours=1))
print(f"rendezvous store listening on {host}:{store.port}", flush=True)
done.wait()
"""


def command(host: str, port: int, python: str = sys.executable) -> list[str]:
    """The store's command line, as the operator renders it for the store pod."""
    return [python, "-c", PROGRAM, host, str(port)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m elastrain_trainer.launch.rdzv_store")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=29400)
    args = parser.parse_args(argv)
    sys.argv = ["-c", args.host, str(args.port)]  # what PROGRAM reads, as under `python3 -c`
    exec(compile(PROGRAM, "<rdzv_store>", "exec"), {"__name__": "__main__"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
