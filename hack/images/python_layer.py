"""An image's Python layer: tidal's wheel with one extra and its dependencies from PyPI (hack/constraints.txt's
versions) under the image's site-packages, a launcher per console script, bytecode compiled for the image."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from spec import CONSTRAINTS, PYTHON_MINOR, REPO_ROOT, SITE_PACKAGES, project_scripts

LAUNCHER = """#!/usr/bin/python3
import sys

from {module} import {function}

sys.exit({function}())
"""


def check_host_python() -> None:
    """Wheels are chosen by the host's pip for its interpreter: it must be the image's minor version."""
    host = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if host != PYTHON_MINOR:
        raise SystemExit(f"images are built with Python {PYTHON_MINOR} (the image's python3); this is {host}")


def build_wheel(out: Path) -> Path:
    """tidal's own wheel from the working tree, built with the environment's setuptools (no download)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=REPO_ROOT,
        check=True,
    )
    (wheel,) = out.glob("tidal-*.whl")
    return wheel


def _write_launchers(stage: Path) -> None:
    bin_dir = stage / "usr/local/bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, target in project_scripts().items():
        module, function = target.split(":")
        launcher = bin_dir / name
        launcher.write_text(LAUNCHER.format(module=module, function=function))
        launcher.chmod(0o755)


def _forget_wheel_location(site: Path) -> None:
    """tidal's direct_url.json names the temporary path its wheel was built in: meaningless in the image, and
    different on every build (so is its line in RECORD)."""
    for dist_info in site.glob("tidal-*.dist-info"):
        (dist_info / "direct_url.json").unlink(missing_ok=True)
        record = dist_info / "RECORD"
        kept = [line for line in record.read_text().splitlines() if not line.startswith(f"{dist_info.name}/direct_url")]
        record.write_text("\n".join(kept) + "\n")


def install(stage: Path, extra: str) -> dict[str, str]:
    """Install tidal[extra] into `stage` (laid out as the image's root); returns distribution -> version."""
    check_host_python()
    site = stage / SITE_PACKAGES.lstrip("/")
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp))
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-warn-script-location"]
        # Binary wheels only: nothing is compiled against the host's Python; --no-compile: bytecode comes below.
        pip += ["--only-binary=:all:", "--no-compile", "--target", str(site), "-c", str(CONSTRAINTS)]
        subprocess.run([*pip, f"tidal[{extra}] @ {wheel.as_uri()}"], check=True)
    # pip's scripts start with the host interpreter's path; the image gets its own launchers instead.
    subprocess.run(["rm", "-rf", str(site / "bin")], check=True)
    _forget_wheel_location(site)
    _write_launchers(stage)
    # The root file system may be read-only (the chart's operator): bytecode is written now, keyed by the source's
    # hash rather than its mtime. A few packages ship files that do not compile (templates, tests); those are only
    # ever read as data, so compileall's exit status is not checked.
    compileall = [sys.executable, "-m", "compileall", "-qq", "-j", "0", "--invalidation-mode", "unchecked-hash"]
    subprocess.run([*compileall, "-s", str(stage), "-p", "/", str(site)], check=False)
    return {dist.metadata["Name"]: dist.version for dist in metadata.distributions(path=[str(site)])}
