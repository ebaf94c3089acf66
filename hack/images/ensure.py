"""Which images exist, what goes into each, and `ensure_images`: a cached archive when its input
hash matches, a locked build otherwise.

    pause     hack/images/pause.c, gcc -static                      (pause.py)
    base      debootstrap minbase bookworm + python3, python3-venv  (base.py)
    operator  Dockerfile, PYTHON_IMAGE=<base>                       (buildah.py)
    trainer   trainer_image/Dockerfile, BASE_IMAGE=<base>, torch from PyPI without its CUDA
              wheels (TORCH_CUDA_LIBS=0), the torch wheel from $ELASTRAIN_CACHE/wheels
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hack.images import base, pause
from hack.images.buildah import DockerfileBuild, build_dockerfile, load_archive
from hack.images.cache import cache_root, images_dir, locked, log, record_time, run
from hack.images.inputs import input_hash

REPO = Path(__file__).resolve().parents[2]
NAMES = ("pause", "base", "operator", "trainer")
DEFAULT_NAMES = ("pause", "operator", "trainer")
# The pip index the trainer takes torch's own dependencies from (torch itself: the wheelhouse).
PYPI = "https://pypi.org/simple"
WHEELS_IN_BUILD = "/wheels"
# The trainer's torch, pinned so that an image's input hash never depends on what a venv resolved
# (`torch>=2.6` in pyproject.toml): the version the project venv has today, whose wheel pip's cache
# already holds. Raise it together with the venv's.
TORCH_VERSION = "2.15.0"
# Tracked files both Dockerfiles copy, besides their own sources.
PACKAGING = (".dockerignore", "pyproject.toml", "README.md")


@dataclass(frozen=True)
class Image:
    """A built image: `ref` is the name:tag in the archive's RepoTags, what a pod's `image:` uses
    after `ctr -n k8s.io images import <archive>` (containerd records it as docker.io/<ref>, the
    same name the CRI makes of `ref`)."""

    name: str
    ref: str
    archive: Path
    input_hash: str


@dataclass(frozen=True)
class _Plan:
    image: Image
    build: Callable[[Path, Path], None]  # (partial archive path, log file) -> None


def ensure_images(names: Iterable[str] = DEFAULT_NAMES, *, repo: Path = REPO) -> dict[str, Image]:
    """Each named image, built first when no archive with its current input hash is cached
    (operator and trainer build the base first). Safe to call from concurrent processes."""
    wanted = list(dict.fromkeys(names))
    if unknown := set(wanted) - set(NAMES):
        raise ValueError(f"unknown images {sorted(unknown)}; known: {', '.join(NAMES)}")
    done: dict[str, Image] = {}
    for name in wanted:
        _ensure(name, repo, done)
    return {name: done[name] for name in wanted}


def planned_images(names: Iterable[str] = NAMES, *, repo: Path = REPO) -> dict[str, Image]:
    """What ensure_images would return, without building anything (archives may be missing);
    the base's hash needs no base build: it depends on inputs only."""
    base_image = _plan("base", repo, None).image
    return {n: _plan(n, repo, None if n == "base" else base_image).image for n in names}


def _ensure(name: str, repo: Path, done: dict[str, Image]) -> Image:
    if name in done:
        return done[name]
    base_image = None if name in ("pause", "base") else _ensure("base", repo, done)
    plan = _plan(name, repo, base_image)
    image = plan.image
    if not image.archive.exists():
        with locked(name):
            if not image.archive.exists():
                _build(plan)
    done[name] = image
    return image


def _build(plan: _Plan) -> None:
    image = plan.image
    log_file = images_dir() / "logs" / f"{image.name}-{image.input_hash[:12]}.log"
    log(f"building {image.ref} (log: {log_file})")
    start = time.monotonic()
    plan.build(image.archive, log_file)
    seconds = time.monotonic() - start
    record_time(image.name, image.input_hash, seconds)
    size = image.archive.stat().st_size / 2**20
    log(f"built {image.ref} in {seconds:.0f} s: {image.archive} ({size:.0f} MiB)")


def _plan(name: str, repo: Path, base_image: Image | None) -> _Plan:
    if name == "pause":
        paths = ("hack/images/pause.c", "hack/images/pause.py", "hack/images/archive.py")
        return _make_plan(name, repo, paths, pause.build_args(),
                          lambda dest, lg, ref: pause.build_pause(dest, ref=ref, log_file=lg))
    if name == "base":
        paths = ("hack/images/base.py", "hack/images/archive.py")
        return _make_plan(name, repo, paths, base.build_args(),
                          lambda dest, lg, ref: base.build_base(dest, ref=ref, log_file=lg))
    assert base_image is not None, f"{name} builds on the base image"
    build = operator_build(base_image) if name == "operator" else trainer_build(base_image)
    paths = (build.dockerfile, *build.context, "hack/images/buildah.py", "hack/images/ensure.py")
    args = {**build.args, "BASE_INPUT_HASH": base_image.input_hash}

    def run_build(dest: Path, log_file: Path, ref: str) -> None:
        assert base_image is not None
        load_archive(base_image.archive, base_image.ref, log_file=log_file)
        if name == "trainer":
            ensure_torch_wheel(log_file=log_file)
        build_dockerfile(build, dest, repo=repo, ref=ref, log_file=log_file)

    return _make_plan(name, repo, paths, args, run_build)


def _make_plan(name: str, repo: Path, paths: tuple[str, ...], args: Mapping[str, str],
               build: Callable[[Path, Path, str], None]) -> _Plan:
    digest = input_hash(repo, paths, args)
    ref = f"elastrain/{name}:{digest[:12]}"
    archive = images_dir() / f"{name}-{digest[:12]}.tar"
    return _Plan(Image(name, ref, archive, digest), lambda dest, lg: build(dest, lg, ref))


# ------------------------------------------------------------------------- operator and trainer


def operator_build(base_image: Image) -> DockerfileBuild:
    return DockerfileBuild(
        dockerfile="Dockerfile",
        context=(*PACKAGING, "operator"),
        args={"PYTHON_IMAGE": f"localhost/{base_image.ref}"},
    )


def trainer_build(base_image: Image) -> DockerfileBuild:
    return DockerfileBuild(
        dockerfile="trainer_image/Dockerfile",
        context=(*PACKAGING, "operator", "trainer_image/elastrain_trainer"),
        args={
            "BASE_IMAGE": f"localhost/{base_image.ref}",
            "TORCH_VARIANT": "cpu",
            "TORCH_INDEX_URL": PYPI,
            "TORCH_REQUIREMENT": f"torch=={torch_version()}",
            "TORCH_CUDA_LIBS": "0",
            "PIP_FIND_LINKS": WHEELS_IN_BUILD,
        },
        volumes=(f"{wheels_dir()}:{WHEELS_IN_BUILD}:ro",),
    )


def torch_version() -> str:
    """TORCH_VERSION, or the environment variable of that name."""
    return os.environ.get("TORCH_VERSION") or TORCH_VERSION


def wheels_dir() -> Path:
    return cache_root() / "wheels"


def ensure_torch_wheel(*, log_file: Path) -> Path:
    """The pinned torch wheel (CPython 3.11, manylinux x86_64) in $ELASTRAIN_CACHE/wheels,
    downloaded from PyPI once (pip's HTTP cache makes that quick after a venv install)."""
    version = torch_version()
    pattern = f"torch-{version}-cp311-cp311-manylinux*_x86_64.whl"
    wheels = wheels_dir()
    wheels.mkdir(parents=True, exist_ok=True)
    with locked("wheels"):
        if found := sorted(wheels.glob(pattern)):
            return found[-1]
        partial = wheels / ".download"
        subprocess.run(["rm", "-rf", str(partial)], check=True)
        run([_pip_python(), "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.11", "--platform", "manylinux_2_36_x86_64",
             "--progress-bar", "off", "-d", str(partial), f"torch=={version}"], log_file=log_file)
        (wheel,) = partial.glob(pattern)
        wheel.rename(wheels / wheel.name)
        partial.rmdir()
        return wheels / wheel.name


def _pip_python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable
