"""The trainer's configuration: one typed, self-validating dataclass read from env and CLI flags.

The ELASTRAIN_* names are a contract with the operator, which renders them from the
TrainingJob spec. Every variable is optional; booleans are "1"/"0". A CLI flag
(`--steps 10`, `--checkpoint-uri file:///x`) overrides the variable of the same name.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# hsdp: FSDP2 on a 2-D mesh, sharded over a pod's ranks and replicated across pods.
STRATEGIES = ("ddp", "fsdp", "hsdp")
MODELS = ("gpt-tiny", "gpt-small", "gpt-100m", "gpt-350m", "gpt-1b")
# Built in; anything else names token files: file:// or s3:// URIs, globs, comma-separated.
DATASETS = ("synthetic", "text")
DATASET_FORMATS = ("nanogpt", "llmc")
BYTE_VOCAB_SIZE = 256  # the built-in datasets are bytes
SCHEDULES = ("cosine", "wsd")
PRECISIONS = ("bf16", "fp16", "fp32")
ENV_PREFIX = "ELASTRAIN_"
# Checkpoint URI schemes with a storage backend (checkpoint.open_storage); gs:// needs gcsfs and
# az:// or abfs:// adlfs in the image, which the start-up check names when it is missing.
CHECKPOINT_SCHEMES = ("file", "s3", "gs", "az", "abfs")
# latest: the newest committed checkpoint; never: start over, resuming only this run's own.
RESUME_MODES = ("latest", "never")


def env_name(field_name: str) -> str:
    """The environment variable that sets a config field."""
    return ENV_PREFIX + field_name.upper()


@dataclass(frozen=True)
class TrainerConfig:
    """Everything a training run needs; construction validates and raises ValueError."""

    job_name: str = "local"
    strategy: str = "ddp"
    model: str = "gpt-tiny"
    dataset: str = "synthetic"
    # Token files: nanogpt (headerless uint16) or llmc (llm.c's gpt-2 uint16 or llama-3 uint32).
    dataset_format: str = "nanogpt"
    # The model's vocabulary; must exceed every token id of the dataset.
    vocab_size: int = BYTE_VOCAB_SIZE
    # Not part of the operator contract: a remote token file's sample cache and read-ahead.
    dataset_cache_bytes: int = 256 << 20
    dataset_prefetch_steps: int = 2
    # A validation split (token files, same forms and format as dataset; "" for none): the mean
    # loss over `batches` global batches of it, every `interval_steps` steps and after the last.
    validation_dataset: str = ""
    validation_interval_steps: int = 100
    validation_batches: int = 10
    steps: int = 100
    seq_len: int = 128
    global_batch_size: int = 8
    micro_batch_size: int = 2
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    lr_schedule: str = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    precision: str = "fp32"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    max_grad_norm: float = 1.0
    spike_factor: float = 0.0
    seed: int = 1234
    checkpoint_uri: str = ""
    checkpoint_endpoint: str = ""
    checkpoint_interval_steps: int = 0
    checkpoint_interval_seconds: int = 0
    checkpoint_keep: int = 3
    checkpoint_async: bool = True
    # How long the start-up check waits for an unreachable checkpoint store before it gives up
    # (checkpoint/precheck.py); a store that refuses (bad credentials, no bucket) fails at once.
    checkpoint_wait_seconds: int = 600
    # "never": start from step 0 whatever the location holds, and after a restart resume only
    # the checkpoints this run wrote (the run is run_id, else torchrun's TORCHELASTIC_RUN_ID,
    # which the operator sets to the job's uid). Older checkpoints stay until retention.
    checkpoint_resume: str = "latest"
    run_id: str = ""
    metrics_port: int = 9400
    # Not part of the operator contract: pacing for demos and tests (seconds slept per step).
    step_sleep_seconds: float = 0.0
    # Not part of the operator contract: pacing for `elastrain run --local --simulate-preemption`
    # (launch/local.py). Once past this step (0: never), an in-process world smaller than its
    # replicas waits, before its next step, until a node asks to join or leave, at most
    # join_wait_seconds: the replacement then trains the last steps with the survivor however
    # slowly it started.
    join_wait_after_step: int = 0
    join_wait_seconds: float = 120.0
    # CLI/env only: load this checkpoint instead of the latest committed one.
    resume_from: str = ""
    wandb_project: str = field(default="")

    def __post_init__(self) -> None:
        if not self.checkpoint_uri:
            object.__setattr__(self, "checkpoint_uri", f"file://./checkpoints/{self.job_name}")
        object.__setattr__(self, "checkpoint_resume", self.checkpoint_resume.lower())
        _check_choice("checkpoint_resume", self.checkpoint_resume, RESUME_MODES)
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("model", self.model, MODELS)
        _check("dataset", self.dataset in DATASETS or is_token_files(self.dataset),
               f"={self.dataset!r} must be one of {', '.join(DATASETS)} or the URI of a token "
               "file (file://path or s3://bucket/key), a glob of them, or a comma-separated "
               "list of those")
        _check("validation_dataset",
               not self.validation_dataset or is_token_files(self.validation_dataset),
               f"={self.validation_dataset!r} must be empty (no validation) or token files: "
               "file://path or s3://bucket/key, globs, comma-separated")
        _check_choice("dataset_format", self.dataset_format, DATASET_FORMATS)
        _check("vocab_size", self.vocab_size >= 2, "must be >= 2")
        _check("vocab_size", self.dataset not in DATASETS or self.vocab_size >= BYTE_VOCAB_SIZE,
               f"must be >= {BYTE_VOCAB_SIZE} for the byte-level dataset {self.dataset}")
        _check_choice("lr_schedule", self.lr_schedule, SCHEDULES)
        _check_choice("precision", self.precision, PRECISIONS)
        for name in ("steps", "seq_len", "global_batch_size", "micro_batch_size",
                     "checkpoint_keep", "validation_interval_steps", "validation_batches"):
            _check(name, getattr(self, name) >= 1, "must be >= 1")
        for name in ("warmup_steps", "checkpoint_interval_steps", "checkpoint_interval_seconds",
                     "checkpoint_wait_seconds", "dataset_cache_bytes", "dataset_prefetch_steps",
                     "max_grad_norm", "spike_factor", "weight_decay",
                     "step_sleep_seconds", "join_wait_after_step", "join_wait_seconds"):
            _check(name, getattr(self, name) >= 0, "must be >= 0")
        _check("lr", self.lr > 0, "must be > 0")
        _check("min_lr", 0 <= self.min_lr <= self.lr, "must be between 0 and ELASTRAIN_LR")
        _check("decay_fraction", 0 <= self.decay_fraction <= 1, "must be between 0 and 1")
        _check("metrics_port", 0 <= self.metrics_port <= 65535, "must be a TCP port or 0")
        _check("global_batch_size", self.global_batch_size % self.micro_batch_size == 0,
               f"must be a multiple of ELASTRAIN_MICRO_BATCH_SIZE ({self.micro_batch_size})")
        _check("checkpoint_uri",
               self.checkpoint_uri.startswith(tuple(f"{s}://" for s in CHECKPOINT_SCHEMES)),
               "must start with " + ", ".join(f"{s}://" for s in CHECKPOINT_SCHEMES))
        _check("spike_factor", self.spike_factor == 0 or self.spike_factor > 1,
               "must be 0 (off) or > 1")

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per step that keep the global batch constant at this world."""
        return accumulation_steps(self.global_batch_size, self.micro_batch_size, world_size)

    @classmethod
    def from_env(cls, env: Mapping[str, str], argv: Sequence[str] = ()) -> TrainerConfig:
        """Build from ELASTRAIN_* variables, then apply CLI flags on top."""
        raw: dict[str, str] = {}
        for f in dataclasses.fields(cls):
            value = env.get(env_name(f.name))
            if value is not None and value != "":
                raw[f.name] = value
        if argv:
            args = build_arg_parser().parse_args(list(argv))
            raw.update({k: v for k, v in vars(args).items() if v is not None})
        return cls(**{name: _parse_field(name, value) for name, value in raw.items()})

    def to_env(self) -> dict[str, str]:
        """The ELASTRAIN_* variables that reproduce this config (inverse of from_env)."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[env_name(f.name)] = str(int(value)) if isinstance(value, bool) else str(value)
        return out


def is_token_files(value: str) -> bool:
    """A comma-separated list of token file URIs or globs (at least one)."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    return bool(parts) and all(is_token_file_uri(p) for p in parts)


def is_token_file_uri(uri: str) -> bool:
    """file://<path> or s3://<bucket>/<key>."""
    if uri.startswith("file://"):
        return len(uri) > len("file://")
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return uri.startswith("s3://") and bool(bucket) and bool(key)


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """global = micro * world * accum; refuses a world size that cannot keep the global batch."""
    per_step = micro_batch * world_size
    if world_size < 1 or global_batch % per_step != 0:
        raise ValueError(
            f"ELASTRAIN_GLOBAL_BATCH_SIZE={global_batch} is not divisible by "
            f"ELASTRAIN_MICRO_BATCH_SIZE={micro_batch} x world size {world_size}; "
            "choose a global batch that every allowed world size divides")
    return global_batch // per_step


def build_arg_parser() -> argparse.ArgumentParser:
    """One --flag per config field; values stay strings and parse like the env."""
    parser = argparse.ArgumentParser(prog="python -m elastrain_trainer",
                                     description="elastrain built-in trainer")
    for f in dataclasses.fields(TrainerConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=f"overrides {env_name(f.name)}")
    return parser


_TYPES: dict[str, type] = {f.name: type(f.default) for f in dataclasses.fields(TrainerConfig)}


def _parse_field(name: str, value: Any) -> Any:
    kind = _TYPES[name]
    text = str(value).strip()
    try:
        if kind is bool:
            if text not in ("0", "1"):
                raise ValueError(text)
            return text == "1"
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        expected = {bool: '"1" or "0"', int: "an integer", float: "a number"}[kind]
        raise ValueError(f"{env_name(name)}={value!r} must be {expected}") from None
    return text


def _check(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{env_name(name)} {message}")


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    _check(name, value in choices, f"={value!r} must be one of {', '.join(choices)}")
