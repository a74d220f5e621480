"""An image's declarative description (images/*.yaml) and the facts every image shares, validated with pydantic."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGES_DIR = REPO_ROOT / "images"
CONSTRAINTS = REPO_ROOT / "hack" / "constraints.txt"

# The image's python3 (Debian bookworm: 3.11) must be the host's minor version: wheels are chosen and bytecode is
# compiled on the host, for the image's interpreter.
DEBIAN_SUITE = "bookworm"
PYTHON_MINOR = "3.11"
# The pods run as this user (the chart's runAsUser); it owns nothing in the image except its home.
USER_NAME = "tidal"
USER_ID = 65532
HOME = f"/home/{USER_NAME}"
SITE_PACKAGES = f"/usr/local/lib/python{PYTHON_MINOR}/dist-packages"
SOURCE_URL = "https://github.com/tidal-dev/tidal"
LICENSE = "Apache-2.0"


class ImageSpec(BaseModel):
    """One image: a Debian base with `debian_packages`, then tidal with one extra from PyPI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    repository: str = Field(min_length=1, description="Default registry path; the chart's values name it")
    description: str = Field(min_length=1)
    extra: str = Field(min_length=1, description="pyproject.toml optional-dependency group to install")
    debian_packages: list[str] = Field(min_length=1, description="Installed on top of debootstrap's minbase")
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)


def project_version() -> str:
    """The one version: pyproject.toml's, which is also the chart's appVersion and the images' tag."""
    with (REPO_ROOT / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def project_scripts() -> dict[str, str]:
    """Console scripts (name -> "module:function"); the images get a launcher for each."""
    with (REPO_ROOT / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def load_spec(name: str) -> ImageSpec:
    path = IMAGES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in IMAGES_DIR.glob("*.yaml")))
        raise SystemExit(f"no image description {path} (known: {known})")
    spec = ImageSpec.model_validate(yaml.safe_load(path.read_text()))
    if spec.name != name:
        raise SystemExit(f"{path}: name {spec.name!r} must match the file name")
    return spec


def all_image_names() -> list[str]:
    return sorted(p.stem for p in IMAGES_DIR.glob("*.yaml"))
