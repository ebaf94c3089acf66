"""Every private library API the trainer relies on (elastrain_trainer.private_hooks), exercised
against the installed libraries' real classes: an upgrade that breaks one fails here. Each
run-time check is also shown to stop with a message naming the hook and the tested versions.

The S3 body's raw stream needs a server: tests/integration/trainer/test_private_hooks.py.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import boto3
import pytest
import torch
from torch.distributed import HashStore  # type: ignore[attr-defined]
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler,
)
from torch.distributed.elastic.utils import store as store_util
from torch.distributed.launcher import api as launcher_api

from elastrain_trainer import private_hooks
from elastrain_trainer.checkpoint import dcp_io, s3
from elastrain_trainer.checkpoint.manifest import FileDigest
from elastrain_trainer.checkpoint.storage import ObjectSizeError
from elastrain_trainer.launch import agent as launch_agent
from elastrain_trainer.private_hooks import MissingPrivateHook

# --- torch: DCP's file format over our storage, tensors loaded in place (checkpoint/dcp_io.py)


class _Writer:
    def __init__(self, store: MemoryStreamingStorage, key: str) -> None:
        self.store, self.key, self.buffer = store, key, io.BytesIO()
        self.digest: tuple[int, str] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self.buffer.write(data)

    def tell(self) -> int:
        return self.buffer.tell()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        data = self.buffer.getvalue()
        self.store.objects[self.key] = data
        self.digest = (len(data), hashlib.sha256(data).hexdigest())

    def abort(self) -> None:
        self.buffer = io.BytesIO()


class MemoryStreamingStorage:
    """Our StreamingStorage protocol over a dict: DCP and torch are the real thing under test."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    @property
    def uri(self) -> str:
        return "memory://contract"

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self.objects[key] = bytes(data)

    def read(self, key: str) -> bytes:
        if key not in self.objects:
            raise FileNotFoundError(key)
        return self.objects[key]

    def exists(self, key: str) -> bool:
        return key in self.objects

    def list(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.objects if k.startswith(prefix))

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.objects.pop(key, None)

    def open_writer(self, key: str) -> _Writer:
        return _Writer(self, key)

    def read_into(self, key: str, into: memoryview,
                  on_range: Callable[[memoryview], None] | None = None) -> None:
        data = self.read(key)
        if len(data) != into.nbytes:
            raise ObjectSizeError(f"{key}: {len(data)} bytes, not {into.nbytes}")
        into[:] = data
        if on_range is not None:
            on_range(into)


def test_a_dcp_checkpoint_round_trips_through_the_streaming_reader() -> None:
    store = MemoryStreamingStorage()
    saved: dict[str, dict[str, FileDigest]] = {}
    state: dict[str, Any] = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
             "b": torch.tensor([1, 2, 3], dtype=torch.int64), "extra": {"step": 7}}
    dcp_save(state, storage_writer=dcp_io.CheckpointWriter(
        store, "step-7", lambda files, ranks: saved.__setitem__("files", files)))

    target: dict[str, Any] = {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.int64),
              "extra": {"step": 0}}
    dcp_load(target, storage_reader=dcp_io.CheckpointReader(store, "step-7", saved["files"]))

    assert torch.equal(target["w"], state["w"])
    assert torch.equal(target["b"], state["b"])
    assert target["extra"] == {"step": 7}


def test_a_saved_tensor_loads_as_a_view_of_the_shard_bytes() -> None:
    buffer = io.BytesIO()
    torch.save(torch.arange(8, dtype=torch.int32), buffer)
    shard = bytearray(buffer.getvalue())

    tensor = dcp_io._tensor_in_place(memoryview(shard))

    assert torch.equal(tensor, torch.arange(8, dtype=torch.int32))
    memory = torch.frombuffer(shard, dtype=torch.uint8)
    start = memory.data_ptr()
    assert start <= tensor.data_ptr() < start + len(shard)  # no copy


def test_narrow_tensor_by_index_takes_the_asked_slice() -> None:
    narrowed = dcp_io.narrow_tensor_by_index(torch.arange(12).reshape(3, 4),
                                             torch.Size([1, 2]), torch.Size([2, 2]))
    assert narrowed.tolist() == [[6, 7], [10, 11]]


def test_the_activation_checkpoint_wrapper_wraps_a_module() -> None:
    from elastrain_trainer.parallel import checkpoint_wrapper

    wrapped = checkpoint_wrapper(torch.nn.Linear(2, 2))
    assert wrapped(torch.ones(1, 2)).shape == (1, 2)


# --- torch: FSDP2's state registry (inprocess/fsdp.py, in-process recovery)


def test_the_fsdp_state_follows_the_script_s_module_object() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastrain_trainer.inprocess import fsdp

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("contract",))
        fresh = torch.nn.Sequential(torch.nn.Linear(2, 2))
        fully_shard(fresh, mesh=mesh)
        scripts = torch.nn.Sequential(torch.nn.Linear(2, 2))
        fsdp.become(scripts, fresh)
        # FSDPModule methods look their state up by module object in the private registry.
        scripts.set_requires_gradient_sync(False)  # type: ignore[operator]
        assert fully_shard.state(scripts) is fully_shard.state(fresh)  # type: ignore[attr-defined]
        assert scripts(torch.ones(1, 2)).shape == (1, 2)
    finally:
        dist.destroy_process_group()


# --- torch: c10d's group check before every collective (session/stale_groups.py)


@pytest.fixture
def stale_groups_installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import torch.distributed.distributed_c10d as c10d

    from elastrain_trainer.session import stale_groups

    monkeypatch.setattr(c10d, "_rank_not_in_group", c10d._rank_not_in_group)  # put back after
    stale_groups.install()
    yield


def test_a_collective_on_a_group_of_an_earlier_world_is_refused_and_a_new_one_runs(
        stale_groups_installed: None) -> None:
    """What a world change in process does to the script's dist.new_group: destroyed with the
    generation's groups, yet its gloo connections would still reduce (tried: abort() and
    shutdown() do not stop them); refused instead, naming the fix. The next world's groups,
    and the default group, reduce as before."""
    import torch.distributed as dist

    from elastrain_trainer.session.stale_groups import StaleGroupError

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    old = dist.new_group([0])
    t = torch.ones(1)
    dist.all_reduce(t, group=old)  # the world it was made in: fine
    dist.destroy_process_group()  # the world changed (inprocess/regroup.py)
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(StaleGroupError, match=r"dist.all_reduce on a process group of 1 "
                                                  r"rank that no longer exists.*"
                                                  r"Session\(on_world_change=\.\.\.\)"):
            dist.all_reduce(t, group=old)
        with pytest.raises(StaleGroupError, match=r"dist.broadcast on"):
            dist.broadcast(t, src=0, group=old)
        rebuilt = dist.new_group([0])
        dist.all_reduce(t, group=rebuilt)
        dist.all_reduce(t)
        assert t.item() == 1.0
    finally:
        dist.destroy_process_group()


# --- torch: the launcher's agent patches (launch/agent.py)


def _spec() -> WorkerSpec:
    return WorkerSpec(role="contract", local_world_size=1, rdzv_handler=None,  # type: ignore[arg-type]
                      entrypoint="true", args=())


@pytest.fixture
def unpatched_agent() -> Iterator[None]:
    stop = LocalElasticAgent._stop_workers
    agent = launcher_api.LocalElasticAgent  # type: ignore[attr-defined]
    close, close_all = SubprocessHandler.close, SubprocessContext._close
    yield
    LocalElasticAgent._stop_workers = stop  # type: ignore[method-assign]
    launcher_api.LocalElasticAgent = agent  # type: ignore[attr-defined]
    SubprocessHandler.close = close  # type: ignore[method-assign]
    SubprocessContext._close = close_all  # type: ignore[method-assign]


def test_a_restart_of_a_real_agent_waits_its_shutdown_timeout(
        unpatched_agent: None, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = LocalElasticAgent(_spec(), DefaultLogsSpecs(), shutdown_timeout=175)
    real, timeouts = agent._shutdown, []

    def shutdown(*args: Any, **kwargs: Any) -> None:
        timeouts.append(kwargs.get("timeout"))
        real(*args, **kwargs)  # torch's own _shutdown takes the keyword (no workers to stop)

    monkeypatch.setattr(agent, "_shutdown", shutdown)
    agent._stop_workers(agent.get_worker_group())
    assert timeouts == [None]  # torch as shipped: its 30 s default
    launch_agent.patch_restart_timeout()
    agent._stop_workers(agent.get_worker_group())
    assert timeouts == [None, 175]


def test_launch_agent_builds_the_crash_budget_agent(unpatched_agent: None) -> None:
    launch_agent.patch_crash_budget()
    built = launcher_api.LocalElasticAgent(  # type: ignore[attr-defined]
        spec=_spec(), logs_specs=DefaultLogsSpecs(),
                                           shutdown_timeout=60)
    assert isinstance(built, LocalElasticAgent)
    assert type(built).__name__ == "ElastrainAgent"
    assert built._shutdown_timeout == 60
    # launch_agent looks the class up in its module when it runs, so the subclass is the one used.
    assert "LocalElasticAgent" in launcher_api.launch_agent.__code__.co_names


def test_the_notice_patch_takes_over_torchs_worker_close(unpatched_agent: None) -> None:
    """What the replacement relies on is in torch's code; the stop itself runs on real processes
    in tests/integration/trainer/test_loader_workers_notice.py."""
    torch_close = SubprocessHandler.close
    launch_agent.patch_notice_to_trainer()
    launch_agent.patch_notice_to_trainer()  # idempotent
    assert SubprocessHandler.close is not torch_close
    assert getattr(SubprocessContext._close, "_elastrain", False)


# --- botocore: the credentials a client resolved (checkpoint/s3.py)


def test_the_client_credentials_are_read_from_botocores_signer() -> None:
    client = boto3.session.Session().client(
        "s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
        aws_access_key_id="AKIAEXAMPLE1234", aws_secret_access_key="secret")
    creds = s3._credentials(client)
    assert (creds.access_key, creds.method) == ("AKIAEXAMPLE1234", "explicit")
    assert s3._masked_key(client) == "****1234"


# --- Python: an exit hook that runs before the interpreter joins threads (tokenfiles/dataset.py)


def test_threading_has_the_early_atexit_hook() -> None:
    assert callable(threading._register_atexit)  # type: ignore[attr-defined]


# --- each run-time check stops with the hook's name and the tested versions


def _drop(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    monkeypatch.delattr(owner, name, raising=True)


BROKEN: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], Callable[[], Any], str]] = {
    "torch.serialization._load": (
        lambda mp: _drop(mp, torch.serialization, "_load"),
        private_hooks.require_dcp_hooks, "torch.serialization._load"),
    "torch._C.PyTorchFileReader": (
        lambda mp: _drop(mp, torch._C, "PyTorchFileReader"),
        private_hooks.require_dcp_hooks, "PyTorchFileReader"),
    "_load(overall_storage=)": (
        lambda mp: mp.setattr(torch.serialization, "_load", lambda f, m, p, **kw: None),
        private_hooks.require_dcp_hooks, "_load(overall_storage=, weights_only=)"),
    "LocalElasticAgent._shutdown(timeout=)": (
        lambda mp: mp.setattr(LocalElasticAgent, "_shutdown", lambda self: None),
        launch_agent.patch_restart_timeout, "LocalElasticAgent._shutdown(timeout=)"),
    "launcher LocalElasticAgent": (
        lambda mp: _drop(mp, launcher_api, "LocalElasticAgent"),
        launch_agent.patch_crash_budget, "api.LocalElasticAgent"),
    "store._barrier_nonblocking": (
        lambda mp: _drop(mp, store_util, "_barrier_nonblocking"),
        lambda: launch_agent.peers_finished(HashStore(), 2, lambda: 0, timeout=0),
        "_barrier_nonblocking"),
    "SimpleElasticAgent._exit_barrier": (
        lambda mp: _drop(mp, SimpleElasticAgent, "_exit_barrier"),
        launch_agent.patch_crash_budget, "_exit_barrier"),
    "SubprocessHandler.close(death_sig=)": (
        lambda mp: mp.setattr(SubprocessHandler, "close", lambda self: None),
        launch_agent.patch_notice_to_trainer, "SubprocessHandler.close(death_sig=)"),
    "SubprocessHandler.close's killpg": (
        lambda mp: mp.setattr(SubprocessHandler, "close", lambda self, death_sig=None: None),
        launch_agent.patch_notice_to_trainer, "SubprocessHandler.close's use of"),
    "SubprocessContext._close(death_sig=, timeout=)": (
        lambda mp: mp.setattr(SubprocessContext, "_close", lambda self, death_sig: None),
        launch_agent.patch_notice_to_trainer, "SubprocessContext._close(timeout=)"),
    "c10d._rank_not_in_group": (
        lambda mp: _drop(mp, torch.distributed.distributed_c10d, "_rank_not_in_group"),
        lambda: _install_stale_groups(), "_rank_not_in_group"),
    "RequestSigner._credentials": (
        lambda mp: mp.setattr(s3, "boto3", _client_without_signer()),
        lambda: s3.S3Storage("s3://b/p"), "BaseClient._request_signer"),
}


def _install_stale_groups() -> None:
    from elastrain_trainer.session import stale_groups

    stale_groups.install()


def _client_without_signer() -> Any:
    client = boto3.session.Session().client("s3", region_name="us-east-1",
                                            aws_access_key_id="a", aws_secret_access_key="b")
    del client._request_signer  # type: ignore[attr-defined]
    return type("Boto3", (), {"client": staticmethod(lambda *a, **kw: client)})


@pytest.mark.parametrize("hook", list(BROKEN))
def test_a_missing_hook_stops_with_its_name_and_the_tested_versions(
        hook: str, unpatched_agent: None, monkeypatch: pytest.MonkeyPatch) -> None:
    brk, check, named = BROKEN[hook]
    brk(monkeypatch)
    with pytest.raises(MissingPrivateHook) as raised:
        check()
    message = str(raised.value)
    assert named in message
    assert "elastrain is tested with " in message
    assert any(f"{lib}{rng}" in message for lib, rng in private_hooks.TESTED.items())
