"""The rendezvous store's program: the operator renders it into the store pod (it never imports
the trainer), local mode runs the trainer's copy; both must be the same text, and the program
must serve a store with nothing but torch importable."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from elastrain_operator.render.rendezvous import STORE_PROGRAM
from elastrain_trainer.launch import rdzv_store
from elastrain_trainer.ports import free_port


def test_the_operator_renders_the_trainers_store_program() -> None:
    assert STORE_PROGRAM == rdzv_store.PROGRAM


def test_the_program_serves_a_store_without_elastrain_importable(tmp_path: Path) -> None:
    # A user's image has torch but not elastrain: shadow both packages so that importing either
    # fails, then run the program exactly as the store pod's command line does.
    for package in ("elastrain_trainer", "elastrain_operator"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            f"raise ImportError('{package} is not in a user image')\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", STORE_PROGRAM, "127.0.0.1", str(port)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"rendezvous store listening on 127.0.0.1:{port}"
        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0  # SIGTERM: a clean stop, as the pod's grace expects
