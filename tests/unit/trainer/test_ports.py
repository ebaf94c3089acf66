"""free_port hands out ports outside the kernel's ephemeral range, so nothing else grabs them
between the pick and the owner's bind (a trainer whose /progress port went to torchrun's store)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from elastrain_trainer import ports


def test_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    start = ports.ephemeral_start()
    for _ in range(50):
        port = ports.free_port()
        assert ports.LOWEST <= port < start
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_range_is_read_from_the_kernel_setting(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert ports.ephemeral_start(str(setting)) == 40000
    assert ports.ephemeral_start(str(tmp_path / "absent")) == ports.DEFAULT_EPHEMERAL_START


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # The taken port twice, then whatever randrange gives: a fixed third pick (its
        # neighbour) was once in use too, by another pytest worker's server, and the picks ran
        # out (StopIteration in a fresh-clone run with 4 workers, 2026-12-02).
        picks = [taken, taken]
        real = ports.random.randrange
        monkeypatch.setattr(ports.random, "randrange",
                            lambda lo, hi: picks.pop(0) if picks else real(lo, hi))
        monkeypatch.setattr(ports, "ephemeral_start", lambda: 65536)
        assert ports.free_port() != taken


def test_no_room_below_the_range_falls_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST + 10)
    port = ports.free_port()
    assert 0 < port < 65536
