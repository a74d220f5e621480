"""Build Tidal's images (images/*.yaml) as OCI image layouts, without a registry, and print their digests.

    python hack/images/build_images.py [NAME ...] [--out DIR]     # default: every image, into $TIDAL_CACHE/images/oci

Each image is two layers: the Debian base (rootfs.py, cached by its inputs) and the Python layer (python_layer.py),
plus /usr/share/tidal/image-manifest.json, which records every Debian and Python package's version. Timestamps
come from the last commit, so a rebuild from the same commit and cached base gives the same digest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import oci
import python_layer
import rootfs
from pydantic import BaseModel, ConfigDict
from spec import (
    DEBIAN_SUITE,
    HOME,
    LICENSE,
    REPO_ROOT,
    SOURCE_URL,
    USER_ID,
    ImageSpec,
    all_image_names,
    load_spec,
    project_version,
)

MANIFEST_PATH = "usr/share/tidal/image-manifest.json"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class BuiltImage(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    reference: str  # where the chart expects it, e.g. ghcr.io/tidal-dev/tidal-operator:0.1.0
    layout: Path
    tag: str
    digest: str
    size_bytes: int


def cache_dir() -> Path:
    return Path(os.environ.get("TIDAL_CACHE", Path.home() / ".cache/tidal")) / "images"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, check=True, capture_output=True, text=True).stdout.strip()


def source_epoch() -> int:
    """SOURCE_DATE_EPOCH when set (the reproducible-builds convention), else the last commit's time."""
    return int(os.environ.get("SOURCE_DATE_EPOCH") or _git("log", "-1", "--format=%ct"))


def _clamp_mtimes(root: Path, epoch: int) -> None:
    for path in [root, *root.rglob("*")]:
        os.utime(path, (epoch, epoch), follow_symlinks=False)


def labels(spec: ImageSpec, version: str, revision: str, created: str) -> dict[str, str]:
    return {
        "org.opencontainers.image.title": spec.name,
        "org.opencontainers.image.description": spec.description,
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.source": SOURCE_URL,
        "org.opencontainers.image.licenses": LICENSE,
        "org.opencontainers.image.base.name": f"debian:{DEBIAN_SUITE} (debootstrap --variant=minbase)",
        "dev.tidal.image.manifest": "/" + MANIFEST_PATH,
    }


def build_image(spec: ImageSpec, out: Path) -> BuiltImage:
    version, revision, epoch = project_version(), _git("rev-parse", "HEAD"), source_epoch()
    created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cache = cache_dir()
    base = rootfs.ensure_base(cache, spec.debian_packages)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f"build-{spec.name}-") as tmp:
        stage = Path(tmp) / "stage"
        stage.mkdir(mode=0o755)  # it becomes the image's / in its layer
        print(f"{spec.name}: installing tidal[{spec.extra}] from PyPI", flush=True)
        python = python_layer.install(stage, spec.extra)
        manifest = {
            "image": spec.name,
            "version": version,
            "revision": revision,
            "debian": rootfs.debian_packages(base),
            "python": dict(sorted(python.items(), key=lambda item: item[0].lower())),
        }
        (stage / MANIFEST_PATH).parent.mkdir(parents=True, exist_ok=True)
        (stage / MANIFEST_PATH).write_text(json.dumps(manifest, indent=2) + "\n")
        _clamp_mtimes(stage, epoch)
        layout = out / spec.name
        ref = oci.new_image(layout, version)
        print(f"{spec.name}: assembling {ref}", flush=True)
        bundle = Path(tmp) / "bundle"
        image_root = oci.unpack(ref, bundle)
        packages = ",".join(spec.debian_packages)
        oci.add_tree(image_root, base)
        oci.commit_layer(ref, bundle, created, f"debootstrap --variant=minbase --include={packages} {DEBIAN_SUITE}")
        oci.add_tree(image_root, stage)
        oci.commit_layer(ref, bundle, created, f"pip install tidal[{spec.extra}] -c hack/constraints.txt")
    config = oci.ImageConfig(
        user=f"{USER_ID}:{USER_ID}",
        workdir=HOME,
        entrypoint=spec.entrypoint,
        cmd=spec.cmd,
        env={"PATH": PATH, "HOME": HOME, "PYTHONUNBUFFERED": "1", **spec.env},
        labels=labels(spec, version, revision, created),
    )
    oci.configure(ref, config, created)
    oci.collect_garbage(layout)
    (out / f"{spec.name}.manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return BuiltImage(
        name=spec.name,
        reference=f"{spec.repository}:{version}",
        layout=layout,
        tag=version,
        digest=oci.manifest_digest(layout, version),
        size_bytes=oci.compressed_size(layout, version),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"images to build (default: all of {all_image_names()})")
    parser.add_argument("--out", type=Path, default=cache_dir() / "oci", help="directory of the OCI layouts")
    args = parser.parse_args()
    built = [build_image(load_spec(name), args.out) for name in args.names or all_image_names()]
    for image in built:
        size = f"{image.size_bytes / 1e6:.0f} MB"
        print(f"{image.reference}  oci:{image.layout}:{image.tag}  {image.digest}  ({size} compressed)")


if __name__ == "__main__":
    main()
