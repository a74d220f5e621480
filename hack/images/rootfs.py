"""The Debian base of an image: debootstrap --variant=minbase plus the image's packages, security updates applied,
the non-root user added; built once per set of inputs and kept under $TIDAL_CACHE/images (root only: debootstrap
and chroot need it)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from spec import DEBIAN_SUITE, HOME, USER_ID, USER_NAME

# The machine's own Debian mirror (deb.debian.org redirects to a near one); TIDAL_DEBIAN_MIRROR overrides it.
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SECURITY_MIRROR = "http://deb.debian.org/debian-security"
# What an image never needs at run time; each package's copyright file stays (licence notices).
PRUNED = ("var/cache/apt", "var/lib/apt/lists", "var/log", "usr/share/man", "usr/share/info", "usr/share/locale")


def mirror() -> str:
    return os.environ.get("TIDAL_DEBIAN_MIRROR", DEFAULT_MIRROR)


def base_key(packages: list[str]) -> str:
    """Everything the base depends on; the Debian archive moves on, so `make clean-cache` refreshes it."""
    inputs = {"suite": DEBIAN_SUITE, "mirror": mirror(), "packages": sorted(packages), "user": [USER_NAME, USER_ID]}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def _run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def _chroot(rootfs: Path, *args: str) -> None:
    """Run a command in the root file system; its output (apt's and debconf's chatter) is shown only on failure."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
    result = subprocess.run(["chroot", str(rootfs), *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"chroot {rootfs} {' '.join(args)} failed:\n{result.stdout}{result.stderr}")


def _apply_updates(rootfs: Path) -> None:
    """debootstrap installs the release as it was; the point and security updates come through apt."""
    (rootfs / "etc/apt/sources.list").write_text(
        f"deb {mirror()} {DEBIAN_SUITE} main\n"
        f"deb {mirror()} {DEBIAN_SUITE}-updates main\n"
        f"deb {SECURITY_MIRROR} {DEBIAN_SUITE}-security main\n"
    )
    _chroot(rootfs, "apt-get", "-q", "update")
    _chroot(rootfs, "apt-get", "-q", "-y", "--no-install-recommends", "upgrade")
    _chroot(rootfs, "apt-get", "clean")


def _add_user(rootfs: Path) -> None:
    with (rootfs / "etc/passwd").open("a") as f:
        f.write(f"{USER_NAME}:x:{USER_ID}:{USER_ID}:Tidal:{HOME}:/usr/sbin/nologin\n")
    with (rootfs / "etc/group").open("a") as f:
        f.write(f"{USER_NAME}:x:{USER_ID}:\n")
    home = rootfs / HOME.lstrip("/")
    home.mkdir(mode=0o755, parents=True)
    os.chown(home, USER_ID, USER_ID)


def _prune(rootfs: Path) -> None:
    for rel in PRUNED:
        target = rootfs / rel
        if target.is_dir():
            shutil.rmtree(target)
            target.mkdir(mode=0o755)
    for doc in (rootfs / "usr/share/doc").glob("*/*"):
        if doc.name != "copyright":
            shutil.rmtree(doc) if doc.is_dir() and not doc.is_symlink() else doc.unlink()
    # debootstrap copies the build machine's name and resolver; the container runtime provides both.
    for rel in ("etc/hostname", "etc/resolv.conf"):
        (rootfs / rel).unlink(missing_ok=True)


def debian_packages(rootfs: Path) -> dict[str, str]:
    """Installed package -> version, from the root file system's dpkg database."""
    out = _run("dpkg-query", f"--admindir={rootfs}/var/lib/dpkg", "-W", "-f", "${Package}\t${Version}\n")
    return dict(line.split("\t", 1) for line in out.splitlines() if line)


def ensure_base(cache: Path, packages: list[str]) -> Path:
    """The cached base root file system for these packages, built when missing."""
    base = cache / f"base-{DEBIAN_SUITE}-{base_key(packages)}"
    if (base / "complete").exists():
        return base / "rootfs"
    if os.geteuid() != 0:
        raise SystemExit("building an image's Debian base needs root (debootstrap, chroot)")
    shutil.rmtree(base, ignore_errors=True)
    rootfs = base / "rootfs"
    rootfs.parent.mkdir(parents=True)
    print(f"debootstrap {DEBIAN_SUITE} (minbase + {', '.join(packages)}) into {rootfs}", flush=True)
    subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", DEBIAN_SUITE, str(rootfs), mirror()],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    _apply_updates(rootfs)
    _add_user(rootfs)
    _prune(rootfs)
    (base / "complete").write_text("")
    return rootfs
