"""The worker's model as given (a Hugging Face directory, or a `.gguf` file) -> the directory every part reads.

Resolved once, in the CLI before the worker is assembled, so the engine, the tokenizer, the lifecycle's checksums
and weight reloads all see one ordinary safetensors directory and none of them knows about GGUF.
"""

from __future__ import annotations

from tidal.worker.config import WorkerConfig
from tidal.worker.packaged_models.gguf_file import gguf_model_dir, is_gguf_file


def with_model_directory(config: WorkerConfig) -> WorkerConfig:
    """`config` itself for a directory; for a `.gguf` file, the same settings naming its converted directory."""
    given = config.engine.model_path
    if not is_gguf_file(given):
        return config
    directory = gguf_model_dir(given)
    # Clients keep the name they would have had (the file's stem), not the cache entry's.
    engine = config.engine.model_copy(
        update={"model_path": directory, "served_model_name": config.engine.served_model_name or given.stem}
    )
    lifecycle = config.lifecycle
    # The operator passes the model as the start-up weights too; the same file means the same directory.
    if lifecycle.weights_path is not None and lifecycle.weights_path.resolve() == given.resolve():
        lifecycle = lifecycle.model_copy(update={"weights_path": directory})
    return config.model_copy(update={"engine": engine, "lifecycle": lifecycle})
