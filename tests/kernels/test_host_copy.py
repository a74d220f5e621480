"""The host-to-device copy kernel: word-exact copies of every size, and the fallback to Tensor.copy_."""

import pytest
import torch

from tidal.kernels.host_copy import BLOCK_BYTES, ITERS, copy_from_host, copy_words_into, kernel_copy_supported

PROGRAM_WORDS = BLOCK_BYTES // 8 * ITERS


@pytest.mark.parametrize("num_words", [1, 7, PROGRAM_WORDS - 1, PROGRAM_WORDS, 2 * PROGRAM_WORDS + 3])
def test_copies_every_word_and_nothing_past_the_end(device, num_words):
    src = torch.randint(-(2**62), 2**62, (num_words,), dtype=torch.int64, device=device)
    dst = torch.full((num_words + 5,), 7, dtype=torch.int64, device=device)
    copy_words_into(dst[:num_words], src)
    assert torch.equal(dst[:num_words], src)
    assert torch.all(dst[num_words:] == 7)


def test_rejects_mismatched_sizes(device):
    with pytest.raises(ValueError, match="copy of 3 words into 4"):
        copy_words_into(
            torch.zeros(4, dtype=torch.int64, device=device), torch.zeros(3, dtype=torch.int64, device=device)
        )


def test_falls_back_to_tensor_copy_where_the_kernel_cannot_run():
    src = torch.arange(10, dtype=torch.bfloat16)
    dst = torch.zeros(10, dtype=torch.bfloat16)
    assert not kernel_copy_supported(dst, src)  # not a device destination
    copy_from_host(dst, src)
    assert torch.equal(dst, src)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and pinned memory")
def test_pinned_bf16_buffer_reaches_the_device_bit_exact():
    src = torch.randn(3 * PROGRAM_WORDS + 12, dtype=torch.bfloat16).pin_memory()
    dst = torch.empty(src.shape, dtype=torch.bfloat16, device="cuda")
    assert kernel_copy_supported(dst, src)
    copy_from_host(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu().view(torch.int16), src.view(torch.int16))
