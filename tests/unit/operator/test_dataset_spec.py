"""spec.trainer.dataset (globs, lists) / datasetFormat / vocabSize / validation: what the model
admits and refuses."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from elastrain_operator.model.trainer import (
    BYTE_VOCAB_MESSAGE,
    DATASET_MESSAGE,
    VALIDATION_DATASET_MESSAGE,
    TrainerSpec,
    ValidationSpec,
)


@pytest.mark.parametrize("dataset", ["synthetic", "text", "s3://corpus/fineweb/train_000.bin",
                                     "file:///data/openwebtext/train.bin"])
def test_built_in_datasets_and_token_file_uris_are_admitted(dataset: str) -> None:
    spec = TrainerSpec.model_validate({"dataset": dataset, "vocabSize": 50304})
    assert spec.dataset == dataset and spec.dataset_format == "nanogpt"


@pytest.mark.parametrize("dataset", ["openwebtext", "s3://corpus", "s3://corpus/", "s3://A/b",
                                     "gs://corpus/train.bin", "file://"])
def test_anything_else_is_refused_with_the_crds_message(dataset: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(DATASET_MESSAGE)):
        TrainerSpec.model_validate({"dataset": dataset})


def test_the_byte_datasets_need_a_vocabulary_of_256() -> None:
    with pytest.raises(ValidationError, match=BYTE_VOCAB_MESSAGE):
        TrainerSpec.model_validate({"dataset": "text", "vocabSize": 100})
    spec = TrainerSpec.model_validate({"dataset": "s3://corpus/t.bin", "vocabSize": 100})
    assert spec.vocab_size == 100


def test_the_format_is_one_of_the_two_layouts() -> None:
    assert TrainerSpec.model_validate({"datasetFormat": "llmc"}).dataset_format == "llmc"
    with pytest.raises(ValidationError):
        TrainerSpec.model_validate({"datasetFormat": "parquet"})


@pytest.mark.parametrize("dataset", [
    "s3://corpus/fineweb10B/fineweb_train_*.bin", "file:///data/shards/*.bin",
    "s3://corpus/a/train_000.bin,s3://corpus/a/train_001.bin",
    "file:///d/a.bin, file:///d/b_[0-9].bin, s3://corpus/c/*.bin"])
def test_globs_and_lists_of_token_files_are_admitted(dataset: str) -> None:
    assert TrainerSpec.model_validate({"dataset": dataset}).dataset == dataset


@pytest.mark.parametrize("dataset", ["s3://corpus/a.bin,text", "s3://corpus/a.bin,",
                                     "synthetic,s3://corpus/a.bin", "file:///a.bin,gs://c/b.bin"])
def test_a_list_with_anything_but_token_files_is_refused(dataset: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(DATASET_MESSAGE)):
        TrainerSpec.model_validate({"dataset": dataset})


def test_a_validation_split_takes_token_files_an_interval_and_batches() -> None:
    spec = TrainerSpec.model_validate({"dataset": "s3://corpus/train_*.bin", "validation": {
        "dataset": "s3://corpus/val_*.bin", "intervalSteps": 250, "batches": 20}})
    assert spec.validation == ValidationSpec(dataset="s3://corpus/val_*.bin", interval_steps=250,
                                             batches=20)
    assert TrainerSpec.model_validate({}).validation is None
    for bad in ("text", "synthetic", "gs://c/v.bin"):
        with pytest.raises(ValidationError, match=re.escape(VALIDATION_DATASET_MESSAGE)):
            TrainerSpec.model_validate({"validation": {"dataset": bad}})
    for field in ("intervalSteps", "batches"):
        with pytest.raises(ValidationError, match=f"validation.{field}"):
            TrainerSpec.model_validate({"validation": {"dataset": "file:///v.bin", field: 0}})
