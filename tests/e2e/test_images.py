"""The project's images, read from their docker-archives (nothing runs): what hack/images builds
for the one-node cluster must run as a numeric non-root user (so `runAsNonRoot` admits it), keep
torch out of the operator, and keep what torch never loads on CPU (triton, cuda-bindings: ~1 GB)
out of the trainer. (PyPI's torch links its nvidia-* libraries, so those stay.)

Builds the images when missing (minutes when cold, ~1 s when cached: see hack/README.md);
ELASTRAIN_SKIP_BUILD=1 skips instead.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hack.images import Image, ensure_images, planned_images  # noqa: E402
from hack.images.archive import iter_layer_entries, read_config, read_manifest  # noqa: E402

pytestmark = pytest.mark.e2e

NAMES = ("pause", "operator", "trainer", "torch")
NONROOT_NAMES = ("pause", "operator", "trainer")  # torch: a stock user image, root like most
NONROOT = "65532:65532"
SITE_PACKAGES = re.compile(r"^opt/venv/lib/python3\.\d+/site-packages/(?P<top>[^/]+)")
BUILD_TOOLS = ("buildah", "debootstrap", "gcc", "git")


@pytest.fixture(scope="module")
def images() -> dict[str, Image]:
    missing = [n for n, i in planned_images(NAMES).items() if not i.archive.exists()]
    if missing and os.environ.get("ELASTRAIN_SKIP_BUILD") == "1":
        pytest.skip(f"images not built: {missing}; run `python3 -m hack.images build`")
    if missing and (tools := [t for t in BUILD_TOOLS if shutil.which(t) is None]):
        pytest.skip(f"images {missing} not built and {tools} missing to build them")
    return ensure_images(NAMES)


def layer_files(image: Image) -> dict[str, tarfile.TarInfo]:
    """The final file system's entries by path (later layers win; whiteouts delete)."""
    files: dict[str, tarfile.TarInfo] = {}
    for entry in iter_layer_entries(image.archive):
        path = entry.name.removeprefix("./").rstrip("/")
        parent, _, base = path.rpartition("/")
        if base == ".wh..wh..opq":
            files = {p: e for p, e in files.items() if not p.startswith(f"{parent}/")}
        elif base.startswith(".wh."):
            gone = f"{parent}/{base[4:]}".lstrip("/")
            files = {p: e for p, e in files.items() if p != gone and not p.startswith(f"{gone}/")}
        else:
            files[path] = entry
    return files


def site_packages(image: Image) -> set[str]:
    """Top-level names in the image venv's site-packages."""
    return {m["top"] for p in layer_files(image) if (m := SITE_PACKAGES.match(p))}


@pytest.mark.parametrize("name", NONROOT_NAMES)
def test_image_runs_as_numeric_nonroot_user(images: dict[str, Image], name: str) -> None:
    assert read_config(images[name].archive)["config"].get("User") == NONROOT


@pytest.mark.parametrize("name", NAMES)
def test_archive_is_tagged_with_the_ref_a_pod_uses(images: dict[str, Image], name: str) -> None:
    image = images[name]
    assert image.ref == f"elastrain/{name}:{image.input_hash[:12]}"
    tags = read_manifest(image.archive)["RepoTags"]
    # containerd's import and the CRI both normalise a short name to docker.io/<name>.
    assert {t if t.startswith("docker.io/") else f"docker.io/{t}" for t in tags} == {
        f"docker.io/{image.ref}"}


def test_pause_entrypoint_is_an_executable_in_the_image(images: dict[str, Image]) -> None:
    entrypoint = read_config(images["pause"].archive)["config"]["Entrypoint"]
    entry = layer_files(images["pause"]).get(entrypoint[0].lstrip("/"))
    assert entry is not None, f"{entrypoint[0]} is not in the pause image"
    assert entry.isreg() and entry.mode & 0o111


def test_operator_image_has_no_torch(images: dict[str, Image]) -> None:
    packages = site_packages(images["operator"])
    assert "kopf" in packages and "elastrain_operator" in packages  # the venv is where we look
    assert not {p for p in packages if p == "torch" or p.startswith("torch-")}


def test_trainer_image_has_torch_but_not_what_cpu_training_never_loads(
        images: dict[str, Image]) -> None:
    packages = site_packages(images["trainer"])
    assert {"torch", "elastrain_trainer"} <= packages
    skipped = {p for p in packages if p.lower().startswith(("triton", "cuda_bindings"))}
    assert not skipped, f"left out on purpose, yet in the trainer image: {sorted(skipped)}"


def test_torch_image_is_stock_torch_and_the_trainers_lower_layers(
        images: dict[str, Image]) -> None:
    """The e2e tier's user image: torch and torchrun on PATH, none of elastrain's packages, and
    built from the trainer's own first stage (its layers are the trainer's lowest ones)."""
    packages = site_packages(images["torch"])
    assert "torch" in packages
    ours = {p for p in packages if p.lower().startswith("elastrain")}
    assert not ours, f"elastrain code in the stock torch image: {sorted(ours)}"
    env = read_config(images["torch"].archive)["config"]["Env"]
    assert any(e.startswith("PATH=/opt/venv/bin:") for e in env), env
    assert "opt/venv/bin/torchrun" in layer_files(images["torch"])
    torch_layers = read_manifest(images["torch"].archive)["Layers"]
    trainer_layers = read_manifest(images["trainer"].archive)["Layers"]
    assert trainer_layers[:len(torch_layers)] == torch_layers
