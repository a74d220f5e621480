"""The import layout: top-level folders map to `tidal.*` and never shadow the standard library."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAPPED = {
    "tidal.operator": "operator",
    "tidal.worker": "worker",
    "tidal.kernels": "kernels",
    "tidal.devcluster": "devcluster",
    "tidal.contract": "contract",
}


def _run_python(code: str, cwd: Path, *flags: str) -> str:
    result = subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True, check=True, timeout=120
    )
    return result.stdout.strip()


@pytest.mark.parametrize("flags", [(), ("-S",)], ids=["default", "no-site"])
def test_stdlib_operator_is_not_shadowed_from_repo_root(flags):
    # -S skips `site`, which otherwise imports `operator` before the working directory is searched.
    path = _run_python("import operator; print(operator.__file__)", REPO, *flags)
    assert Path(path).parent != REPO / "operator"
    assert Path(path).name == "operator.py" and "site-packages" not in path


def test_top_level_folders_have_no_init_file():
    for folder in MAPPED.values():
        assert not (REPO / folder / "__init__.py").exists(), f"{folder}/__init__.py would shadow imports from the root"


def test_editable_install_maps_folders_to_tidal_packages(tmp_path):
    code = "import importlib\n" + "".join(
        f"m = importlib.import_module({name!r}); print(list(m.__path__)[0])\n" for name in MAPPED
    )
    printed = _run_python(code, tmp_path).splitlines()
    assert [Path(p) for p in printed] == [REPO / folder for folder in MAPPED.values()]


@pytest.mark.slow
def test_built_wheel_contains_and_imports_tidal_packages(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("tidal-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for folder in ("operator", "worker", "kernels", "devcluster", "contract"):
        assert any(n.startswith(f"tidal/{folder}/") for n in names), f"wheel lacks tidal/{folder}/"
    assert not any(n.startswith(("operator/", "worker/", "tests/")) for n in names)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    # Isolated mode (-I) ignores the editable install's path hooks, so only the wheel's files can answer.
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r}); import importlib\n"
        f"for n in {list(MAPPED)!r}: print(list(importlib.import_module(n).__path__)[0])\n"
    )
    printed = _run_python(code, tmp_path, "-I").splitlines()
    assert [Path(p) for p in printed] == [target / "tidal" / folder for folder in MAPPED.values()]
