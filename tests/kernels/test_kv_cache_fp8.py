"""An FP8 (e4m3) KV cache: every kernel that writes the cache rounds as the references do (bit for bit), and the
attention kernels read it back as the references do (kernels/kv_cache_dtype.py)."""

import pytest
import torch
import triton
import triton.language as tl
from paged_kv import in_v_layout, make_paged_kv
from tolerances import DOT_DTYPES, assert_close

from tidal.kernels._device import _cuda_capability
from tidal.kernels._triton_utils import for_cache
from tidal.kernels.decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from tidal.kernels.kv_cache import store_kv_reference, store_kv_triton
from tidal.kernels.kv_cache_dtype import FP8_E4M3, check_cache_dtype, kv_cache_dtype, to_cache_dtype
from tidal.kernels.kv_layout import new_kv_cache_pair, v_tokens_innermost
from tidal.kernels.prefill_attention import (
    PrefillConfig,
    paged_prefill_attention_reference,
    paged_prefill_attention_triton,
)
from tidal.kernels.rotary import build_cos_sin_cache
from tidal.kernels.rotary_store_kv import HeadNorm, rotary_store_kv_reference, rotary_store_kv_triton
from tidal.kernels.small_batch_qkv import qkv_rope_store_reference, qkv_rope_store_triton


@triton.jit
def _for_cache_kernel(x_ptr, cache_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(cache_ptr + offsets, for_cache(x, cache_ptr, x_ptr), mask=mask)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == FP8_E4M3
    mismatch = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} values differ, first {got.flatten()[mismatch[:4]].float().tolist()} "
        f"against {want.flatten()[mismatch[:4]].float().tolist()}"
    )


def _fp8_caches(num_blocks, block_size, kv_heads, head_dim, device):
    """Zeroed FP8 (K, V) tensors as the engine allocates them: V tokens innermost."""
    return list(new_kv_cache_pair(num_blocks, (block_size, kv_heads, head_dim), FP8_E4M3, torch.device(device)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_rounding_is_torch_rounding(device, dtype):
    """Every e4m3 binade, subnormals, ties (the midpoints between neighbours), both signs, values past +-448 (clamped,
    infinities too): the same bits as the reference's cast; NaN stays NaN."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
    grid = grid[grid.isfinite()]
    midpoints = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2
    spread = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 3, 20000)
    edges = [0.0, -0.0, 447.9, 449.0, 464.0, -470.0, 1e4, -6e4, float("inf"), float("-inf")]
    values = torch.cat([grid, midpoints, spread, torch.tensor(edges)])
    x = values.to(dtype).to(device)
    got = torch.empty(x.shape, dtype=FP8_E4M3, device=device)
    _for_cache_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
    _same_bits(got.cpu(), to_cache_dtype(x, FP8_E4M3).cpu())
    if device == "cpu":
        return  # the interpreter's own fp32 -> e4m3 cast turns NaN into a number; the compiled cast keeps it
    nan = torch.tensor([float("nan")] * 4, dtype=dtype, device=device)
    got_nan = torch.empty(4, dtype=FP8_E4M3, device=device)
    _for_cache_kernel[(1,)](nan, got_nan, 4, BLOCK=4)
    assert got_nan.float().isnan().all()  # a blown-up value shows in the cache, as with torch's cast


def test_store_kv(device):
    k, v = (torch.randn(9, 2, 64, device=device) * 20 for _ in range(2))
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    slots = torch.tensor([3, -1, 0, 7, 12, 5, 1, 2, 30], device=device)
    results = []
    for fn in (store_kv_triton, store_kv_reference):
        caches = _fp8_caches(8, 4, 2, 64, device)
        fn(k, v, *caches, slots)
        results.append(caches)
    for got, want in zip(*results, strict=True):
        _same_bits(got.cpu(), want.cpu())


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_kv(device, qk_norm, dtype):
    """k rotated (and normalised) into the cache: rounded to the activations' dtype, then to e4m3, as the reference
    stores the rotated k. Partial rotary: the dims past it go in unrotated."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 128
    q, k, v = (
        torch.randn(tokens, n, head_dim, generator=gen).mul(4).to(dtype).to(device) for n in (heads, kv_heads, kv_heads)
    )
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(device)
    slots = torch.tensor([4, -1, 0, 9, 2], device=device)
    cos_sin = build_cos_sin_cache(64, 128, 10000.0, None, dtype, device)
    norms = (HeadNorm(torch.rand(head_dim, generator=gen).add(0.5).to(dtype).to(device), 1e-6),) * 2 if qk_norm else ()
    results = []
    for fn in (rotary_store_kv_triton, rotary_store_kv_reference):
        caches = _fp8_caches(3, 4, kv_heads, head_dim, device)
        q_out = fn(q.clone(), k.clone(), v.clone(), positions, cos_sin, True, *caches, slots, *norms)
        results.append((q_out, *caches))
    (q_got, *got), (q_want, *want) = results
    assert_close(q_got, q_want)  # q stays in the activations' dtype
    _same_bits(got[1].cpu(), want[1].cpu())  # v: copied, rounded once
    # k: the kernel rotates in fp32 and the reference in the activations' dtype; both round that to e4m3, so where
    # the two 16-bit values differ by their last bit the e4m3 values may too (a tie between two e4m3 neighbours).
    assert_close(got[0].to(dtype), want[0].to(dtype), scale=8)
    agree = (got[0].view(torch.uint8) == want[0].view(torch.uint8)).float().mean()
    assert agree > 0.98, f"only {agree:.3f} of the cached k values agree bit for bit"


@pytest.mark.parametrize("qk_norm", [False, True])
def test_small_batch_qkv(device, qk_norm):
    """The fused qkv projection's epilogue writes k and v into an FP8 cache; q stays in the activations' dtype."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter's bf16 tl.dot is not trusted
    gen = torch.Generator().manual_seed(2)
    rows, heads, kv_heads, head_dim, k_in = 3, 4, 2, 64, 96
    a = torch.randn(rows, k_in, generator=gen).to(dtype).to(device)
    weight = (torch.randn((heads + 2 * kv_heads) * head_dim, k_in, generator=gen) * 0.5).to(dtype).to(device)
    positions = torch.tensor([3, 17, 60], device=device)
    slots = torch.tensor([5, -1, 11], device=device)
    cos_sin = build_cos_sin_cache(head_dim, 128, 10000.0, None, dtype, device)
    norms = (HeadNorm(torch.rand(head_dim, generator=gen).add(0.5).to(dtype).to(device), 1e-6),) * 2 if qk_norm else ()
    results = []
    for fn in (qkv_rope_store_triton, qkv_rope_store_reference):
        caches = _fp8_caches(4, 4, kv_heads, head_dim, device)
        q = fn(a, weight, None, None, 0.0, positions, cos_sin, *caches, slots, heads, kv_heads, *norms)
        results.append((q, *caches))
    (q_got, *got), (q_want, *want) = results
    assert_close(q_got, q_want, scale=3)
    for g, w in zip(got, want, strict=True):
        assert_close(g.to(dtype), w.to(dtype), scale=8)  # the fp32 sums' order may move a value by one e4m3 step
        written = w.float().abs().sum(dim=(2, 3)) > 0
        assert torch.equal(g.float().abs().sum(dim=(2, 3)) > 0, written)  # the padding row's slot stays empty


def _fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, device):
    """V tokens innermost, as an FP8 cache keeps it (kernels/kv_layout.py)."""
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, device)
    kv.k_cache = to_cache_dtype(kv.k_cache * 3, FP8_E4M3)
    kv.v_cache = in_v_layout(to_cache_dtype(kv.v_cache * 3, FP8_E4M3), v_tokens_innermost(FP8_E4M3))
    return kv


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("block_n", [16, None])
def test_decode_attention(device, num_splits, dtype, block_size, block_n):
    """5: pages whose tokens do not line up with the tiles (kv_layout.has_page_runs); block_n None: the engine's
    64-token tiles, with tails of more than 16 tokens after them."""
    seq_lens = [0, 5, 40, 71, 64 + 40, 128 + 17]
    kv = _fp8_paged_kv(seq_lens, block_size, 2, 64, device)
    q = torch.randn(len(seq_lens), 8, 64, dtype=dtype, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 64**-0.5)
    assert_close(paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n),
                 paged_decode_attention_reference(*args))  # fmt: skip


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_prefill_attention(device, dtype):
    lens = [(5, 0), (19, 7), (3, 30)]  # (new tokens, cached prefix)
    kv = _fp8_paged_kv([n + prefix for n, prefix in lens], 8, 2, 64, device)
    q = torch.randn(sum(n for n, _ in lens), 4, 64, dtype=dtype, device=device)
    cu = torch.tensor([0, 5, 24, 27], dtype=torch.int32, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 64**-0.5)
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    assert_close(paged_prefill_attention_triton(*args, config=config), paged_prefill_attention_reference(*args))


@pytest.fixture
def set_capability(monkeypatch):
    """Makes torch report `capability` for every GPU. The lookup is cached per device (kernels/_device.py), so the
    cache is emptied with each setting, and afterwards so that no later test sees the made-up value."""

    def set_to(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        _cuda_capability.cache_clear()

    yield set_to
    _cuda_capability.cache_clear()


def test_an_fp8_cache_needs_ada_or_newer(monkeypatch, set_capability):
    """Refused before any kernel compiles on an A100 (8.0); taken on an H100/H200 (9.0), and on CPU always."""
    from tidal.kernels.kv_cache_dtype import check_device_holds

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    set_capability((8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer .* NVIDIA A100 is 8.0"):
        check_device_holds(FP8_E4M3, torch.device("cuda", 0))
    check_device_holds(torch.bfloat16, torch.device("cuda", 0))  # a 16-bit cache is fine anywhere
    check_device_holds(FP8_E4M3, torch.device("cpu"))
    set_capability((9, 0))
    check_device_holds(FP8_E4M3, torch.device("cuda", 0))


def test_fp8_weights_need_ada_or_newer(monkeypatch, set_capability):
    """The same refusal for FP8 weights, naming their own setting; the engine turns it into a config error."""
    from tidal.kernels.fp8_linear import check_fp8_weights_fit

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    set_capability((8, 0))
    with pytest.raises(ValueError, match=r"FP8 weights need .* NVIDIA A100 is 8.0: use weight_dtype 'auto'"):
        check_fp8_weights_fit(torch.device("cuda", 0))
    check_fp8_weights_fit(torch.device("cpu"))
    set_capability((9, 0))
    check_fp8_weights_fit(torch.device("cuda", 0))


def test_names_and_refusals():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8_e4m3", torch.float16) == FP8_E4M3
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_cache_dtype("fp8_e5m2", torch.bfloat16)
    check_cache_dtype("caches", torch.bfloat16, torch.empty(1, dtype=FP8_E4M3), torch.empty(1, dtype=FP8_E4M3))
    with pytest.raises(ValueError, match="activations' dtype"):
        check_cache_dtype("caches", torch.bfloat16, torch.empty(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="activations' dtype"):
        check_cache_dtype("caches", torch.bfloat16, torch.empty(1, dtype=torch.float8_e5m2))
    with pytest.raises(ValueError, match="share one dtype"):
        check_cache_dtype(
            "caches", torch.bfloat16, torch.empty(1, dtype=FP8_E4M3), torch.empty(1, dtype=torch.bfloat16)
        )
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        q = torch.randn(1, 2, 8)
        tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        paged_decode_attention_triton(q, torch.zeros(1, 4, 1, 8, dtype=torch.float16),
                                      torch.zeros(1, 4, 1, 8, dtype=torch.float16), tables, lens, 1.0)  # fmt: skip
