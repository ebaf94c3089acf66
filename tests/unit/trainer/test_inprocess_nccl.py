"""What a GPU member decides before any NCCL group exists (inprocess.nccl), and that a gloo
member holds no group for the heartbeat to abort. The abort and re-init themselves need two
GPUs (docs/recovery.md section 4 says what is verified and what is not)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]

from elastrain_trainer.inprocess import nccl, regroup


def test_unset_error_handling_becomes_clean_up_only() -> None:
    env: dict[str, str] = {}
    assert nccl.prepare_error_handling(env) == "2"
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


@pytest.mark.parametrize("value", ["0", "2", " 2 "])
def test_a_value_that_keeps_the_process_is_kept(value: str) -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": value}
    assert nccl.prepare_error_handling(env) == value.strip()
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": value}


@pytest.mark.parametrize("name", ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"])
@pytest.mark.parametrize("value", ["1", "3"])
def test_a_value_that_tears_the_process_down_is_refused_by_name(name: str, value: str) -> None:
    env = {name: value}
    with pytest.raises(ValueError, match=f"{name}={value} ends the process.*needs 0 or 2"):
        nccl.prepare_error_handling(env)
    assert env == {name: value}  # refused, never overridden


def test_the_backend_follows_the_device() -> None:
    assert nccl.backend_for(torch.device("cpu")) == "gloo"
    assert nccl.backend_for(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert nccl.is_device_backend("cpu:gloo,cuda:nccl") and not nccl.is_device_backend("gloo")


def test_a_gloo_generation_holds_no_group_to_abort() -> None:
    """On gloo a held reference would keep a group's sockets open past its destroy: nothing
    is held, whatever the member adds."""
    regroup.destroy()
    regroup.init_generation(HashStore(), 0, 1)  # device None: gloo, as every CPU member
    try:
        assert dist.get_backend() == "gloo" and not nccl.has_device_backend(None)
        held = nccl.DeviceGroups("a", nccl.backend_for(torch.device("cpu")))
        held.add(dist.group.WORLD)
        assert held.abort(1) == 0
        on_device = nccl.DeviceGroups("a", nccl.DEVICE_BACKEND)
        on_device.add(dist.group.WORLD)  # a gloo group, even on a device member: not held
        assert on_device.abort(1) == 0
    finally:
        regroup.destroy()
    assert not nccl.has_device_backend(None)  # no group at all
