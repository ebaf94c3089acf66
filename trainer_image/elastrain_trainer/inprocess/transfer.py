"""A joiner's state from a live peer, point to point on the new generation's group (section 6).

Both sides derive the same ordered tensor list from the same model: parameters, then buffers.
The optimizer's state goes by its `state_dict()`: its tensors in (parameter index, key) order,
its skeleton (keys, shapes, dtypes, non-tensor values, param_groups) in a small header. So only
data crosses the wire: the header (pickled; peers are the same job), then one flat buffer per
dtype, each with a SHA-256 the receiver checks before it touches its model.

    source:  send_state(model, optimizer, step=s, extras={"scheduler": ...}, dst=rank_of_joiner)
    joiner:  got = recv_state(model, optimizer, src=rank_of_source)   # got.step, got.extras
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastrain_trainer import fault_injection


class TransferError(RuntimeError):
    """The state received does not match what the source sent."""


@dataclasses.dataclass(frozen=True)
class Received:
    step: int
    extras: dict[str, Any]
    bytes: int
    digests: dict[str, str]


def _optimizer_tensors(sd: Mapping[str, Any]) -> tuple[list[torch.Tensor], dict[Any, Any]]:
    """The optimizer state's tensors in a fixed order, and its skeleton without them."""
    tensors: list[torch.Tensor] = []
    skeleton: dict[Any, Any] = {}
    for index in sorted(sd["state"]):
        entry: dict[str, tuple[Any, ...]] = {}
        for key in sorted(sd["state"][index]):
            value = sd["state"][index][key]
            if isinstance(value, torch.Tensor):
                entry[key] = ("tensor", tuple(value.shape), value.dtype)
                tensors.append(value)
            else:
                entry[key] = ("value", value)
        skeleton[index] = entry
    return tensors, skeleton


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [p.data for p in model.parameters()] + list(model.buffers())


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


def _digest(buf: torch.Tensor) -> str:
    return hashlib.sha256(buf.contiguous().view(torch.uint8).numpy().data).hexdigest()


def _send_bytes(data: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst)


def _recv_bytes(src: int) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, src=src)
    return buf.numpy().tobytes()


def send_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
               extras: Mapping[str, Any], dst: int) -> int:
    """Send everything a joiner needs to `dst`; returns the bytes of tensor data sent."""
    sd = optimizer.state_dict()
    opt_tensors, skeleton = _optimizer_tensors(sd)
    groups = _by_dtype([t.detach().cpu() for t in _model_tensors(model)] +
                       [t.detach().cpu() for t in opt_tensors])
    flats = {dtype: torch.cat([t.reshape(-1) for t in ts]) for dtype, ts in groups.items()}
    header = {"step": step, "extras": dict(extras), "skeleton": skeleton,
              "param_groups": sd["param_groups"],
              "dtypes": [(str(d), f.numel(), _digest(f)) for d, f in flats.items()]}
    _send_bytes(pickle.dumps(header), dst)
    for flat in flats.values():
        dist.send(flat, dst=dst)
    return sum(f.numel() * f.element_size() for f in flats.values())


def recv_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, src: int) -> Received:
    """Receive from `src` into the live model and optimizer (checksums checked first)."""
    header = pickle.loads(_recv_bytes(src))  # a peer of the same job
    fault_injection.during_heal()
    skeleton: dict[Any, Any] = header["skeleton"]
    opt_tensors = [torch.empty(spec[1], dtype=spec[2]) for index in sorted(skeleton)
                   for spec in skeleton[index].values() if spec[0] == "tensor"]
    model_tensors = _model_tensors(model)
    groups = _by_dtype(model_tensors + opt_tensors)
    digests = {}
    total = 0
    for (name, numel, digest), (dtype, ts) in zip(header["dtypes"], groups.items(), strict=True):
        if name != str(dtype) or numel != sum(t.numel() for t in ts):
            raise TransferError(f"layout differs from the source's: {name} x {numel} vs "
                                f"{dtype} x {sum(t.numel() for t in ts)} (same model?)")
        flat = torch.empty(numel, dtype=dtype)
        dist.recv(flat, src=src)
        if _digest(flat) != digest:
            raise TransferError(f"checksum of the {name} state from rank {src} does not match")
        digests[name], total = digest, total + numel * flat.element_size()
        offset = 0
        for t in ts:
            with torch.no_grad():
                t.view(-1).copy_(flat[offset:offset + t.numel()].view(t.shape).reshape(-1))
            offset += t.numel()
    optimizer.load_state_dict({"state": _rebuild(skeleton, iter(opt_tensors)),
                               "param_groups": header["param_groups"]})
    return Received(step=int(header["step"]), extras=header["extras"], bytes=total,
                    digests=digests)


def _rebuild(skeleton: Mapping[Any, Any], tensors: Any) -> dict[Any, Any]:
    state: dict[Any, Any] = {}
    for index in sorted(skeleton):
        state[index] = {key: next(tensors) if spec[0] == "tensor" else spec[1]
                        for key, spec in skeleton[index].items()}
    return state


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """One SHA-256 over the model's and optimizer's tensors (to compare two ranks' state)."""
    h = hashlib.sha256()
    tensors, _ = _optimizer_tensors(optimizer.state_dict())
    for t in _model_tensors(model) + tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
