"""OCI image layouts through umoci (Debian's package): a new image, unpacked into a bundle; a layer for each tree
copied into the bundle's root file system (umoci repack: what changed since the last layer); the config; then the
manifest's digest and size, read from the layout's index.

Layers come from `umoci repack`, not `umoci insert`: bookworm's umoci (0.4.7) leaves insert's tar stream without its
end-of-archive blocks (umoci#436, fixed in 0.4.8), which GNU tar and Python's tarfile refuse."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ImageConfig(BaseModel):
    """The runtime part of an OCI image config that Tidal sets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    user: str
    workdir: str
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)


def _umoci(*args: str) -> None:
    subprocess.run(["umoci", *args], check=True)


def new_image(layout: Path, tag: str) -> str:
    """An empty image at layout:tag (the layout is created, a previous image of that tag replaced)."""
    if not (layout / "index.json").exists():
        shutil.rmtree(layout, ignore_errors=True)
        layout.parent.mkdir(parents=True, exist_ok=True)
        _umoci("init", "--layout", str(layout))
    ref = f"{layout}:{tag}"
    subprocess.run(["umoci", "rm", "--image", ref], check=False, capture_output=True)
    _umoci("new", "--image", ref)
    return ref


def unpack(ref: str, bundle: Path) -> Path:
    """The image's runtime bundle; returns its root file system, where the next layer's files are copied."""
    _umoci("unpack", "--image", ref, str(bundle))
    return bundle / "rootfs"


def add_tree(rootfs: Path, tree: Path) -> None:
    """Copy `tree` over the bundle's root file system as hard links (no data copied; the files are only read)."""
    subprocess.run(["cp", "-a", "--link", f"{tree}/.", str(rootfs)], check=True)


def commit_layer(ref: str, bundle: Path, created: str, created_by: str) -> None:
    """One layer holding what changed in the bundle since the last one, owners and modes kept."""
    history = ["--history.created", created, "--history.created_by", created_by]
    _umoci("repack", "--refresh-bundle", *history, "--image", ref, str(bundle))


def configure(ref: str, config: ImageConfig, created: str) -> None:
    args = ["config", "--image", ref, "--created", created, "--os", "linux", "--architecture", "amd64"]
    args += ["--config.user", config.user, "--config.workingdir", config.workdir, "--no-history"]
    args += [arg for item in config.entrypoint for arg in ("--config.entrypoint", item)]
    args += [arg for item in config.cmd for arg in ("--config.cmd", item)]
    args += [arg for key, value in config.env.items() for arg in ("--config.env", f"{key}={value}")]
    args += [arg for key, value in config.labels.items() for arg in ("--config.label", f"{key}={value}")]
    _umoci(*args)


def collect_garbage(layout: Path) -> None:
    _umoci("gc", "--layout", str(layout))


def _blob(layout: Path, digest: str) -> Path:
    algorithm, hex_digest = digest.split(":", 1)
    return layout / "blobs" / algorithm / hex_digest


def manifest_digest(layout: Path, tag: str) -> str:
    index = json.loads((layout / "index.json").read_text())
    for entry in index["manifests"]:
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            return str(entry["digest"])
    raise SystemExit(f"{layout}: no image tagged {tag}")


def read_manifest(layout: Path, tag: str) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads(_blob(layout, manifest_digest(layout, tag)).read_text())
    return manifest


def read_config(layout: Path, tag: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(_blob(layout, read_manifest(layout, tag)["config"]["digest"]).read_text())
    return config


def compressed_size(layout: Path, tag: str) -> int:
    """Bytes a registry stores and a node pulls: the layers and the config, as compressed."""
    manifest = read_manifest(layout, tag)
    return sum(int(layer["size"]) for layer in manifest["layers"]) + int(manifest["config"]["size"])
