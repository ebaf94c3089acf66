"""The CRD's checkpoint URI rule, the trainer's config and the trainer's storage backends agree
on the schemes the image supports, and the CRD's message names the package each one needs."""

from __future__ import annotations

import re

import pytest

from elastrain_operator.model.spec import CHECKPOINT_URI, CHECKPOINT_URI_MESSAGE
from elastrain_trainer.checkpoint.fsspec_storage import SCHEMES
from elastrain_trainer.config import CHECKPOINT_SCHEMES, TrainerConfig

# One well-formed URI per scheme: its bucket or container name at the edge of what is allowed.
SAMPLES = {"file": "file:///mnt/ckpts", "s3": "s3://my.bucket-1/runs/a",
           "gs": "gs://my_bucket.example/runs/a", "az": "az://ckpts-01/runs/a",
           "abfs": "abfs://ckpts@acct.dfs.core.windows.net/runs/a"}


def test_the_config_knows_exactly_the_schemes_with_a_backend() -> None:
    assert set(CHECKPOINT_SCHEMES) == {"file", "s3", *SCHEMES}
    assert set(SAMPLES) == set(CHECKPOINT_SCHEMES)


@pytest.mark.parametrize("scheme", CHECKPOINT_SCHEMES)
def test_the_crd_and_the_trainer_accept_every_supported_scheme(scheme: str) -> None:
    uri = SAMPLES[scheme]
    assert re.match(CHECKPOINT_URI, uri), uri
    assert TrainerConfig(checkpoint_uri=uri).checkpoint_uri == uri


@pytest.mark.parametrize("uri", ["ftp://bucket/run", "memory://bucket/run", "gs://Bucket/run",
                                 "gs://b", "az://my_container/run", "s3:///run", "gs:/bucket"])
def test_the_crd_refuses_other_schemes_and_malformed_names(uri: str) -> None:
    assert not re.match(CHECKPOINT_URI, uri)


@pytest.mark.parametrize("uri", ["ftp://bucket/run", "memory://bucket/run", "bucket/run"])
def test_the_trainer_config_refuses_other_schemes(uri: str) -> None:
    with pytest.raises(ValueError, match="ELASTRAIN_CHECKPOINT_URI must start with file://, "
                                         "s3://, gs://, az://, abfs://"):
        TrainerConfig(checkpoint_uri=uri)


@pytest.mark.parametrize(("scheme", "package"), [(s, p) for s, (p, _extra) in SCHEMES.items()])
def test_the_crd_message_names_the_package_a_scheme_needs(scheme: str, package: str) -> None:
    said = CHECKPOINT_URI_MESSAGE.partition(f"{scheme}://")[2]
    assert said and f"the image needs {package}" in said.partition(")")[0], CHECKPOINT_URI_MESSAGE
