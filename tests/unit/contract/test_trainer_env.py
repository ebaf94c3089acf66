"""The operator's rendered trainer env and the trainer's config agree on every field.

The two packages never import each other; the ELASTRAIN_* variables are their only contract.
Every value below differs from both sides' defaults, so a renamed or dropped variable fails.
"""

from __future__ import annotations

from elastrain_operator.model import TrainingJobSpec
from elastrain_operator.render.env import render_trainer_env
from elastrain_trainer.config import TrainerConfig

TRAINER = {"model": "gpt-small", "dataset": "text", "steps": 777, "seqLen": 96,
           "globalBatchSize": 24, "microBatchSize": 3, "lr": 0.002, "minLr": 0.0002,
           "warmupSteps": 17, "lrSchedule": "wsd", "decayFraction": 0.3, "weightDecay": 0.05,
           "precision": "bf16", "activationCheckpointing": True, "cpuOffload": True,
           "maxGradNorm": 0.5, "spikeFactor": 4.0, "seed": 99,
           "validation": {"dataset": "s3://bucket/val_*.bin, s3://bucket/extra.bin",
                          "intervalSteps": 33, "batches": 4}}
CHECKPOINT = {"uri": "s3://bucket/run-7", "endpoint": "http://minio:9000", "intervalSteps": 25,
              "intervalSeconds": 120, "keep": 7, "async": False, "resume": "Never"}


def test_every_trainer_and_checkpoint_field_reaches_the_trainer() -> None:
    spec = TrainingJobSpec.model_validate({"image": "i", "strategy": "fsdp", "metricsPort": 9555,
                                           "trainer": TRAINER, "checkpoint": CHECKPOINT})
    config = TrainerConfig.from_env(render_trainer_env(spec, "job-7"))

    assert (config.job_name, config.strategy, config.metrics_port) == ("job-7", "fsdp", 9555)
    for name, value in spec.trainer.model_dump(exclude={"validation"}).items():
        assert getattr(config, name) == value, name
    assert spec.trainer.validation is not None
    for name, value in spec.trainer.validation.model_dump().items():
        assert getattr(config, f"validation_{name}") == value, name
    ckpt = spec.checkpoint
    assert ckpt is not None
    assert (config.checkpoint_uri, config.checkpoint_endpoint) == (ckpt.uri, ckpt.endpoint)
    assert config.checkpoint_interval_steps == ckpt.interval_steps
    assert config.checkpoint_interval_seconds == ckpt.interval_seconds
    assert (config.checkpoint_keep, config.checkpoint_async) == (ckpt.keep, ckpt.async_)
    assert config.checkpoint_resume == "never"


def test_spec_defaults_match_the_trainer_defaults() -> None:
    spec = TrainingJobSpec.model_validate({"image": "i"})
    from_spec = TrainerConfig.from_env(render_trainer_env(spec, "local"))
    names = spec.trainer.model_dump(exclude={"validation"})
    assert {n: getattr(from_spec, n) for n in names} == \
        {n: getattr(TrainerConfig(), n) for n in names}
    # No validation by default; the defaults of a validation split's fields agree too.
    assert from_spec.validation_dataset == ""
    with_split = TrainingJobSpec.model_validate(
        {"image": "i", "trainer": {"validation": {"dataset": "file:///v.bin"}}})
    config = TrainerConfig.from_env(render_trainer_env(with_split, "local"))
    assert (config.validation_interval_steps, config.validation_batches) == (
        TrainerConfig.validation_interval_steps, TrainerConfig.validation_batches)
