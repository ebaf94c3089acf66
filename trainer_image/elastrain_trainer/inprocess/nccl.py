"""A member on GPUs (issue 35 item 3; docs/recovery.md section 4): what NCCL needs that gloo
does not. Experimental: written to torch's documented abort path and run here only on gloo;
no NCCL group has been aborted and re-made by this code on a GPU yet (the section says exactly
what is and is not verified).

What differs from a gloo member:
- A generation's default group is `cpu:gloo,cuda:nccl`, bound to this rank's device
  (`device_id`): NCCL makes its communicators at init, so a planned peer missing at init fails
  the init within the forming bound, as gloo's rendezvous does, not the first collective.
  CPU tensors (the Session's control and checkpoint groups, heals of CPU state) stay on gloo.
- A failed generation's collective blocked on a dark peer is a kernel spinning on the device:
  shutting down sockets (inprocess.sever) does not reach it. The heartbeat thread aborts the
  generation's NCCL communicators (`ProcessGroup.abort`, ncclCommAbort), which ends the
  kernel; the training thread's wait then raises and the usual recovery runs.
- torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING (3, SkipCleanUp; 1, TearDown, likewise)
  ends the process when its watchdog sees a collective fail or time out: the survivor would
  die with the peer. 2 (CleanUpOnly) aborts the communicator and leaves the process, so the
  error reaches the training thread; 0 leaves it to us. Set before the first NCCL group.

The model, its optimizer state and the CUDA context stay where they are: only the groups are
remade, on the same device, and DDP re-wrapped on them (as on gloo).
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping

import torch
import torch.distributed as dist

from elastrain_trainer.events import emit

GLOO = "gloo"
# CUDA tensors on NCCL, CPU tensors (the Session's side groups, DCP's coordination) on gloo.
DEVICE_BACKEND = "cpu:gloo,cuda:nccl"
ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
LEGACY_ERROR_HANDLING_ENV = "NCCL_ASYNC_ERROR_HANDLING"  # torch reads it too
CLEAN_UP_ONLY = "2"
KEEPS_THE_PROCESS = frozenset({"0", "2"})  # NoHandling, CleanUpOnly


def backend_for(device: torch.device) -> str:
    return DEVICE_BACKEND if device.type == "cuda" else GLOO


def is_device_backend(backend: str) -> bool:
    return "nccl" in backend


def error_handling_message(name: str, value: str) -> str:
    return (f"{name}={value} ends the process when NCCL's watchdog sees a failed collective, "
            "so an in-process survivor would die with its peer: in-process recovery needs 0 "
            "or 2 (unset: elastrain sets 2, CleanUpOnly)")


def prepare_error_handling(environ: MutableMapping[str, str]) -> str:
    """Before the first NCCL group: the value the process runs with. Unset, 2; a value that
    tears the process down is refused (ValueError naming it), never overridden silently."""
    for name in (ERROR_HANDLING_ENV, LEGACY_ERROR_HANDLING_ENV):
        value = environ.get(name)
        if value is not None:
            if value.strip() not in KEEPS_THE_PROCESS:
                raise ValueError(error_handling_message(name, value))
            return value.strip()
    environ[ERROR_HANDLING_ENV] = CLEAN_UP_ONLY
    return CLEAN_UP_ONLY


def has_device_backend(group: dist.ProcessGroup | None) -> bool:
    try:
        return is_device_backend(str(dist.get_backend(group)))
    except (RuntimeError, ValueError):  # not a group c10d knows (any more)
        return False


class DeviceGroups:
    """The NCCL groups of the generation in use (its default group, and the groups made in it:
    a mesh's, the script's), for the heartbeat thread to abort when the generation fails.

    References are held only on a device backend (a gloo group lives until its last reference
    goes, and its sockets with it) and dropped before the generation is destroyed; the lock
    keeps an abort on the heartbeat thread from racing that destroy on the training thread."""

    def __init__(self, node_id: str, backend: str) -> None:
        self.node_id, self.on_device = node_id, is_device_backend(backend)
        self._lock = threading.Lock()
        self._groups: list[dist.ProcessGroup] = []

    def add(self, group: dist.ProcessGroup | None) -> None:
        if self.on_device and group is not None and has_device_backend(group):
            with self._lock:
                self._groups.append(group)

    def abort(self, gen: int) -> int:
        """The heartbeat thread's, once `gen` (which these groups serve) failed: abort their
        communicators; how many groups."""
        with self._lock:
            groups, aborted = list(self._groups), 0
            for group in groups:
                try:
                    group.abort()
                    aborted += 1
                except RuntimeError as e:  # already aborted by torch's watchdog (CleanUpOnly)
                    emit("abort_failed", node=self.node_id, gen=gen, error=str(e)[:200])
            return aborted

    def drop(self) -> None:
        """The training thread's, before the generation's groups are destroyed."""
        with self._lock:
            self._groups.clear()
