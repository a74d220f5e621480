"""The fused qkv projection at one row as a row-parallel GEMV (`one_row=OneRowConfig`): rotary and the KV-cache
write in its epilogue, and Qwen3's q/k norm over several programs a head meeting on an arrival counter. Against
the torch reference."""

import pytest
import torch
from tolerances import assert_close

from tidal.kernels._split_k import arrival_counters
from tidal.kernels.fp8_linear import quantize_rows_reference
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.kv_layout import new_kv_cache_pair
from tidal.kernels.rotary import build_cos_sin_cache
from tidal.kernels.rotary_store_kv import HeadNorm
from tidal.kernels.small_batch_linear import OneRowConfig
from tidal.kernels.small_batch_qkv import qkv_rope_store_reference, qkv_rope_store_triton

NUM_BLOCKS, BLOCK_SIZE, K_IN = 6, 4, 48
# The row GEMV reduces with sums, not a tensor-core dot, so 16-bit activations run in the interpreter too.
DTYPES = [torch.float32, torch.bfloat16]


def _case(heads, kv_heads, head_dim, dtype, device, fp8, bias, normed, qk_norm, slot=9):
    n = (heads + 2 * kv_heads) * head_dim
    a = torch.randn(1, K_IN, dtype=dtype, device=device)
    weight = torch.randn(n, K_IN, dtype=dtype, device=device) / K_IN**0.5
    scale = None
    if fp8:
        weight, scale = (t.to(device) for t in quantize_rows_reference(weight.float().cpu()))
    args = dict(
        bias=torch.randn(n, dtype=dtype, device=device) if bias else None,
        norm_partials=(torch.rand(3, 1, device=device) + 0.5) * K_IN / 3 if normed else None,
        eps=1e-6,
        positions=torch.tensor([37], device=device),
        cos_sin_cache=build_cos_sin_cache(head_dim, 64, 10000.0, None, dtype, device),
        slot_mapping=torch.tensor([slot], device=device),
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        weight_scale=scale,
    )
    if qk_norm:
        gen = torch.Generator().manual_seed(1)
        args["q_norm"], args["k_norm"] = (HeadNorm((torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device), e)
                                          for e in (1e-6, 1e-5))  # fmt: skip
    return a, weight, args


def _run_both(a, weight, args, caches_like, config):
    """(q, k cache, v cache) from the one-row launch and from the reference, each on its own copy of the caches."""
    results = []
    for one_row in (config, None):
        k_cache, v_cache = (c.clone() for c in caches_like)
        fn = qkv_rope_store_triton if one_row is not None else qkv_rope_store_reference
        extra = {"one_row": one_row} if one_row is not None else {}
        q = fn(a, weight, k_cache=k_cache, v_cache=v_cache, **args, **extra)
        results.append((q, k_cache, v_cache))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (2, 1, 64)])
# 2 dims a program: 8 or 16 programs a head meet on the counter; the whole half: one program a head.
@pytest.mark.parametrize("block_n", [2, 8, 16, 32])
@pytest.mark.parametrize(("fp8", "bias", "normed"), [(False, False, False), (True, True, True)])
def test_qk_norm_over_any_number_of_programs_a_head(device, dtype, heads, kv_heads, head_dim, block_n, fp8, bias,
                                                    normed):  # fmt: skip
    if block_n > head_dim // 2:
        pytest.skip("wider than the half-head")
    a, weight, args = _case(heads, kv_heads, head_dim, dtype, device, fp8, bias, normed, qk_norm=True)
    caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
    (q, k, v), (want_q, want_k, want_v) = _run_both(a, weight, args, caches, OneRowConfig(block_n, 16, 2))
    assert_close(q, want_q, scale=3)
    assert_close(k, want_k, scale=3)
    assert_close(v, want_v, scale=3)
    assert not arrival_counters(a.device, 1).any()  # every launch leaves them at zero for the next


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (4, 4, 80)])  # 80: a half of 40, masked
@pytest.mark.parametrize("block_n", [1, 4, 16])
def test_without_a_norm_each_program_finishes_its_own_dims(device, dtype, heads, kv_heads, head_dim, block_n):
    if block_n > head_dim // 2:
        pytest.skip("wider than the half-head")
    a, weight, args = _case(heads, kv_heads, head_dim, dtype, device, fp8=False, bias=True, normed=True,
                            qk_norm=False)  # fmt: skip
    caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
    (q, k, v), (want_q, want_k, want_v) = _run_both(a, weight, args, caches, OneRowConfig(block_n, 32, 2))
    assert_close(q, want_q, scale=3)
    assert_close(k, want_k, scale=3)
    assert_close(v, want_v, scale=3)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_an_fp8_cache_with_v_tokens_innermost_and_an_unwritten_slot(device, qk_norm):
    """The FP8 cache's layout (V tokens innermost) gets the same bytes as the reference writes; with slot -1 (a
    padding row) neither cache changes."""
    for slot in (13, -1):
        a, weight, args = _case(2, 1, 32, torch.bfloat16, device, fp8=True, bias=False, normed=False,
                                qk_norm=qk_norm, slot=slot)  # fmt: skip
        caches = new_kv_cache_pair(NUM_BLOCKS, (BLOCK_SIZE, 1, 32), FP8_E4M3, torch.device(device))
        for c in caches:
            c.zero_()
        (q, k, v), (want_q, want_k, want_v) = _run_both(a, weight, args, caches, OneRowConfig(4, 16, 2))
        assert_close(q, want_q, scale=3)
        assert_close(k.to(torch.bfloat16), want_k.to(torch.bfloat16), scale=8)  # one e4m3 step at most
        assert_close(v.to(torch.bfloat16), want_v.to(torch.bfloat16), scale=8)
        assert (k.float().abs().sum() > 0) == (slot >= 0) and (v.float().abs().sum() > 0) == (slot >= 0)


@pytest.mark.parametrize("fp8", [False, True])
def test_weights_first_programs_equal_the_reference(device, fp8):
    """Whole rows of both halves loaded before the wait (block_k ignored), with the q/k norm over several programs a
    head and without a norm."""
    for qk_norm, block_n in ((True, 4), (False, 8)):
        a, weight, args = _case(4, 2, 32, torch.float32, device, fp8, bias=True, normed=True, qk_norm=qk_norm)
        caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 32, device=device) for _ in range(2)]
        config = OneRowConfig(block_n, 16, 2, weights_first=True)
        (q, k, v), (want_q, want_k, want_v) = _run_both(a, weight, args, caches, config)
        assert_close(q, want_q, scale=2)
        assert_close(k, want_k, scale=2)
        assert_close(v, want_v, scale=2)


def test_bad_one_row_configs_are_refused(device):
    a, weight, args = _case(2, 1, 32, torch.float32, device, fp8=False, bias=False, normed=False, qk_norm=False)
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 1, 32, device=device) for _ in range(2)]
    with pytest.raises(ValueError, match="power of two of at most the half-head 16, got 32"):
        qkv_rope_store_triton(a, weight, k_cache=caches[0], v_cache=caches[1], one_row=OneRowConfig(32, 16, 2),
                              **args)  # fmt: skip
    with pytest.raises(ValueError, match="one-row config launches one row, got 2"):
        qkv_rope_store_triton(torch.cat([a, a]), weight, k_cache=caches[0], v_cache=caches[1],
                              one_row=OneRowConfig(4, 16, 2),
                              **{**args, "positions": torch.tensor([1, 2], device=device),
                                 "slot_mapping": torch.tensor([1, 2], device=device)})  # fmt: skip


def test_the_tuned_table_routes_one_row_and_only_one_row(device, monkeypatch):
    """A TUNED_ONE_ROW_QKV_CONFIGS entry sends a one-row launch of its shape to the row GEMV (the same bits as the
    explicit config), unless a tiled parameter is given or the table is turned off."""
    import tidal.kernels.small_batch_qkv as small_batch_qkv

    a, weight, args = _case(4, 2, 32, torch.float32, device, fp8=False, bias=False, normed=True, qk_norm=True)
    config = OneRowConfig(4, 16, 2)

    def q_of(**extra):
        caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, 32, device=device) for _ in range(2)]
        return qkv_rope_store_triton(a, weight, k_cache=caches[0], v_cache=caches[1], **args, **extra)

    row_gemv, tiled = q_of(one_row=config), q_of(one_row="off")
    assert not torch.equal(row_gemv, tiled)  # the two kernels add in different orders, so the test can tell them
    assert torch.equal(q_of(), tiled)  # an empty table: the tiled kernel
    monkeypatch.setitem(small_batch_qkv.TUNED_ONE_ROW_QKV_CONFIGS, (4, 2, 32, K_IN, True, False), config)
    assert torch.equal(q_of(), row_gemv)
    assert torch.equal(q_of(one_row="off"), tiled)
    assert torch.equal(q_of(split_k=1), q_of(one_row="off", split_k=1))  # a tiled parameter keeps the tiled kernel
    assert small_batch_qkv.choose_one_row_qkv_config(4, 2, 32, K_IN, True, True) is None  # e4m3 is its own key


def test_each_tuned_entry_fits_its_shape():
    """An entry's block_n divides the half-head into whole programs (the launch refuses any other), and only the
    measured shapes are listed: the 8B's qkv keeps the tiled kernel."""
    import tidal.kernels.small_batch_qkv as small_batch_qkv

    for (heads, kv_heads, head_dim, k_in, qk_norm, fp8), config in small_batch_qkv.TUNED_ONE_ROW_QKV_CONFIGS.items():
        assert small_batch_qkv.choose_one_row_qkv_config(heads, kv_heads, head_dim, k_in, qk_norm, fp8) == config
        half = head_dim // 2
        assert config.block_n & (config.block_n - 1) == 0 and half % config.block_n == 0, config
    assert small_batch_qkv.choose_one_row_qkv_config(32, 8, 128, 4096, False, True) is None
