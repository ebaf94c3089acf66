"""What a failed checkpoint read proves, and the retry decision (pure; no store)."""

from __future__ import annotations

import pickle
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from elastrain_trainer.checkpoint import read_faults as rf
from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.manifest import CorruptCheckpointError


def test_only_proof_of_damage_is_damage(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)

    def classify(error: BaseException, storage_call: bool = False) -> rf.Damaged | rf.Failed:
        return rf.classify(error, storage, action="read", key="step-00000004",
                           storage_call=storage_call)

    assert classify(CorruptCheckpointError("sha256 mismatch")) == rf.Damaged("sha256 mismatch")
    reset = classify(ConnectionResetError(104, "reset"), storage_call=True)
    assert isinstance(reset, rf.Failed) and reset.transient
    fault = classify(rf.StoreFault("SlowDown: throttled", "store_error", False))
    assert fault == rf.Failed("store_error", "SlowDown: throttled", True)
    refused = classify(rf.StoreFault("AccessDenied", "access_denied", True))
    assert isinstance(refused, rf.Failed) and not refused.transient
    # Outside a storage call, an unknown error is the checkpoint not fitting the model: stop.
    misfit = classify(RuntimeError("Missing key in checkpoint state_dict: model.w"))
    assert misfit == rf.Failed(rf.INCOMPATIBLE, "RuntimeError: Missing key in checkpoint "
                                                "state_dict: model.w", False)


def test_every_ranks_failure_makes_one_outcome(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    slow = rf.StoreFault("SlowDown", "store_error", False)
    corrupt = CorruptCheckpointError("__1_0.distcp: sha256 mismatch")

    def outcome(failures: dict[int, BaseException]) -> rf.Damaged | rf.Failed:
        error = CheckpointException("read", {r: (e, None) for r, e in failures.items()})
        return rf.classify(error, storage, action="read", key="k", storage_call=False)

    assert outcome({0: slow, 1: corrupt}) == rf.Damaged("__1_0.distcp: sha256 mismatch")
    assert outcome({0: slow, 1: slow}) == rf.Failed("store_error", "SlowDown", True)
    refused = rf.StoreFault("AccessDenied", "access_denied", True)
    assert outcome({0: slow, 1: refused}) == rf.Failed("access_denied", "AccessDenied", False)


def test_store_faults_survive_the_trip_to_other_ranks() -> None:
    # DCP pickles each rank's exception to every rank.
    fault = pickle.loads(pickle.dumps(rf.StoreFault("reset on read", "unreachable", False)))
    assert (str(fault), fault.kind, fault.permanent) == ("reset on read", "unreachable", False)


def test_retries_back_off_with_jitter_until_the_deadline() -> None:
    transient = rf.Failed("unreachable", "reset", True)
    assert rf.plan_retry(transient, now=0, deadline=100, delay=4, rng=lambda: 0.0) == rf.Retry(2)
    assert rf.plan_retry(transient, now=0, deadline=100, delay=4, rng=lambda: 1.0) == rf.Retry(4)
    assert rf.plan_retry(transient, now=100, deadline=100, delay=4).seconds is None
    assert rf.plan_retry(transient, now=99, deadline=100, delay=4, rng=lambda: 0.5) == rf.Retry(1)
    assert rf.plan_retry(transient, now=97, deadline=100, delay=8, rng=lambda: 1.0) == rf.Retry(3)
    permanent = rf.Failed("access_denied", "AccessDenied", False)
    assert rf.plan_retry(permanent, now=0, deadline=100, delay=1).seconds is None
    delays = [rf.FIRST_RETRY_SECONDS]
    for _ in range(6):
        delays.append(rf.next_delay(delays[-1]))
    assert delays == [1, 2, 4, 8, 15, 15, 15]
