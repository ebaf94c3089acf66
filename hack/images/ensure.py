"""Which images exist, what goes into each, and `ensure_images`: a cached archive when its input
hash matches, a locked build otherwise.

    pause     hack/images/pause.c, gcc -static                      (pause.py)
    base      debootstrap minbase bookworm + python3, python3-venv  (base.py)
    operator  Dockerfile, PYTHON_IMAGE=<base>                       (buildah.py)
    trainer   trainer_image/Dockerfile, BASE_IMAGE=<base>, torch from PyPI (a CUDA build) without
              triton and cuda-bindings, from a wheelhouse in $ELASTRAIN_CACHE/wheels
    torch     the trainer archive's layers up to the end of its `torch` stage (no build: cut
              out of the archive, so the layers are the trainer's own) with a root config of its
              own: a stock torch image with no elastrain code, a user's own `torchrun train.py`
              image for the e2e tier
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hack.debian import PackageError, ensure_packages
from hack.images import base, pause
from hack.images.archive import write_lower_archive
from hack.images.buildah import DockerfileBuild, build_dockerfile, load_archive
from hack.images.cache import BuildError, cache_root, images_dir, locked, log, record_time, run
from hack.images.inputs import input_hash

REPO = Path(__file__).resolve().parents[2]
NAMES = ("pause", "base", "operator", "trainer", "torch")
DEFAULT_NAMES = ("pause", "operator", "trainer")
# Where the trainer's torch comes from: PyPI (download.pytorch.org is not reachable everywhere),
# through a wheelhouse filled once and mounted read-only into every build at WHEELS_IN_BUILD.
PYPI = "https://pypi.org/simple"
WHEELS_IN_BUILD = "/wheels"
# The trainer's torch, pinned so that an image's input hash never depends on what a venv resolved
# (within pyproject.toml's `torch>=2.15,<2.16`): the version the project venv has today, so the
# e2e tier runs the torch the other tiers test. Raise it together with the venv's and that range.
TORCH_VERSION = "2.15.0"
# torch's requirements the CPU trainer leaves out (TORCH_SKIP_DEPS in trainer_image/Dockerfile):
# loaded only by torch.compile and CUDA Python code. PyPI's nvidia-* wheels must stay: torch's own
# libraries link them.
TORCH_SKIP_DEPS = ("triton", "cuda-bindings")
# pip download's --platform takes exact tags: every manylinux tag the base (glibc 2.36) runs.
BASE_PLATFORMS = (*(f"--platform=manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
                  *(f"--platform=manylinux{legacy}_x86_64" for legacy in ("2014", "2010", "1")))
# Archives kept per image: the newest only (a trainer archive is ~5 GB, and disks here are shared).
KEEP_ARCHIVES = 1
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
    planned = {n: _plan(n, repo, None if n == "base" else base_image).image
               for n in names if n != "torch"}
    if "torch" in names:
        planned["torch"] = _torch_plan(_plan("trainer", repo, base_image).image).image
    return {n: planned[n] for n in names}


def _ensure(name: str, repo: Path, done: dict[str, Image]) -> Image:
    if name in done:
        return done[name]
    if name == "torch":
        plan = _torch_plan(_ensure("trainer", repo, done))
    else:
        base_image = None if name in ("pause", "base") else _ensure("base", repo, done)
        plan = _plan(name, repo, base_image)
    image = plan.image
    if not image.archive.exists():
        with locked(name):
            if not image.archive.exists():
                _build(plan)
    done[name] = image
    return image


# The Debian packages each build runs (package -> program), installed when missing: a fresh
# machine has gcc, but not buildah or debootstrap.
BUILD_TOOLS: dict[str, dict[str, str]] = {
    "pause": {"gcc": "gcc", "libc6-dev": "/usr/lib/x86_64-linux-gnu/libc.a"},
    "base": {"debootstrap": "/usr/sbin/debootstrap"},
    "operator": {"buildah": "buildah"},
    "trainer": {"buildah": "buildah"},
}


def _build(plan: _Plan) -> None:
    image = plan.image
    try:
        ensure_packages(BUILD_TOOLS.get(image.name, {}), why=f"building the {image.name} image")
    except PackageError as err:
        raise BuildError(str(err)) from err
    log_file = images_dir() / "logs" / f"{image.name}-{image.input_hash[:12]}.log"
    log(f"building {image.ref} (log: {log_file})")
    start = time.monotonic()
    plan.build(image.archive, log_file)
    seconds = time.monotonic() - start
    record_time(image.name, image.input_hash, seconds)
    size = image.archive.stat().st_size / 2**20
    log(f"built {image.ref} in {seconds:.0f} s: {image.archive} ({size:.0f} MiB)")
    prune_archives(image.name)


def prune_archives(name: str, *, keep: int = KEEP_ARCHIVES) -> None:
    """Deletes all but the `keep` newest archives of an image (a trainer archive is ~5 GB)."""
    archives = []
    for path in images_dir().glob(f"{name}-*.tar"):
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile by another builder
            archives.append((path.stat().st_mtime, path))
    for _, old in sorted(archives)[:-keep]:
        log(f"removing the old archive {old}")
        old.unlink(missing_ok=True)


def _plan(name: str, repo: Path, base_image: Image | None) -> _Plan:
    paths: tuple[str, ...]
    if name == "pause":
        paths = ("hack/images/pause.c", "hack/images/pause.py", "hack/images/archive.py")
        return _make_plan(name, repo, paths, pause.build_args(),
                          lambda dest, lg, ref: pause.build_pause(dest, ref=ref, log_file=lg))
    if name == "base":
        paths = ("hack/images/base.py",)
        return _make_plan(name, repo, paths, base.build_args(),
                          lambda dest, lg, ref: base.build_base(dest, ref=ref, log_file=lg))
    assert base_image is not None, f"{name} builds on the base image"
    build = operator_build(base_image) if name == "operator" else trainer_build(base_image)
    paths = (build.dockerfile, *build.context)
    args = {**build.args, "BASE_INPUT_HASH": base_image.input_hash}

    def run_build(dest: Path, log_file: Path, ref: str) -> None:
        assert base_image is not None
        load_archive(base_image.archive, base_image.ref, log_file=log_file)
        if name == "trainer":
            ensure_wheelhouse(log_file=log_file)
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
            "TORCH_SKIP_DEPS": " ".join(TORCH_SKIP_DEPS),
            "PIP_FIND_LINKS": WHEELS_IN_BUILD,
        },
        volumes=(f"{wheelhouse_dir()}:{WHEELS_IN_BUILD}:ro",),
    )


# The last instruction of trainer_image/Dockerfile's `torch` stage, as buildah records it in the
# image history: the torch image is the trainer's layers up to there.
TORCH_STAGE_END = "ENV PATH=/opt/venv/bin:$PATH"
# A stock image's runtime config: root, torch's venv first on PATH, unbuffered output.
TORCH_CONFIG = {"Env": ["PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                        "/sbin:/bin", "LANG=C.UTF-8", "PYTHONUNBUFFERED=1"],
                "Cmd": ["python3"], "WorkingDir": "/"}


def _torch_plan(trainer: Image) -> _Plan:
    digest = hashlib.sha256(json.dumps(
        {"trainer": trainer.input_hash, "end": TORCH_STAGE_END, "config": TORCH_CONFIG,
         "archive.py": (REPO / "hack/images/archive.py").read_text()},
        sort_keys=True).encode()).hexdigest()
    ref = f"elastrain/torch:{digest[:12]}"
    image = Image("torch", ref, images_dir() / f"torch-{digest[:12]}.tar", digest)

    def build(dest: Path, log_file: Path) -> None:
        write_lower_archive(trainer.archive, dest, ref=ref, history_end=TORCH_STAGE_END,
                            config=TORCH_CONFIG)

    return _Plan(image, build)


def torch_version() -> str:
    """TORCH_VERSION, or the environment variable of that name."""
    return os.environ.get("TORCH_VERSION") or TORCH_VERSION


def wheelhouse_dir() -> Path:
    return cache_root() / "wheels" / f"torch-{torch_version()}-cp311"


def ensure_wheelhouse(*, log_file: Path) -> Path:
    """$ELASTRAIN_CACHE/wheels/torch-<version>-cp311: the pinned torch wheel (CPython 3.11,
    manylinux x86_64) and every requirement the trainer build installs from it (all of torch's
    but TORCH_SKIP_DEPS), downloaded from PyPI once; `.complete` marks a finished set."""
    wheels = wheelhouse_dir()
    done = wheels / ".complete"
    wanted = " ".join(TORCH_SKIP_DEPS)
    with locked("wheels"):
        if done.exists() and done.read_text() == wanted:
            return wheels
        wheels.mkdir(parents=True, exist_ok=True)
        pip = [_pip_python(), "-m", "pip", "download", "--only-binary=:all:", "--progress-bar",
               "off", "--python-version", "3.11", *BASE_PLATFORMS, "-d", str(wheels)]
        run([*pip, "--no-deps", f"torch=={torch_version()}"], log_file=log_file)
        (wheel,) = wheels.glob(f"torch-{torch_version()}-*.whl")
        requirements = wheels / ".requirements.txt"
        requirements.write_text("".join(f"{r}\n" for r in torch_requirements(wheel)))
        run([*pip, "-r", str(requirements)], log_file=log_file)
        done.write_text(wanted)
    return wheels


def torch_requirements(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a torch wheel, minus extras and TORCH_SKIP_DEPS."""
    with zipfile.ZipFile(wheel) as whl:
        (metadata,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        lines = whl.read(metadata).decode().splitlines()
    kept = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.removeprefix("Requires-Dist:").strip()
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        if "extra ==" in requirement or name is None:
            continue
        if not any(fnmatch.fnmatch(name.group().lower(), g) for g in TORCH_SKIP_DEPS):
            kept.append(requirement)
    return kept


def _pip_python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable
