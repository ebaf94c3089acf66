"""hack/images/archive.write_lower_archive: the torch image is a built image's lower layers, cut at
a history entry, with a config of its own; nothing is rebuilt and the layers stay the same."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hack.images.archive import (  # noqa: E402
    iter_layer_entries,
    read_config,
    read_manifest,
    write_lower_archive,
)

# (created_by, the one file its layer adds or None for an instruction without a layer)
HISTORY = [("debootstrap", "base.txt"), ("ARG X", None), ("RUN pip install torch", "torch.txt"),
           ("ENV PATH=/opt/venv/bin:$PATH", None), ("COPY operator/", "elastrain.txt"),
           ("USER 65532", None)]


def _layer(name: str) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(name)
        tar.addfile(info, io.BytesIO(name.encode()))
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _image(path: Path) -> None:
    layers = [_layer(f) for _, f in HISTORY if f]
    diff_ids = [hashlib.sha256(x).hexdigest() for x in layers]
    config = {"config": {"User": "65532"}, "rootfs": {"type": "layers",
              "diff_ids": [f"sha256:{d}" for d in diff_ids]},
              "history": [{"created_by": c, **({} if f else {"empty_layer": True})}
                          for c, f in HISTORY]}
    with tarfile.open(path, "w") as tar:
        _add(tar, "config.json", json.dumps(config).encode())
        for digest, data in zip(diff_ids, layers, strict=True):
            _add(tar, f"{digest}.tar", data)
        manifest = [{"Config": "config.json", "RepoTags": ["t:1"],
                     "Layers": [f"{d}.tar" for d in diff_ids]}]
        _add(tar, "manifest.json", json.dumps(manifest).encode())


def test_cut_keeps_the_layers_up_to_the_stage_end_with_its_own_config(tmp_path: Path) -> None:
    full, lower = tmp_path / "full.tar", tmp_path / "lower.tar"
    _image(full)
    write_lower_archive(full, lower, ref="elastrain/torch:abc", history_end="ENV PATH=",
                        config={"Cmd": ["python3"]})
    manifest, config = read_manifest(lower), read_config(lower)
    assert manifest["RepoTags"] == ["elastrain/torch:abc"]
    assert manifest["Layers"] == read_manifest(full)["Layers"][:2]
    assert config["rootfs"]["diff_ids"] == read_config(full)["rootfs"]["diff_ids"][:2]
    assert [h["created_by"] for h in config["history"]] == [c for c, _ in HISTORY[:4]]
    assert config["config"] == {"Cmd": ["python3"]}  # root: not the full image's user
    assert sorted(e.name for e in iter_layer_entries(lower)) == ["base.txt", "torch.txt"]


def test_a_missing_stage_end_is_refused(tmp_path: Path) -> None:
    _image(tmp_path / "full.tar")
    with pytest.raises(ValueError, match="no history entry contains 'FROM nowhere'"):
        write_lower_archive(tmp_path / "full.tar", tmp_path / "x.tar", ref="x:1",
                            history_end="FROM nowhere", config={})
    assert not (tmp_path / "x.tar").exists()
