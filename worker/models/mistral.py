"""Mistral: the Llama layout without biases. A sliding window is honoured by capping max_model_len at it
(the engine does that), since within the window full attention is the same computation."""

from __future__ import annotations

from tidal.worker.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    pass
