"""setup.py's TOP_LEVEL_FOLDERS (import name -> folder), read without running setup(): the one written mapping,
for the tools and tests that need it (hack/typecheck.py, tests/unit/test_import_graph.py)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def read_folder_mapping() -> dict[str, str]:
    """TOP_LEVEL_FOLDERS from setup.py, read without running setup()."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "TOP_LEVEL_FOLDERS" for target in node.targets
        ):
            mapping = ast.literal_eval(node.value)
            if isinstance(mapping, dict):
                return {str(name): str(folder) for name, folder in mapping.items()}
    raise SystemExit("setup.py: no TOP_LEVEL_FOLDERS dict literal")
