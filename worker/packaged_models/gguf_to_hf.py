"""Dequantize a GGUF file into a Hugging Face model directory (config, safetensors, tokenizer, chat template).

transformers reads GGUF files (with the `gguf` package) into ordinary float tensors; writing those back out gives a
directory that any Hugging Face loader, and our worker, reads without knowing a GGUF was involved.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PretrainedConfig, PreTrainedTokenizerBase

# The tokenizer's special tokens, named by the config ids that decide them.
_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "pad_token_id"}


def convert_gguf(gguf_path: Path, out: Path) -> Path:
    """Write `out` (which must not hold another model) from `gguf_path`; weights in float32.

    float32 because Q4_1 blocks dequantize to f16 scale x 4-bit value + f16 minimum, which float32 holds exactly:
    the directory is the GGUF's own numbers, not a second rounding of them.
    """
    out.mkdir(parents=True, exist_ok=True)
    # dequantize=True: every weight unpacked at load. Left to itself, transformers may keep the blocks packed for a
    # matmul kernel it fetches from the hub, which we neither want (no hub at run time) nor can save.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    not_float = sorted({str(p.dtype) for p in model.state_dict().values() if p.dtype != torch.float32})
    if not_float:
        raise ValueError(f"{gguf_path.name} did not dequantize to float32 (found {', '.join(not_float)})")
    # A dequantized load drops the quantization config itself, so this writes an ordinary float checkpoint.
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    _align_special_tokens(tokenizer, model.config)
    # A byte-level BPE keeps its spaces: the WordPiece clean-up would strip the one before punctuation on decode.
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(out)
    _make_readable(out)
    return out


def _align_special_tokens(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> None:
    """Name the special tokens after the GGUF's own ids (in the config), which the tokenizer conversion may not.

    transformers 5.17 gives SmolLM2's tokenizer `<|im_start|>` as its end of sequence while the GGUF says id 2,
    `<|im_end|>`; clients that stop on `tokenizer.eos_token` would then run past every answer.
    """
    for token_attr, id_attr in _SPECIAL_TOKEN_IDS.items():
        token_id = getattr(config, id_attr, None)
        if isinstance(token_id, int):
            setattr(tokenizer, token_attr, tokenizer.convert_ids_to_tokens(token_id))


def _make_readable(out: Path) -> None:
    # save_pretrained leaves model.safetensors readable by its owner only (0600) and mkdtemp makes the folder 0700;
    # a pod whose user differs from the one that built the cache reads it through a hostPath, so: the usual modes.
    out.chmod(0o755)
    for path in out.iterdir():
        os.chmod(path, 0o644)
