"""Picking a TCP port to hand to a process that will bind it a moment later.

The usual trick (bind port 0, read the port, close) returns a port from the kernel's ephemeral
range, which is exactly where every later `bind(0)` and outgoing connection draws from: torchrun's
own store, gloo's pair sockets and boto3's connections may take the port in the gap before its
intended owner binds it, and the owner then fails to start (seen as a trainer whose /progress was
never served). Ports below the ephemeral range are handed out by nobody but us, so a port that
binds here stays free unless another caller of this module picks the same one: a random pick
from some 20 000 makes that rare, and the caller's bind fails loudly if it happens.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10000
# Linux's default ip_local_port_range starts here; read the real one when there is one.
DEFAULT_EPHEMERAL_START = 32768
ATTEMPTS = 200


def ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def free_port(address: str = "127.0.0.1") -> int:
    """A port that binds on `address` now and lies below the ephemeral range (see above)."""
    top = ephemeral_start()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    if top - LOWEST >= 1000:
        for _ in range(ATTEMPTS):
            port = random.randrange(LOWEST, top)
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((address, port))
                except OSError:
                    continue
                return port
    # A host whose ephemeral range leaves no room below it: the kernel's pick, with its race.
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
