"""Dockerfile builds with buildah (no Docker engine, no registry): buildah's own storage lives in
$ELASTRAIN_CACHE/buildah (never the machine's /var/lib/containers), the base comes from its
docker-archive, every build uses `--layers` (so the torch layer survives a trainer source edit),
and the result leaves as a docker-archive through `buildah push`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hack.images.cache import BuildError, cache_root, capture, run
from hack.images.inputs import stage_context

# Downloads inside a build (pip) must trust the host's certificate authorities.
HOST_CERTS = "/etc/ssl/certs"


@dataclass(frozen=True)
class DockerfileBuild:
    """One `buildah bud` of a Dockerfile from the repository."""

    dockerfile: str  # relative to the repository root, which is the build context
    context: tuple[str, ...]  # repository paths copied into the context (tracked files only)
    args: Mapping[str, str]  # --build-arg values
    volumes: tuple[str, ...] = field(default=())  # extra -v SRC:DST[:ro] for RUN steps


def buildah_argv(*args: str) -> list[str]:
    root = cache_root() / "buildah"
    return ["buildah", "--root", str(root / "storage"), "--runroot", str(root / "run"), *args]


def has_image(name: str) -> bool:
    proc = subprocess.run(buildah_argv("inspect", "--type", "image", name),
                          capture_output=True, check=False)
    return proc.returncode == 0


def local_name(ref: str) -> str:
    """The name a loaded archive gets in buildah's storage (short names land in localhost/)."""
    return f"localhost/{ref}"


def built_name(ref: str) -> str:
    """The name a built image gets: ref normalised as containerd and the CRI normalise it, so the
    pushed archive's RepoTags holds that one name (buildah adds the image's own names)."""
    return f"docker.io/{ref}"


def load_archive(archive: Path, ref: str, *, log_file: Path) -> str:
    """Makes the image of a docker-archive available to `FROM` as local_name(ref); returns it."""
    name = local_name(ref)
    if not has_image(name):
        # buildah 1.28 names a short RepoTag localhost/<ref> itself; the tag makes sure of it.
        image_id = capture(buildah_argv("pull", "--quiet", f"docker-archive:{archive}"))
        run(buildah_argv("tag", image_id.splitlines()[-1], name), log_file=log_file)
    return name


def build_dockerfile(build: DockerfileBuild, dest: Path, *, repo: Path, ref: str,
                     log_file: Path) -> None:
    """Builds from a context holding only the tracked files of build.context, then writes the
    image to dest as a docker-archive tagged ref (atomically)."""
    with tempfile.TemporaryDirectory(prefix="elastrain-context-") as ctx:
        stage_context(repo, [build.dockerfile, *build.context], Path(ctx))
        argv = buildah_argv("bud", "--isolation", "chroot", "--layers", "--pull=false",
                            "-v", f"{HOST_CERTS}:{HOST_CERTS}:ro",
                            "-f", str(Path(ctx) / build.dockerfile), "-t", built_name(ref))
        argv += _flags("--build-arg", [f"{k}={v}" for k, v in sorted(build.args.items())])
        argv += _flags("-v", build.volumes)
        run([*argv, ctx], log_file=log_file)
    partial = dest.with_name(f".{dest.name}.partial")
    partial.unlink(missing_ok=True)
    run(buildah_argv("push", "--quiet", built_name(ref), f"docker-archive:{partial}:{ref}"),
        log_file=log_file)
    os.replace(partial, dest)
    # The archive is the cache; --layers' intermediate images keep the build cache. Untagging
    # is tidying only: a working container an interrupted earlier build left (a full disk) holds
    # a layer, and rmi then fails although the archive is complete; that failed a whole e2e run
    # once (30 errors, the image written).
    try:
        run(buildah_argv("rmi", built_name(ref)), log_file=log_file)
    except BuildError as e:
        with log_file.open("a") as out:
            out.write(f"(not removed, the archive is written: {str(e).splitlines()[0]})\n")


def _flags(flag: str, values: Sequence[str]) -> list[str]:
    return [part for value in values for part in (flag, value)]
