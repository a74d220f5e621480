"""Run mypy over every `tidal.*` module, reading the folder mapping from setup.py, and over the image builder
(hack/images/).

The top-level folders (operator/, worker/, ...) are imported as `tidal.operator`, `tidal.worker`, ... through the
editable install's import hook, which no type checker follows, and mypy's command line can only name a module after
its folder. So this script hands mypy the source list itself: each file under its real path with its `tidal.` module
name. Errors are reported at the files' real paths, and `import tidal.worker...` resolves to the sources given.
Options come from pyproject.toml's [tool.mypy]; extra arguments are passed on to mypy (e.g. `--no-incremental`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from folder_mapping import read_folder_mapping  # hack/, beside this script
from mypy import build, util
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

REPO_ROOT = Path(__file__).resolve().parent.parent


def module_name(import_name: str, folder: Path, file: Path) -> str:
    parts = file.relative_to(folder).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((import_name, *parts))


def tidal_sources() -> list[BuildSource]:
    sources = []
    for import_name, folder_name in sorted(read_folder_mapping().items()):
        folder = REPO_ROOT / folder_name
        for file in sorted(folder.rglob("*.py")):
            if "__pycache__" in file.parts:
                continue
            path = str(file.relative_to(REPO_ROOT))
            sources.append(BuildSource(path, module_name(import_name, folder, file), base_dir=str(REPO_ROOT)))
    return sources


def image_builder_sources() -> list[BuildSource]:
    """hack/images/: a script's folder whose modules import each other by their bare names."""
    folder = REPO_ROOT / "hack" / "images"
    return [
        BuildSource(str(file.relative_to(REPO_ROOT)), file.stem, base_dir=str(folder))
        for file in sorted(folder.glob("*.py"))
    ]


def main(args: list[str]) -> int:
    os.chdir(REPO_ROOT)  # paths in messages are relative to the repository root
    options = process_options(["--config-file", str(REPO_ROOT / "pyproject.toml"), *args], require_targets=False)[1]
    sources = tidal_sources() + image_builder_sources()
    try:
        result = build.build(sources, options)
        messages, blocking = result.errors, False
    except CompileError as error:
        messages, blocking = error.messages, True
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    for message in messages:
        print(formatter.colorize(message) if options.color_output else message)
    n_errors, _notes, n_files = util.count_stats(messages)
    if n_errors or blocking:
        print(formatter.format_error(n_errors, n_files, len(sources), blockers=blocking))
        return 2 if blocking else 1
    print(formatter.format_success(len(sources)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
