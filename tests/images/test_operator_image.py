"""The operator image, built as `make images` builds it, then unpacked (umoci) and run: its OCI config (entrypoint,
user, labels), its package manifest, and `python -m tidal.operator --help` and the operator's imports inside it as
the non-root user. It runs under crun where the machine's cgroups allow a container, else chrooted (as root)."""

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import build_images
import oci
import pytest
import spec

pytestmark = pytest.mark.slow

NAME = "tidal-operator"
# The chart runs it with this user (runAsUser) and command.
USER = "65532:65532"
ENTRYPOINT = ["python", "-m", "tidal.operator"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> build_images.BuiltImage:
    if os.geteuid() != 0:
        pytest.skip("building an image's Debian base needs root (debootstrap, chroot)")
    return build_images.build_image(spec.load_spec(NAME), tmp_path_factory.mktemp("oci"))


@pytest.fixture(scope="module")
def bundle(built: build_images.BuiltImage, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bundle") / "operator"
    subprocess.run(["umoci", "unpack", "--image", f"{built.layout}:{built.tag}", str(path)], check=True)
    return path


def _crun_works(bundle: Path) -> bool:
    """Whether crun can start a container here (it cannot where the host's cgroups are in hybrid mode)."""
    config = json.loads((bundle / "config.json").read_text())
    config["process"].update(args=["/bin/true"], terminal=False)
    probe = bundle.parent / "probe"
    probe.mkdir(exist_ok=True)
    (probe / "config.json").write_text(json.dumps({**config, "root": {"path": str(bundle / "rootfs")}}))
    result = subprocess.run(["crun", "run", "--bundle", str(probe), "tidal-image-probe"], capture_output=True)
    subprocess.run(["crun", "delete", "--force", "tidal-image-probe"], capture_output=True)
    return result.returncode == 0


def run_in_image(bundle: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `args` in the unpacked image as its configured user, with its environment."""
    config = json.loads((bundle / "config.json").read_text())
    process = config["process"]
    if _crun_works(bundle):
        process.update(args=args, terminal=False)
        config["root"]["readonly"] = True  # as the chart runs it
        (bundle / "config.json").write_text(json.dumps(config))
        command = ["crun", "run", "--bundle", str(bundle), f"tidal-test-{os.getpid()}"]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)
    user = f"{process['user']['uid']}:{process['user']['gid']}"
    env = dict(item.split("=", 1) for item in process["env"])
    chroot = shutil.which("chroot", path="/usr/sbin:/usr/bin") or "chroot"
    command = [chroot, f"--userspec={user}", str(bundle / "rootfs"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def test_config_runs_the_operator_as_the_charts_user(built):
    config = oci.read_config(built.layout, built.tag)["config"]
    assert config["Entrypoint"] == ENTRYPOINT
    assert config["User"] == USER
    assert config["WorkingDir"] == spec.HOME
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == built.tag == spec.project_version()
    assert labels["org.opencontainers.image.title"] == NAME
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert len(labels["org.opencontainers.image.revision"]) == 40


def test_layers_are_complete_tar_archives(built):
    # Registries and scanners read layers with GNU tar or tarfile, which refuse a stream without its end blocks.
    layers = oci.read_manifest(built.layout, built.tag)["layers"]
    assert len(layers) == 2
    names = []
    for layer in layers:
        algorithm, digest = layer["digest"].split(":")
        with tarfile.open(built.layout / "blobs" / algorithm / digest) as archive:
            names.append(archive.getnames())
    assert "usr/bin/python3" in names[0]
    assert build_images.MANIFEST_PATH in names[1] and "usr/bin/python3" not in names[1]


def test_image_is_small(built):
    # Debian's minbase with python3 is ~45 MB compressed; the kubernetes client is most of the rest.
    assert built.size_bytes < 100_000_000, built.size_bytes


def test_manifest_records_pinned_versions_and_no_torch(bundle):
    manifest = json.loads((bundle / "rootfs" / build_images.MANIFEST_PATH).read_text())
    pins = dict(line.split("==") for line in spec.CONSTRAINTS.read_text().split() if "==" in line)
    assert manifest["python"]["kopf"] == pins["kopf"]
    assert manifest["python"]["kubernetes"] == pins["kubernetes"]
    assert "torch" not in manifest["python"]
    assert manifest["debian"]["python3"].startswith("3.11")


def test_help_runs_in_the_image(bundle):
    result = run_in_image(bundle, [*ENTRYPOINT, "--help"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m tidal.operator")
    assert "TIDAL_OPERATOR_NAMESPACE" in result.stdout


def test_operator_imports_without_torch_as_non_root(bundle):
    code = (
        "import os, importlib.util, kopf, kubernetes, tidal.operator.__main__, tidal.operator.main; "
        "print(os.getuid(), os.getgid(), importlib.util.find_spec('torch') is None)"
    )
    result = run_in_image(bundle, ["python", "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["65532", "65532", "True"]
