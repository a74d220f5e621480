"""Architecture name (config.json's `architectures`) -> model implementation; the only place that maps them."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tidal.worker.models.base import CausalLM
from tidal.worker.models.llama import LlamaForCausalLM
from tidal.worker.models.mistral import MistralForCausalLM
from tidal.worker.models.mixtral import MixtralForCausalLM
from tidal.worker.models.qwen2 import Qwen2ForCausalLM
from tidal.worker.models.qwen2_moe import Qwen2MoeForCausalLM
from tidal.worker.models.qwen3 import Qwen3ForCausalLM
from tidal.worker.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: Mapping[str, type[CausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": MistralForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    }
)


# The tool-call format (server/tool_calls/families.py) each architecture's chat templates write.
TOOL_CALL_FORMATS: Mapping[str, str] = MappingProxyType(
    {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "MixtralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen",
        "Qwen2MoeForCausalLM": "qwen",
        "Qwen3ForCausalLM": "qwen",
        "Qwen3MoeForCausalLM": "qwen",
    }
)


def tool_call_format_of(model_class: type[CausalLM]) -> str | None:
    """The tool-call format of the architecture `model_class` implements; None if none is known."""
    for architecture, implementation in MODEL_REGISTRY.items():
        if implementation is model_class:
            return TOOL_CALL_FORMATS.get(architecture)
    return None


class UnsupportedArchitectureError(ValueError):
    def __init__(self, architectures: list[str]) -> None:
        super().__init__(
            f"no implementation for architecture(s) {architectures or '(none listed in config.json)'}; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
        self.architectures = architectures


def resolve_model_class(architectures: list[str] | None) -> type[CausalLM]:
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedArchitectureError(list(architectures or []))
