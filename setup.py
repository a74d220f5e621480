"""Package mapping for the top-level folders.

The repository keeps the design card's layout (operator/, worker/, kernels/, devcluster/ at the top) while the
import names live under `tidal.` so that nothing shadows the standard library's `operator` module. The top-level
folders carry no `__init__.py` for the same reason: run from the repository root, `import operator` still finds
the standard library. Subpackages are discovered here, so this file is the one place the mapping is written.
"""

from setuptools import find_namespace_packages, setup

TOP_LEVEL_FOLDERS = {
    "tidal.operator": "operator",
    "tidal.worker": "worker",
    "tidal.kernels": "kernels",
    "tidal.devcluster": "devcluster",
    "tidal.contract": "contract",
}


def discover_packages() -> list[str]:
    packages = []
    for import_name, folder in TOP_LEVEL_FOLDERS.items():
        packages.append(import_name)
        for sub in find_namespace_packages(folder, exclude=["*__pycache__*"]):
            packages.append(f"{import_name}.{sub}")
    return packages


setup(packages=discover_packages(), package_dir=TOP_LEVEL_FOLDERS)
