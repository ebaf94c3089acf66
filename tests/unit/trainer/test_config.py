from __future__ import annotations

import pytest

from elastrain_trainer.config import TrainerConfig, accumulation_steps


def test_defaults_match_the_operator_contract() -> None:
    cfg = TrainerConfig.from_env({})
    assert (cfg.strategy, cfg.model, cfg.dataset, cfg.steps, cfg.seq_len) == (
        "ddp", "gpt-tiny", "synthetic", 100, 128)
    assert (cfg.global_batch_size, cfg.micro_batch_size, cfg.lr, cfg.min_lr) == (8, 2, 3e-4, 3e-5)
    assert cfg.checkpoint_uri == "file://./checkpoints/local"
    assert cfg.checkpoint_async and not cfg.activation_checkpointing
    assert (cfg.checkpoint_keep, cfg.metrics_port, cfg.spike_factor) == (3, 9400, 0.0)


def test_env_is_parsed_and_cli_flags_override_it() -> None:
    env = {"ELASTRAIN_STEPS": "7", "ELASTRAIN_STRATEGY": "fsdp", "ELASTRAIN_CPU_OFFLOAD": "1",
           "ELASTRAIN_JOB_NAME": "j"}
    cfg = TrainerConfig.from_env(env, ["--steps", "9", "--resume-from", "file:///x/step-00000001"])
    assert (cfg.steps, cfg.strategy, cfg.cpu_offload) == (9, "fsdp", True)
    assert cfg.checkpoint_uri == "file://./checkpoints/j"
    assert cfg.resume_from == "file:///x/step-00000001"


def test_to_env_round_trips() -> None:
    cfg = TrainerConfig(steps=3, precision="bf16", checkpoint_async=False)
    assert TrainerConfig.from_env(cfg.to_env()) == cfg


@pytest.mark.parametrize(("env", "names"), [
    ({"ELASTRAIN_STEPS": "ten"}, "ELASTRAIN_STEPS"),
    ({"ELASTRAIN_CHECKPOINT_ASYNC": "yes"}, "ELASTRAIN_CHECKPOINT_ASYNC"),
    ({"ELASTRAIN_MODEL": "gpt-9b"}, "ELASTRAIN_MODEL"),
    ({"ELASTRAIN_GLOBAL_BATCH_SIZE": "7"}, "ELASTRAIN_GLOBAL_BATCH_SIZE"),
    ({"ELASTRAIN_CHECKPOINT_URI": "ftp://b/p"}, "ELASTRAIN_CHECKPOINT_URI"),
    ({"ELASTRAIN_MIN_LR": "1"}, "ELASTRAIN_MIN_LR"),
    ({"ELASTRAIN_SPIKE_FACTOR": "0.5"}, "ELASTRAIN_SPIKE_FACTOR"),
])
def test_bad_input_names_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        TrainerConfig.from_env(env)


def test_accumulation_keeps_the_global_batch_constant() -> None:
    assert [accumulation_steps(16, 2, w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match="world size 3"):
        accumulation_steps(16, 2, 3)
