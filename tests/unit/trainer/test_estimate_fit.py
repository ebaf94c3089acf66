"""`plan_fit`: whether a config fits a device and which knob makes it fit (pure, no torch)."""

from __future__ import annotations

import dataclasses

import pytest

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.estimate import GIB, estimate, parse_bytes, plan_fit

# gpt-1b, DDP over 8 ranks, bf16: ~31.3 GiB per rank, 12.8 of it activations (micro-batch 8 x
# 1024 tokens), 22.6 model states and gradient buckets.
BIG = TrainerConfig(model="gpt-1b", strategy="ddp", precision="bf16", seq_len=1024,
                    micro_batch_size=8, global_batch_size=256)


def test_a_config_that_fits_needs_no_knob() -> None:
    plan = plan_fit(BIG, 8, 40 * GIB)
    assert plan.fits and plan.fixes == []
    assert plan.format() == "fits: 31.33 GiB of 40.00 GiB per rank"


def test_each_single_knob_that_makes_it_fit_is_listed_cheapest_first() -> None:
    plan = plan_fit(BIG, 8, 24 * GIB)
    assert not plan.fits
    assert [f.changes for f in plan.fixes] == [
        {"strategy": "fsdp"}, {"activation_checkpointing": True}, {"micro_batch_size": 2},
        {"strategy": "fsdp", "cpu_offload": True}]
    assert all(f.estimate.total_bytes <= 24 * GIB for f in plan.fixes)
    assert "spec.trainer.microBatchSize: 2 -> 23.07 GiB" in plan.format()


def test_the_largest_micro_batch_that_fits_keeps_the_global_batch() -> None:
    plan = plan_fit(BIG, 8, 24 * GIB)
    batch = [f.changes["micro_batch_size"] for f in plan.fixes if "micro_batch_size" in f.changes]
    assert batch == [2]  # not 1, which fits too; 4 needs 24.9 GiB; 3 does not divide 256 / 8
    assert estimate(dataclasses.replace(BIG, micro_batch_size=4), 8).total_bytes > 24 * GIB


def test_when_no_single_knob_fits_the_first_combination_that_does_is_given() -> None:
    plan = plan_fit(BIG, 8, 12 * GIB)
    assert [f.changes for f in plan.fixes] == [{"strategy": "fsdp",
                                                "activation_checkpointing": True}]
    assert "spec.strategy: fsdp, spec.trainer.activationCheckpointing: true" in plan.format()
    tighter = plan_fit(BIG, 8, 4 * GIB)
    assert [f.changes for f in tighter.fixes] == [{"strategy": "fsdp",
                                                   "activation_checkpointing": True,
                                                   "micro_batch_size": 1}]


def test_offload_is_offered_under_fsdp_when_states_dominate() -> None:
    cfg = TrainerConfig(model="gpt-1b", strategy="fsdp", micro_batch_size=1,
                        global_batch_size=2, seq_len=128, activation_checkpointing=True)
    plan = plan_fit(cfg, 2, 6 * GIB)
    assert [f.changes for f in plan.fixes] == [{"cpu_offload": True}]
    # On a CPU run there is nowhere to offload to (wrap_model offloads only from a GPU).
    assert plan_fit(cfg, 2, 6 * GIB, "cpu").fixes == []


def test_a_cpu_job_is_planned_with_the_host_runtime() -> None:
    tiny = TrainerConfig()
    assert plan_fit(tiny, 2, GIB * 7 // 10, "cuda").fits  # 0.5 GiB runtime on a GPU
    assert not plan_fit(tiny, 2, GIB * 7 // 10, "cpu").fits  # the process itself, ~0.75 GiB


def test_nothing_fits_says_so() -> None:
    plan = plan_fit(BIG, 1, GIB // 2)  # the runtime overhead alone
    assert not plan.fits and plan.fixes == []
    assert "no knob tried" in plan.format()


@pytest.mark.parametrize(("text", "n"), [("80GiB", 80 * GIB), ("80Gi", 80 * GIB),
                                         ("40GB", 40 * 10**9), ("40G", 40 * 10**9),
                                         ("512 MiB", 512 << 20), ("1.5GiB", 3 * GIB // 2),
                                         ("1000", 1000)])
def test_memory_sizes_parse(text: str, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "80 GiBs", "eighty"])
def test_bad_memory_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes(text)
