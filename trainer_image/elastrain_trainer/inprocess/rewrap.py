"""DDP at the new world, in place (docs/recovery.md section 5).

The script holds its own reference (`model = DDP(net)`; the optimizer holds the parameters), so
the same object is re-initialised: a fresh DDP around the same module on the new default group,
whose instance state then replaces the old one's. Without the initial broadcast
(`init_sync=False`) when the ranks already hold equal state (survivors, and a joiner whose
transfer was checksummed); with it at the first generation, as a plain `DDP(net)` would. The old
Reducer, dropped with the old state, removes its autograd hooks; two live Reducers on one set of
parameters would reduce every gradient twice.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

_MIB = 1024 * 1024
# Constructor arguments DDP keeps as attributes of the same name (torch 2.15).
_CARRIED = ("forward_sync_buffers", "find_unused_parameters", "gradient_as_bucket_view")


def check_supported() -> None:
    """Refuse in-process mode when this torch's DDP lacks what the in-place re-wrap relies on
    (`init_sync`, the carried attributes, the bucket configuration)."""
    params = inspect.signature(DDP.__init__).parameters
    missing = [a for a in ("init_sync", "device_ids", "bucket_cap_mb", "bucket_cap_mb_list",
                           "static_graph", *_CARRIED) if a not in params]
    if missing or not hasattr(torch.nn.parallel.distributed, "_BucketCapacityConfig"):
        raise ValueError(f"in-process recovery: torch {torch.__version__}'s "
                         f"DistributedDataParallel differs from 2.15 ({missing or 'buckets'}); "
                         "use recovery Restart")


def ddp_kwargs(model: DDP) -> dict[str, Any]:
    """The arguments `model` was built with, as far as they shape its reduction."""
    kwargs: dict[str, Any] = {a: getattr(model, a) for a in _CARRIED}
    kwargs["static_graph"] = bool(model.static_graph)
    buckets = model._bucket_config
    if buckets.per_bucket_bytes_caps:
        kwargs["bucket_cap_mb_list"] = [c / _MIB for c in buckets.per_bucket_bytes_caps]
    elif buckets.first_bucket_bytes_cap == buckets.bucket_bytes_cap:
        # An explicit bucket_cap_mb (the default makes the first bucket smaller).
        kwargs["bucket_cap_mb"] = buckets.bucket_bytes_cap / _MIB
    return kwargs


def rewrap_ddp(model: DDP, *, sync: bool = False) -> DDP:
    """Bind `model` (the script's DDP object) to the current default group; returns it."""
    if model._comm_hooks:
        raise ValueError("in-process recovery: a DDP comm hook cannot be carried over yet")
    fresh = DDP(model.module, device_ids=model.device_ids, init_sync=sync, **ddp_kwargs(model))
    model.__dict__.update(fresh.__dict__)
    return model


def release_ddp(model: DDP) -> None:
    """Drop `model`'s references to its process group (Reducer, logger, group), so that a
    destroyed gloo group is really freed and its sockets close now: that close is what fails the
    other survivors' pending collectives (docs/recovery.md section 8). The object is unusable
    until `rewrap_ddp`."""
    for attr in ("reducer", "logger", "process_group"):
        model.__dict__[attr] = None
