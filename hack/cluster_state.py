"""What the other hack/cluster_* modules share: the cluster's fixed settings, `ClusterError`, the
server processes (spawn, wait until ready, stop) and their record in DIR/state.json (`State`).
Part of hack/cluster.py (standard library only)."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def _ports_module() -> Any:
    """The trainer's port picker (elastrain_trainer/ports.py, standard library only), loaded from
    its file: importing the package would run its __init__ (pydantic), and this harness runs
    under a bare python3 too."""
    path = Path(__file__).resolve().parents[1] / "trainer_image/elastrain_trainer/ports.py"
    spec = importlib.util.spec_from_file_location("elastrain_ports", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


free_port: Callable[..., int] = _ports_module().free_port
SHM = Path("/dev/shm")
BUCKET = "elastrain-test"
REGION = "us-east-1"
SERVICE_CIDR = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"


class ClusterError(RuntimeError):
    """A server could not be started or did not become ready."""


# -------------------------------------------------------------------------------------- processes


def _die_with_parent() -> None:
    """preexec_fn: have the kernel send SIGTERM to the child when the parent thread exits."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


@dataclass
class Proc:
    """A started server as recorded in state.json."""

    name: str
    pid: int
    argv: list[str]
    log: str

    def alive(self) -> bool:
        """True while our process (not a later one that reused the PID) runs."""
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        zombie = stat.rpartition(")")[2].split()[0] == "Z"
        return not zombie and cmdline[0].decode() == self.argv[0]


def spawn(name: str, argv: list[str], logs: Path, *, die_with_parent: bool,
          env: dict[str, str] | None = None) -> tuple[Proc, subprocess.Popen[bytes]]:
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    return Proc(name, popen.pid, argv, str(log)), popen


def stop(proc: Proc, timeout: float = 15.0) -> None:
    if not proc.alive():
        return
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.alive():
        os.kill(proc.pid, signal.SIGKILL)


def wait_until(what: str, check: Callable[[], bool], popen: subprocess.Popen[bytes] | None,
               log: str | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            raise ClusterError(f"{what} exited with {popen.returncode}; see {log}:\n{tail(log)}")
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ssl.SSLError, ValueError):
            pass
        time.sleep(0.2)
    raise ClusterError(f"{what} not ready after {timeout:.0f} s; see {log}:\n{tail(log)}")


def tail(log: str | None, lines: int = 20) -> str:
    if not log or not Path(log).exists():
        return ""
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])


# ------------------------------------------------------------------------------------------ state


@dataclass
class State:
    """Everything `env` and `down` need, kept in DIR/state.json."""

    dir: str
    tier: str = "none"
    k8s_version: str = ""
    server: str = ""
    kubeconfig: str = ""
    s3_endpoint: str = ""
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_bucket: str = BUCKET
    s3_region: str = REGION
    data_dirs: list[str] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    # Tier node: what teardown must restore on the host (hack/node/tier.py).
    node: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return Path(self.dir) / "state.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(self.path)

    @classmethod
    def load(cls, directory: Path) -> State | None:
        try:
            raw = json.loads((directory / "state.json").read_text())
        except (OSError, ValueError):
            return None
        raw["procs"] = [Proc(**p) for p in raw.get("procs", [])]
        return cls(**raw)

    def running(self) -> bool:
        return bool(self.procs) and all(p.alive() for p in self.procs)

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.kubeconfig:
            out |= {"KUBECONFIG": self.kubeconfig, "ELASTRAIN_KUBECONFIG": self.kubeconfig}
        if self.s3_endpoint:
            out |= {"ELASTRAIN_S3_ENDPOINT": self.s3_endpoint,
                    "ELASTRAIN_S3_ACCESS_KEY": self.s3_access_key,
                    "ELASTRAIN_S3_SECRET_KEY": self.s3_secret_key,
                    "ELASTRAIN_S3_BUCKET": self.s3_bucket,
                    "ELASTRAIN_S3_REGION": self.s3_region}
        return out
