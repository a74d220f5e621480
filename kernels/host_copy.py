# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
"""Copying pinned host memory into device memory with a kernel: the multiprocessors read the host buffer over the
bus (pinned memory is addressable from the device under unified addressing) instead of the copy engines moving it.

Why: on an H200, creating physical device memory (cuMemCreate, as a wake re-creates a released KV cache) does not run
alongside a copy-engine transfer; the two take turns. A kernel copy leaves the copy engines free, so the KV cache's
memory can be created while the weights stream in. The entry point falls back to `Tensor.copy_` where a kernel copy
cannot run (CPU tensors, pageable host memory).
"""

import torch
import triton
import triton.language as tl

# Bytes each program moves per loop iteration, and iterations per program: enough loads in flight per
# multiprocessor to cover the bus's latency, few enough programs that the launch stays small.
BLOCK_BYTES = 16384
ITERS = 16


@triton.jit
def _copy_words_kernel(src_ptr, dst_ptr, num_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offsets = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < num_words
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


class _PinnedWords:
    """A pinned host buffer as the kernel's source pointer: Triton takes any argument with `data_ptr()` and `dtype`
    as a pointer, and its launcher checks that the device can address it (pinned memory under unified addressing)."""

    dtype = torch.int64

    def __init__(self, ptr: int, num_words: int) -> None:
        self._ptr = ptr
        self.num_words = num_words

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self.num_words


def _word_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).view(torch.int64)


def kernel_copy_supported(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `copy_from_host` moves src -> dst with the kernel (else it uses the copy engines)."""
    return (
        dst.is_cuda
        and not src.is_cuda
        and src.is_pinned()
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.dtype == src.dtype
        and dst.numel() == src.numel()
        and (dst.numel() * dst.element_size()) % 8 == 0
        and dst.data_ptr() % 8 == 0
        and src.data_ptr() % 8 == 0
    )


def copy_words_into(dst_words: torch.Tensor, src_words: "torch.Tensor | _PinnedWords") -> None:
    """dst_words[:] = src_words, int64 [N] the kernel can address (interpreter tests pass CPU tensors)."""
    num_words = dst_words.numel()
    if src_words.numel() != num_words:
        raise ValueError(f"copy of {src_words.numel()} words into {num_words}")
    grid = (triton.cdiv(num_words, (BLOCK_BYTES // 8) * ITERS),)
    _copy_words_kernel[grid](src_words, dst_words, num_words, BLOCK=BLOCK_BYTES // 8, ITERS=ITERS, num_warps=8)


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (device) <- src (host), queued on the current stream like `dst.copy_(src, non_blocking=True)`."""
    if not kernel_copy_supported(dst, src):
        dst.copy_(src, non_blocking=True)
        return
    num_words = dst.numel() * dst.element_size() // 8
    with torch.cuda.device(dst.device):
        copy_words_into(_word_view(dst.reshape(-1)), _PinnedWords(src.data_ptr(), num_words))
