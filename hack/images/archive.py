"""docker-archive tarballs (the `docker save` layout): writing a single-layer image from a directory
tree, and reading an archive back (its config, its layers' entries) for checks and tests.

    manifest.json            [{"Config": "<sha256>.json", "RepoTags": [ref], "Layers": [...]}]
    <sha256>.json            the image config: architecture, os, config (User, Env, Entrypoint),
                             rootfs.diff_ids (sha256 of each uncompressed layer tar)
    <sha256>/layer.tar       a layer, uncompressed

`ctr images import`, `buildah pull docker-archive:` and `docker load` all read it. Standard library
only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# Part of the base image's input hash: raise it when a change here changes what an archive holds
# (the base is not rebuilt on every edit of this file, since every other image builds on it).
LAYOUT_VERSION = "1"
# Paths whose contents a layer never carries: the runtime mounts them (a debootstrap tree may still
# hold device nodes or mount points there).
RUNTIME_DIRS = ("dev", "proc", "sys", "run")


def walk_tree(root: Path) -> Iterator[tuple[Path, str]]:
    """(path, name in the layer) for every entry below root, parents first, sorted, never
    following a symlink: an entry is always written below its real parent directory (GNU tar
    refuses entries below a symlinked directory such as `bin -> usr/bin`)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        here = Path(dirpath)
        rel = here.relative_to(root)
        if rel.parts and rel.parts[0] in RUNTIME_DIRS:
            dirnames.clear()
            continue
        for name in sorted([*dirnames, *filenames]):
            yield here / name, (rel / name).as_posix()


def write_layer(root: Path, out: IO[bytes]) -> str:
    """Writes the tree below root as an uncompressed layer tar to out; returns its sha256 (the
    diff_id). Hard links stay hard links, owners stay numeric, sockets are left out."""
    digest = _HashingWriter(out)
    with tarfile.open(fileobj=digest, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, name in walk_tree(root):
            info = tar.gettarinfo(str(path), arcname=name)
            if info is None:  # a socket
                continue
            info.uname = info.gname = ""
            if info.isreg():
                with path.open("rb") as data:
                    tar.addfile(info, data)
            else:
                tar.addfile(info)
    return digest.hexdigest()


def image_config(diff_ids: Sequence[str], config: Mapping[str, Any], *, created: str,
                 comment: str) -> dict[str, Any]:
    """The image config JSON of a linux/amd64 image with the given layers and runtime config
    (the `config` object: User, Env, Entrypoint, Cmd, WorkingDir, Labels)."""
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": dict(config),
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
        "history": [{"created": created, "created_by": comment} for _ in diff_ids],
    }


def write_archive(dest: Path, *, ref: str, root: Path, config: Mapping[str, Any],
                  created: str, comment: str) -> None:
    """Writes a single-layer docker-archive of the tree below root, tagged ref, to dest
    (atomically: a temporary file beside dest, then a rename)."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
        layer = Path(tmp) / "layer.tar"
        with layer.open("wb") as out:
            diff_id = write_layer(root, out)
        cfg = json.dumps(image_config([diff_id], config, created=created, comment=comment),
                         sort_keys=True).encode()
        cfg_name = f"{hashlib.sha256(cfg).hexdigest()}.json"
        manifest = [{"Config": cfg_name, "RepoTags": [ref], "Layers": [f"{diff_id}/layer.tar"]}]
        partial = Path(tmp) / "archive.tar"
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, cfg_name, cfg)
            tar.add(str(layer), arcname=f"{diff_id}/layer.tar")
            _add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
        os.replace(partial, dest)


def write_lower_archive(src: Path, dest: Path, *, ref: str, history_end: str,
                        config: Mapping[str, Any]) -> None:
    """Writes, tagged ref, the image made of src's layers up to the first history entry whose
    created_by contains history_end (a Dockerfile stage's last instruction), with `config` as
    its runtime config: a lower stage of a multi-stage image, without building it again."""
    manifest, full = read_manifest(src), read_config(src)
    ends = [i for i, h in enumerate(full["history"]) if history_end in h.get("created_by", "")]
    if not ends:
        raise ValueError(f"{src}: no history entry contains {history_end!r}")
    history = full["history"][:ends[0] + 1]
    layers = sum(1 for h in history if not h.get("empty_layer"))
    cfg = json.dumps({**image_config([], config, created=history[-1].get("created", ""),
                                     comment=""),
                      "rootfs": {"type": "layers", "diff_ids": full["rootfs"]["diff_ids"][:layers]},
                      "history": history}, sort_keys=True).encode()
    cfg_name = f"{hashlib.sha256(cfg).hexdigest()}.json"
    kept = manifest["Layers"][:layers]
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
        partial = Path(tmp) / "archive.tar"
        with tarfile.open(src) as source, tarfile.open(partial, "w",
                                                       format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, cfg_name, cfg)
            for name in kept:
                tar.addfile(source.getmember(name), source.extractfile(name))
            _add_bytes(tar, "manifest.json", json.dumps(
                [{"Config": cfg_name, "RepoTags": [ref], "Layers": kept}]).encode())
        os.replace(partial, dest)


# ------------------------------------------------------------------------------------- reading


def read_manifest(archive: Path) -> dict[str, Any]:
    """The one entry of the archive's manifest.json (Config, RepoTags, Layers)."""
    with tarfile.open(archive) as tar:
        entries = json.loads(_read_member(tar, "manifest.json"))
    if len(entries) != 1:
        raise ValueError(f"{archive}: expected one image, found {len(entries)}")
    return dict(entries[0])


def read_config(archive: Path) -> dict[str, Any]:
    """The image config JSON (its `config` key holds User, Env, Entrypoint, ...)."""
    manifest = read_manifest(archive)
    with tarfile.open(archive) as tar:
        return dict(json.loads(_read_member(tar, manifest["Config"])))


def iter_layer_entries(archive: Path) -> Iterator[tarfile.TarInfo]:
    """Every entry of every layer, lowest layer first (whiteouts included, as written)."""
    manifest = read_manifest(archive)
    with tarfile.open(archive) as outer:
        for layer_name in manifest["Layers"]:
            member = outer.extractfile(layer_name)
            if member is None:
                raise ValueError(f"{archive}: layer {layer_name} is not a file")
            with tarfile.open(fileobj=member, mode="r:*") as layer:
                yield from layer


# ------------------------------------------------------------------------------------- helpers


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._hash = hashlib.sha256()
        self._written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._hash.update(view)
        self._out.write(view)
        self._written += len(view)
        return len(view)

    def tell(self) -> int:
        return self._written

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _read_member(tar: tarfile.TarFile, name: str) -> bytes:
    member = tar.extractfile(name)
    if member is None:
        raise ValueError(f"{name} is not a regular file in the archive")
    return member.read()
