"""What the light halves may import: the contract needs only pydantic and the standard library, and the operator
(whose image never installs torch) imports no torch, directly or through the contract."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRACT_MAY_IMPORT = {"pydantic", "tidal"}  # tidal: only tidal.contract itself, checked below


def _module_names(folder: str, package: str) -> list[str]:
    names = []
    for path in sorted((REPO / folder).rglob("*.py")):
        parts = path.relative_to(REPO / folder).with_suffix("").parts
        if parts[-1] == "__main__":  # importing it would run the program
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join((package, *parts)))
    return names


def test_the_contract_imports_only_pydantic_the_standard_library_and_itself():
    for path in sorted((REPO / "contract").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                allowed = top in sys.stdlib_module_names or top in CONTRACT_MAY_IMPORT
                assert allowed and (top != "tidal" or name.startswith("tidal.contract")), f"{path.name} imports {name}"


def test_importing_every_operator_and_contract_module_loads_no_torch():
    modules = _module_names("contract", "tidal.contract") + _module_names("operator", "tidal.operator")
    assert "tidal.operator.workerclient" in modules and "tidal.contract.error_codes" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"torch was imported: {result.stdout}"
