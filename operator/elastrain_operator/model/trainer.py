"""spec.trainer: the built-in trainer's settings, and the batch a script's Session checks.

Every field reaches the trainer as ELASTRAIN_<FIELD> (render/env.py); a field left unset is not
rendered, so the trainer's own default (elastrain_trainer.config) or a user script's choice
stands.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from elastrain_operator.model.base import ApiModel, cel, immutable, k8s

# Token files: s3://<bucket>/<key> or file://<path> (in the worker), each may be a glob (*, ?,
# [...]), several comma-separated; the trainer lists globs and sorts the shards by URI.
_TOKEN_FILE = r"( *(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^,]+|file://[^,]+))"
TOKEN_FILES = rf"^{_TOKEN_FILE}(,{_TOKEN_FILE})*$"
# A built-in dataset, or token files.
DATASET = rf"^(synthetic|text|{_TOKEN_FILE}(,{_TOKEN_FILE})*)$"
DATASET_MESSAGE = ("spec.trainer.dataset must be synthetic, text, or token files: "
                   "s3://<bucket>/<key> or file://<path>, globs of them (*, ?, [...]), "
                   "comma-separated")
VALIDATION_DATASET_MESSAGE = ("spec.trainer.validation.dataset must be token files: "
                              "s3://<bucket>/<key> or file://<path>, globs of them (*, ?, [...]), "
                              "comma-separated")
# Long enough for an explicit list of ~100 shard URIs; globs name thousands.
DATASET_MAX_LENGTH = 8192
BYTE_VOCAB_MESSAGE = ("spec.trainer.vocabSize must be at least 256 for the byte-level datasets "
                      "synthetic and text")

# The built-in trainer's batch where spec.trainer leaves it unset (elastrain_trainer.config's
# defaults). Unset fields are not rendered: a user script's DataLoader then decides its batch,
# where a CRD default would have been indistinguishable from a value the user chose.
DEFAULT_GLOBAL_BATCH = 8
DEFAULT_MICRO_BATCH = 2
BATCH_MESSAGE = ("spec.trainer.globalBatchSize must be a multiple of spec.trainer.microBatchSize "
                 f"(unset: {DEFAULT_GLOBAL_BATCH} and {DEFAULT_MICRO_BATCH})")
BATCH_RULE = cel(
    f"(has(self.trainer.globalBatchSize) ? self.trainer.globalBatchSize : {DEFAULT_GLOBAL_BATCH})"
    f" % (has(self.trainer.microBatchSize) ? self.trainer.microBatchSize : {DEFAULT_MICRO_BATCH})"
    " == 0", BATCH_MESSAGE, field_path=".trainer.globalBatchSize")


class ValidationSpec(ApiModel):
    """A validation split: its mean loss over `batches` global batches, on every rank's share
    and reduced, after every `intervalSteps` steps and the last one. It reads the same samples
    each time and changes nothing the training sees."""

    dataset: str = Field(
        max_length=DATASET_MAX_LENGTH,
        description="Token files (same forms and datasetFormat as spec.trainer.dataset)",
        json_schema_extra=k8s(cel(f"self.matches('{TOKEN_FILES}')",
                                  VALIDATION_DATASET_MESSAGE)))
    interval_steps: int = Field(default=100, ge=1, le=10_000_000,
                                description="Evaluate after every this many steps.")
    batches: int = Field(default=10, ge=1, le=100_000,
                         description="Global batches (globalBatchSize samples) per evaluation.")

    @model_validator(mode="after")
    def _dataset_shape(self) -> ValidationSpec:
        if not re.match(TOKEN_FILES, self.dataset):
            raise ValueError(VALIDATION_DATASET_MESSAGE)
        return self


class TrainerSpec(ApiModel):
    """Settings of the built-in trainer; passed to it as ELASTRAIN_* environment variables."""

    model: Literal["gpt-tiny", "gpt-small", "gpt-100m", "gpt-350m", "gpt-1b"] = Field(
        default="gpt-tiny", json_schema_extra=k8s(immutable("spec.trainer.model")))
    dataset: str = Field(
        default="synthetic", max_length=DATASET_MAX_LENGTH,
        description="synthetic or text (bytes, built in), or token files read by ranged GETs "
                    "(s3://, credentials and endpoint as for checkpoints) or memory maps "
                    "(file://): one URI, a glob (shards sorted by URI) or a comma-separated "
                    "list of them",
        json_schema_extra=k8s(cel(f"self.matches('{DATASET}')", DATASET_MESSAGE)))
    dataset_format: Literal["nanogpt", "llmc"] = Field(
        default="nanogpt",
        description="The token files' layout: nanogpt (headerless uint16, train.bin) or llmc "
                    "(llm.c's write_datafile: 256 x int32 header; gpt-2: magic 20240520 "
                    "version 1, uint16 tokens; llama-3: magic 20240801 version 7, uint32)")
    validation: ValidationSpec | None = Field(
        default=None, description="A validation split; unset: no validation loss.")
    vocab_size: int = Field(
        default=256, ge=2, le=1_048_576,
        description="The model's vocabulary; must exceed every token id in the dataset "
                    "(at least 256 for synthetic and text)",
        json_schema_extra=k8s(immutable("spec.trainer.vocabSize")))
    steps: int = Field(default=100, ge=1, le=10_000_000)
    seq_len: int = Field(default=128, ge=8, le=65_536,
                         json_schema_extra=k8s(immutable("spec.trainer.seqLen")))
    global_batch_size: int | None = Field(
        default=None, ge=1, le=1_048_576,
        description="Samples per optimizer step over all ranks. Unset: the built-in trainer "
                    f"uses {DEFAULT_GLOBAL_BATCH}; a script on the Session API uses "
                    "Session(global_batch=) or its DataLoader's batch_size x spec.replicas. "
                    "Set, a script's global batch must equal it (refused at its first step).")
    micro_batch_size: int | None = Field(
        default=None, ge=1, le=65_536,
        description="Samples per rank per forward and backward. Unset: the built-in trainer "
                    f"uses {DEFAULT_MICRO_BATCH}; a script, its DataLoader's batch_size. Set, "
                    "the script's DataLoader must use it (refused at its first step).")
    lr: float = Field(default=3e-4, gt=0, le=10)
    min_lr: float = Field(default=3e-5, ge=0, le=10)
    warmup_steps: int = Field(default=10, ge=0, le=10_000_000)
    lr_schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = Field(default=0.2, gt=0, le=1)
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    precision: Literal["bf16", "fp16", "fp32"] = "fp32"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    max_grad_norm: float = Field(default=1.0, ge=0)
    spike_factor: float = Field(default=0.0, ge=0)
    seed: int = Field(default=1234, ge=0, le=2**31 - 1)

    @property
    def batch(self) -> tuple[int, int]:
        """(global, micro) as the built-in trainer resolves them."""
        return (self.global_batch_size or DEFAULT_GLOBAL_BATCH,
                self.micro_batch_size or DEFAULT_MICRO_BATCH)

    @model_validator(mode="after")
    def _dataset_shape(self) -> TrainerSpec:
        if not re.match(DATASET, self.dataset):
            raise ValueError(DATASET_MESSAGE)
        if self.dataset in ("synthetic", "text") and self.vocab_size < 256:
            raise ValueError(BYTE_VOCAB_MESSAGE)
        return self

