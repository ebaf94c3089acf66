"""Token files (nanoGPT, llm.c's gpt-2 and llama-3 layouts, as its write_datafile writes them) on
file:// and on the real MinIO, one file or many shards (a glob, a list), read by real torchrun
trainers: loss decreases, and a SIGTERM mid-run resumes onto exactly the samples an
uninterrupted run sees (bit-identical final weights, as test_elastic checks for synthetic data).
A bad shard among many is refused naming it.
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from elastrain_trainer.checkpoint.s3 import S3Storage
from elastrain_trainer.launch.cluster import LocalCluster
from elastrain_trainer.summary import loss_curve, summarize
from elastrain_trainer.tokenfiles import TokenFileError, open_token_dataset
from tests.token_files import llmc_bytes, nanogpt_bytes, pattern_tokens

from .conftest import load_checkpoint, s3_env, trainer_env
from .test_elastic import RUN_TIMEOUT, STEPS, assert_identical, live_agents, records, run_cluster

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(300)]
VOCAB = 512  # past the byte range, so the model's vocabulary really comes from the spec
TOKENS = 1_200_000  # 36k windows of 33 in 3 (uint16) or 5 (uint32) blocks of ~1 MiB

SHARDS = 5  # of uneven sizes: windows at every shard's end are dropped, blocks are cut short
# (where, format, llm.c layout, shards)
CASES = [pytest.param(("file", "nanogpt", "", 1), id="file-nanogpt"),
         pytest.param(("s3", "llmc", "gpt-2", 1), id="s3-llmc-gpt2", marks=pytest.mark.s3),
         pytest.param(("file", "llmc", "llama-3", 1), id="file-llmc-llama3"),
         pytest.param(("s3", "llmc", "llama-3", SHARDS), id="s3-shards-glob",
                      marks=pytest.mark.s3),
         pytest.param(("file", "nanogpt", "", SHARDS), id="file-shards-list")]


def token_bytes(fmt: str, layout: str, shards: int = 1) -> list[bytes]:
    # Ids in [448, 512): a model that learns anything beats a uniform guess over the vocabulary
    # quickly, and the top ids exercise the spec's vocabulary past the byte range.
    tokens = pattern_tokens(TOKENS, VOCAB, seed=7, low=VOCAB - 64)
    cuts = [0, *sorted(TOKENS * (2 * i + 1) // (2 * shards) + 7 * i for i in range(1, shards)),
            TOKENS] if shards > 1 else [0, TOKENS]
    parts = [tokens[a:b] for a, b in itertools.pairwise(cuts)]
    return [nanogpt_bytes(p) if fmt == "nanogpt" else llmc_bytes(p, layout) for p in parts]


@pytest.fixture(scope="module", params=CASES)
def dataset_env(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The ELASTRAIN_* (and AWS_*) that point a trainer at a token file made for the test."""
    where, fmt, layout, shards = request.param
    data = token_bytes(fmt, layout, shards)
    names = ["train.bin"] if shards == 1 else [f"train_{i:06d}.bin" for i in range(shards)]
    env = {"ELASTRAIN_DATASET_FORMAT": fmt, "ELASTRAIN_VOCAB_SIZE": str(VOCAB)}
    if where == "file":
        root = tmp_path_factory.mktemp("tokens")
        for name, part in zip(names, data, strict=True):
            (root / name).write_bytes(part)
        # Shards named out of order: the trainer sorts them.
        yield {**env, "ELASTRAIN_DATASET": ", ".join(f"file://{root}/{n}" for n in names[::-1])}
        return
    s3 = request.getfixturevalue("s3")
    prefix = f"datasets/{uuid.uuid4().hex[:10]}"
    store = S3Storage(f"s3://{s3.bucket}", client=_client(s3))
    for name, part in zip(names, data, strict=True):
        store.write(f"{prefix}/{name}", part)
    store.write(f"{prefix}/val_000000.bin", data[0][:4096])  # beside them, not matched
    pattern = "train.bin" if shards == 1 else "train_*.bin"
    yield {**env, **s3_env(s3), "ELASTRAIN_DATASET": f"s3://{s3.bucket}/{prefix}/{pattern}",
           "ELASTRAIN_CHECKPOINT_ENDPOINT": s3.endpoint_url}
    store.delete([f"{prefix}/{n}" for n in [*names, "val_000000.bin"]])


def _client(s3: Any) -> Any:
    import boto3  # the test's own uploads; the trainer builds its client in checkpoint/s3.py

    from elastrain_trainer.checkpoint.s3 import CLIENT_CONFIG
    return boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name=s3.region,
                        config=CLIENT_CONFIG)


@pytest.fixture(scope="module")
def reference(dataset_env: dict[str, str],
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted DDP run at world size 2 on the token file."""
    tmp = tmp_path_factory.mktemp("reference")
    cluster, codes = run_cluster(tmp, {**trainer_env(tmp), **dataset_env}, (2, 2), workers=2)
    assert set(codes.values()) == {0}, codes
    return {"curve": loss_curve(records(cluster)),
            "state": load_checkpoint(tmp / "ckpt", STEPS, tmp)}


def test_loss_decreases_on_a_token_file(reference: dict[str, Any]) -> None:
    curve = reference["curve"]
    assert sorted(curve) == list(range(1, STEPS + 1))
    first, last = np.mean([curve[s] for s in range(1, 5)]), np.mean(
        [curve[s] for s in range(STEPS - 3, STEPS + 1)])
    assert first > 5.5  # ~ln(512): the model starts from a uniform guess over the spec's vocab
    assert last < 0.8 * first, curve


def test_sigterm_mid_run_resumes_onto_the_same_samples(
        reference: dict[str, Any], dataset_env: dict[str, str], tmp_path: Path) -> None:
    at = random.randint(4, STEPS - 6)

    def preempt(cluster: LocalCluster) -> None:
        assert cluster.wait_for_step(at, timeout=RUN_TIMEOUT)
        cluster.preempt(random.choice(live_agents(cluster)))
        cluster.add_agent()

    env = {**trainer_env(tmp_path, step_sleep_seconds="0.15"), **dataset_env}
    cluster, codes = run_cluster(tmp_path, env, (2, 2), workers=2, script=preempt)
    summary = summarize(records(cluster))
    assert summary.finished, codes
    assert summary.resumes == 1 and summary.steps_lost == 0, summary
    final = load_checkpoint(tmp_path / "ckpt", STEPS, tmp_path)
    for part in ("model", "optim"):
        assert_identical(reference["state"][part], final[part], part)
    assert final["trainer"]["samples_seen"] == reference["state"]["trainer"]["samples_seen"]


@pytest.mark.s3
@pytest.mark.parametrize(("data", "problem"), [
    (llmc_bytes(np.arange(100), magic=1), "bad magic 1 in the llm.c header"),
    (llmc_bytes(np.arange(100))[:-10],
     "truncated: the llm.c gpt-2 header declares 100 uint16 tokens"),
    (llmc_bytes(np.arange(1000)), "token id 512 at token 512 is >= vocabSize 512"),
])
def test_a_bad_object_on_s3_is_refused_naming_it(
        s3_credentials: Any, data: bytes, problem: str) -> None:
    s3 = s3_credentials
    key = f"datasets/{uuid.uuid4().hex[:10]}/bad.bin"
    store = S3Storage(f"s3://{s3.bucket}", endpoint_url=s3.endpoint_url)
    store.write(key, data)
    uri = f"s3://{s3.bucket}/{key}"
    try:
        with pytest.raises(TokenFileError) as e:
            open_token_dataset(uri, "llmc", seq_len=8, seed=0, vocab_size=VOCAB,
                               global_batch_size=4, endpoint=s3.endpoint_url)
    finally:
        store.delete([key])
    assert str(e.value).startswith(f"{uri}: ") and problem in str(e.value), e.value


@pytest.mark.s3
@pytest.mark.parametrize(("bad", "problem"), [
    (llmc_bytes(np.arange(600), "llama-3")[:-4], "truncated: the llm.c llama-3 header declares"),
    (llmc_bytes(np.arange(600), magic=20240801), "unsupported llm.c version 1 for magic 20240801"),
    (nanogpt_bytes(np.arange(600)), "bad magic"),
])
def test_a_bad_shard_among_many_is_refused_naming_it(
        s3_credentials: Any, bad: bytes, problem: str) -> None:
    """11 good llama-3 shards and one bad one, opened through a glob: the error names the bad
    one (headers are read for every shard at open, with ranged GETs)."""
    s3 = s3_credentials
    prefix = f"datasets/{uuid.uuid4().hex[:10]}"
    store = S3Storage(f"s3://{s3.bucket}", endpoint_url=s3.endpoint_url)
    keys = [f"{prefix}/fineweb_train_{i:06d}.bin" for i in range(12)]
    for i, key in enumerate(keys):
        store.write(key, bad if i == 7 else llmc_bytes(np.arange(600) % VOCAB, "llama-3"))
    try:
        with pytest.raises(TokenFileError) as e:
            open_token_dataset(f"s3://{s3.bucket}/{prefix}/fineweb_train_*.bin", "llmc",
                               seq_len=8, seed=0, vocab_size=VOCAB, global_batch_size=4,
                               endpoint=s3.endpoint_url)
    finally:
        store.delete(keys)
    assert str(e.value).startswith(f"s3://{s3.bucket}/{keys[7]}: "), e.value
    assert problem in str(e.value), e.value


@pytest.mark.s3
def test_a_glob_that_matches_nothing_is_named(s3_credentials: Any) -> None:
    s3 = s3_credentials
    uri = f"s3://{s3.bucket}/datasets/none/train_*.bin"
    with pytest.raises(TokenFileError, match=f"^{uri.replace('*', '[*]')}: matches no token file"):
        open_token_dataset(uri, "llmc", seq_len=8, seed=0, vocab_size=VOCAB,
                           global_batch_size=4, endpoint=s3.endpoint_url)


@pytest.mark.s3
def test_a_missing_object_is_named_with_the_endpoint(s3_credentials: Any) -> None:
    s3 = s3_credentials
    uri = f"s3://{s3.bucket}/datasets/none/train.bin"
    with pytest.raises(TokenFileError, match=f"^{uri}: cannot open: 404 "):
        open_token_dataset(uri, "nanogpt", seq_len=8, seed=0, vocab_size=VOCAB,
                           global_batch_size=4, endpoint=s3.endpoint_url)
