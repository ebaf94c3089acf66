"""spec.trainer.dataset / datasetFormat / vocabSize: what the model admits and refuses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from elastrain_operator.model.spec import BYTE_VOCAB_MESSAGE, DATASET_MESSAGE, TrainerSpec


@pytest.mark.parametrize("dataset", ["synthetic", "text", "s3://corpus/fineweb/train_000.bin",
                                     "file:///data/openwebtext/train.bin"])
def test_built_in_datasets_and_token_file_uris_are_admitted(dataset: str) -> None:
    spec = TrainerSpec.model_validate({"dataset": dataset, "vocabSize": 50304})
    assert spec.dataset == dataset and spec.dataset_format == "nanogpt"


@pytest.mark.parametrize("dataset", ["openwebtext", "s3://corpus", "s3://corpus/", "s3://A/b",
                                     "gs://corpus/train.bin", "file://"])
def test_anything_else_is_refused_with_the_crds_message(dataset: str) -> None:
    with pytest.raises(ValidationError, match=DATASET_MESSAGE):
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
