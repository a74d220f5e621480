"""hack/typecheck.py hands mypy every file of the mapped folders under its tidal.* name and its real path."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _typecheck_module():
    sys.path.insert(0, str(REPO / "hack"))  # as when run as a script: its sibling folder_mapping.py imports
    spec = importlib.util.spec_from_file_location("typecheck", REPO / "hack" / "typecheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mapped_file_is_a_source_under_its_tidal_name():
    typecheck = _typecheck_module()
    mapping = typecheck.read_folder_mapping()
    assert mapping["tidal.worker"] == "worker"
    sources = {s.module: s.path for s in typecheck.tidal_sources()}
    files = [p for folder in mapping.values() for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts]
    assert len(sources) == len(files)
    assert sources["tidal.worker.engine.scheduler"] == "worker/engine/scheduler.py"
    assert sources["tidal.operator.planner"] == "operator/planner/__init__.py"
    assert all(Path(REPO, path).is_file() for path in sources.values())
