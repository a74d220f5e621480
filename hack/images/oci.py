"""OCI image layouts through umoci (Debian's package): a new image, one layer per root directory inserted, its
config; then the manifest's digest and size, read from the layout's index."""

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


def add_layer(ref: str, root: Path, created: str, created_by: str) -> None:
    """One layer holding `root`'s tree at /, owners and modes kept."""
    _umoci("insert", "--image", ref, "--history.created", created, "--history.created_by", created_by, str(root), "/")


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
