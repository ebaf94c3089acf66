"""Every private library API elastrain relies on: where, why, and what happens if it breaks.

A private name can change in any release, so each one here is (a) used only with the library
range pyproject.toml pins to what the tests ran, (b) exercised against the real library classes
by tests/unit/contract/test_private_hooks.py (or tests/integration/trainer/test_private_hooks.py
where it needs a server or real processes), so an upgrade that breaks one fails CI, and (c)
checked at run time where it is used, so that a missing one stops the process with a message
naming the hook and the tested versions (MissingPrivateHook) instead of quietly degrading.

torch (launch/agent.py; checked when `python -m elastrain_trainer.launch` starts)
- `LocalElasticAgent._stop_workers` is replaced, `_shutdown(timeout=)` is called with
  `SimpleElasticAgent._shutdown_timeout`: a worker-group restart (a peer was preempted) waits
  --shutdown-timeout for the SIGTERM checkpoint instead of torchrun's fixed 30 s. Broken: the
  survivors' long saves are SIGKILLed and never commit.
- `torch.distributed.launcher.api.LocalElasticAgent` (the global `launch_agent` builds its agent
  from) is replaced by a subclass whose `_monitor_workers` ends the node on a worker's own crash
  and sets `spec.rdzv_handler.shutdown` to a no-op so the rendezvous stays open for the
  replacement. Broken: a crashing trainer restarts in place forever, maxRestarts never applies.
  Escape hatch: ELASTRAIN_PLAIN_TORCHRUN=1 runs plain torchrun without any of these patches (and
  says what is lost); without it a missing hook stops the launcher with exit code 1.
- On a worker's crash in a multi-node world, the same subclass arrives at torchrun's exit barrier
  itself (`torch.distributed.elastic.utils.store._barrier_nonblocking` with
  `agent.server.api._TERMINAL_STATE_SYNC_ID` on `SimpleElasticAgent._store`, and its own
  `_exit_barrier` skips a second arrival): when every peer is there, the world finished and the
  node ends 0 with a warning. Broken: a crash after the world finished is counted and replaced,
  and the peers wait 5 minutes at the barrier (checked when the agent is made, or on the crash).
- `SubprocessHandler.close(death_sig=)` is replaced and `SubprocessContext._close(death_sig=,
  timeout=)` wrapped (torch.distributed.elastic.multiprocessing; the replacement signals
  `handler.proc` and closes the handler's `_stdout`/`_stderr` log files as torch's does, the
  wrapper reads `subprocess_handlers`): a stop's SIGTERM reaches each worker's process, not its
  process group, which is SIGKILLed at --shutdown-timeout or once the worker exited. Broken: a
  notice kills the trainer's DataLoader workers, the trainer fails mid-step instead of saving
  its step (restart mode) or leaving cleanly (in-process mode). On real processes:
  tests/integration/trainer/test_loader_workers_notice.py.
- In-process recovery only: after the signalled agent's shutdown, its `_pcontext`
  (`SubprocessContext.subprocess_handlers[rank].proc.returncode`) says whether every worker
  left cleanly, and then the launcher exits 0. Not enforced: without it the launcher exits 1
  as torchrun does (the pod still counts as evicted by its DisruptionTarget).

torch (session/stale_groups.py; checked by init_distributed)
- `torch.distributed.distributed_c10d._rank_not_in_group` is wrapped, reading `_world.pg_map`:
  every c10d collective calls it with its group first, and a group c10d no longer knows (the
  script's `dist.new_group` of a world that changed in process) raises StaleGroupError naming
  the fix. Broken: such a sub-group's collectives run on over the old members, silently.

torch (inprocess/fsdp.py; checked when the module is imported, i.e. at worker start)
- `torch.distributed._composable_state._module_state_mapping` and `_get_module_state`: in-process
  recovery rebuilds an FSDP2 model at a new world and turns the script's model object into the
  new one; FSDP2 looks its state up by module object in that registry, so the script's object is
  registered for the new state. Broken: `set_requires_gradient_sync` (gradient accumulation) and
  every FSDPModule method fail on the script's model after the first membership change.

torch (checkpoint/dcp_io.py; checked when the module is imported, i.e. at worker start)
- `torch._C.PyTorchFileReader`, `torch.serialization._load(..., overall_storage=,
  weights_only=)` and `torch._weights_only_unpickler`: a tensor of a verified shard is loaded as
  a view of the shard's memory (torch.load would copy every storage out of the stream).
- `torch.distributed._shard._utils.narrow_tensor_by_index`: the slice of a saved tensor a read
  item asks for, exactly as DCP's own reader takes it.
- DCP's `FileSystemWriter.fs` / `FileSystemReader.fs`, `.storage_data`, `.load_id` and the
  fields of `filesystem._StorageInfo` / `_StoragePrefix`: DCP's file format is reused with its
  filesystem swapped for our storage (hashing every file), and the streaming read copies tensors
  straight from the verified shard. Broken: DCP would write to local disk, or a sound
  checkpoint would fail to load and look damaged.
- `torch.distributed.algorithms._checkpoint.checkpoint_wrapper` (parallel.py): activation
  checkpointing per block, the wrapper torchtitan uses too (no public module holds it).
  Checked when parallel.py is imported.

botocore / urllib3 (checkpoint/s3.py, checkpoint/s3_transfer.py)
- `client._request_signer._credentials` (botocore): which credentials the client resolved and
  where from, for the messages that explain a refused store (never the secret). Checked when an
  S3Storage is made. Broken: the message would claim no credentials were found.
- `StreamingBody._raw_stream._fp` (botocore -> urllib3 -> http.client): a ranged read goes
  straight from the socket into the preallocated shard buffer; urllib3's own readinto copies
  every range several times under the GIL. The slower path is still correct, so a missing hook
  falls back to it with one `private_hook_missing` event per process (by design, not an error).

kopf (operator/elastrain_operator/handlers.py; the operator cannot import this package, so the
check is its own, with the same wording; its docstring says why the hook stays)
- `OperatorRegistry._spawning` and the handler dataclass's `requires_finalizer`: the per-job
  ticker daemon is registered without kopf's finalizer. Broken: the operator refuses to start.

Python (tokenfiles/dataset.py)
- `threading._register_atexit`: a remote dataset drops its queued reads before the interpreter
  joins the pool's threads at exit. CPython itself, not a pinned dependency; a missing one skips
  the early close (exit waits for the queued reads), so it is tested but not enforced.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Final

# The ranges pyproject.toml pins (the versions the tests ran); quoted by every failure here.
TESTED: Final = {
    "torch": ">=2.15,<2.16",
    "botocore": ">=1.36,<1.44",
    "urllib3": ">=2.8,<2.9",
}
PLAIN_TORCHRUN_ENV: Final = "ELASTRAIN_PLAIN_TORCHRUN"


class MissingPrivateHook(RuntimeError):
    """A private API elastrain relies on is gone or changed: the library is not a tested one."""


def installed(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def missing(hook: str, library: str, needed_for: str) -> MissingPrivateHook:
    """The error for a missing hook: what is gone, what for, and which versions work."""
    return MissingPrivateHook(
        f"{library} {installed(library)} has no {hook}, which elastrain needs {needed_for}; "
        f"elastrain is tested with {library}{TESTED[library]} (pyproject.toml): install one of "
        f"those (elastrain_trainer.private_hooks lists every private API it relies on)")


def require(owner: Any, name: str, *, library: str, needed_for: str,
            owner_name: str | None = None) -> Any:
    """owner.name, or MissingPrivateHook naming it (as `owner_name.name` when given)."""
    if not hasattr(owner, name):
        where = owner_name or getattr(owner, "__name__", None) or type(owner).__qualname__
        raise missing(f"{where}.{name}", library, needed_for)
    return getattr(owner, name)


def import_private(module: str, name: str, *, library: str, needed_for: str) -> Any:
    """`from module import name`, or MissingPrivateHook naming it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise missing(f"{module}.{name}", library, needed_for) from None


def require_params(fn: Callable[..., Any], names: Iterable[str], *, hook: str, library: str,
                   needed_for: str) -> None:
    """MissingPrivateHook unless `fn` takes every one of `names`."""
    params = inspect.signature(fn).parameters
    absent = [n for n in names if n not in params]
    if absent:
        raise missing(f"{hook}({', '.join(f'{n}=' for n in absent)})", library, needed_for)


def require_fields(cls: type, names: Iterable[str], *, library: str, needed_for: str) -> None:
    """MissingPrivateHook unless dataclass `cls` has every field in `names`."""
    fields = getattr(cls, "__dataclass_fields__", {})
    for name in names:
        if name not in fields:
            raise missing(f"{cls.__module__}.{cls.__qualname__}.{name}", library, needed_for)


def require_dcp_hooks() -> None:
    """The torch internals checkpoint/dcp_io.py uses (see the module docstring)."""
    import torch
    import torch.serialization
    from torch.distributed.checkpoint import filesystem

    in_place = "to load a verified shard's tensors in place (checkpoint/dcp_io.py)"
    require(torch._C, "PyTorchFileReader", library="torch", needed_for=in_place)
    require(torch, "_weights_only_unpickler", library="torch", needed_for=in_place)
    load = require(torch.serialization, "_load", library="torch", needed_for=in_place)
    require_params(load, ["overall_storage", "weights_only"],
                   hook="torch.serialization._load", library="torch", needed_for=in_place)
    dcp = "to read and write DCP's file format over elastrain's storage (checkpoint/dcp_io.py)"
    require_fields(filesystem._StorageInfo,
                   ["relative_path", "offset", "length", "transform_descriptors"],
                   library="torch", needed_for=dcp)
    require_fields(filesystem._StoragePrefix, ["prefix"], library="torch", needed_for=dcp)
