"""The packed FP8 KV reference (kvpatch/verify/fp8_packed_reference.py) against its spec.

verify runs the same quantizer on both sides, so a wrong quantizer could never make a
verify case fail: these tests pin it to the format it claims (DeepSeek V3.2 FlashMLA's
656-byte rows as SGLang's quantize_k_cache writes them) and pin the FP8 sparse kernel
reference to plain attention over the dequantized rows it lists.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvpatch.verify import fp8_packed_reference as fp8  # noqa: E402
from kvpatch.verify import sparse_reference as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def _cache(blocks=3, block_size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((blocks, block_size, 1, 576), generator=g)
    # Tiles of very different magnitudes, so that a scale shared across tiles would show.
    x[..., :128] *= 1e-3
    x[..., 128:256] *= 50.0
    x[..., 384:512] *= 3e3
    return x.to(torch.bfloat16)


def test_layout_is_656_bytes_of_fp8_tiles_scales_and_bf16_rope():
    x = _cache()
    p = fp8.quantize_k_cache(x)
    assert p.shape == (3, 64, 1, 656) and p.dtype == torch.float8_e4m3fn  # as SGLang's function returns
    b = p.view(torch.uint8).reshape(-1, 656)
    xf = x.reshape(-1, 576)
    # rope: the input's bf16 bytes, untouched
    assert torch.equal(b[:, 528:].contiguous().view(torch.bfloat16), xf[:, 512:])
    # scales: bytes 512..527, one float32 a tile, amax(|tile|) / 448
    scales = b[:, 512:528].contiguous().view(torch.float32)
    amax = xf[:, :512].float().view(-1, 4, 128).abs().amax(-1)
    assert torch.equal(scales, amax / 448.0)
    assert torch.equal(fp8.tile_scales(p).reshape(-1, 4), scales)
    # values: each tile's largest magnitude is e4m3's largest, 448
    vals = b[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    assert torch.equal(vals.abs().amax(-1), torch.full_like(amax, 448.0))


def test_quantize_then_dequantize_round_trips_within_fp8_tolerance():
    x = _cache(seed=1)
    back = fp8.dequantize_rows(fp8.quantize_k_cache(x))
    assert back.shape == (3, 64, 1, 576) and back.dtype == torch.float32
    xf = x.float()
    assert torch.equal(back[..., 512:], xf[..., 512:])  # rope is exact
    scale = fp8.tile_scales(fp8.quantize_k_cache(x)).repeat_interleave(128, dim=-1)
    err = (back[..., :512] - xf[..., :512]).abs()
    # e4m3 rounds to 3 mantissa bits: half a step is 2**-4 relative; below 2**-6 (subnormal)
    # the step is 2**-9 of the scale.
    bound = xf[..., :512].abs() * 2.0 ** -4 + scale * 2.0 ** -10
    assert bool((err <= bound * 1.0001).all()), float((err - bound).max())
    assert float(err.max()) > 0  # it is a quantization: not a copy


def test_a_row_is_quantized_from_its_own_values_only():
    x = _cache(blocks=2, seed=2)
    p = fp8.quantize_k_cache(x).view(torch.uint8)
    poisoned = x.clone()
    poisoned[0, 5:] = float("nan")  # rows a deferred buffer never cast
    q = fp8.quantize_k_cache(poisoned).view(torch.uint8)
    assert torch.equal(q[0, :5], p[0, :5]) and torch.equal(q[1], p[1])


def test_quantize_refuses_what_sglang_refuses():
    with pytest.raises(TypeError, match="bfloat16"):
        fp8.quantize_k_cache(_cache().to(torch.float16))
    with pytest.raises(ValueError):
        fp8.quantize_k_cache(torch.zeros((4, 512), dtype=torch.bfloat16))


def _fp8_kernel_inputs(seed=3):
    g = torch.Generator().manual_seed(seed)
    cache = fp8.quantize_k_cache(_cache(blocks=4, seed=seed))
    q = torch.randn((2, 1, 16, 576), generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 4 * 64, (2, 1, 64), generator=g, dtype=torch.int32)
    idx[0, 0, 50:] = -1
    return q, cache, idx


def _attention(q, rows, scale):
    s = (q.float() @ rows.T) * scale
    return torch.softmax(s, dim=-1) @ rows[:, :512]


def test_fp8_kernel_is_attention_over_the_dequantized_rows_it_lists():
    q, cache, idx = _fp8_kernel_inputs()
    out, lse = ref.flash_mla_with_kvcache(q=q, k_cache=cache, cache_seqlens=None, head_dim_v=512,
                                          softmax_scale=0.1, indices=idx, is_fp8_kvcache=True)
    assert out.shape == (2, 1, 16, 512) and out.dtype == torch.bfloat16
    deq = fp8.dequantize_rows(cache).reshape(-1, 576)
    for b in range(2):
        listed = idx[b, 0][idx[b, 0] >= 0].long()
        want = _attention(q[b, 0], deq[listed], 0.1)
        assert torch.allclose(out[b, 0].float(), want, rtol=1e-2, atol=1e-2)
    # A row nobody lists never reaches the output, even as NaN bytes.
    unlisted = sorted(set(range(4 * 64)) - set(idx[idx >= 0].tolist()))
    poisoned = cache.view(torch.uint8).clone().reshape(-1, 656)
    poisoned[unlisted] = 0xFF  # NaN in e4m3, NaN scales
    again, _ = ref.flash_mla_with_kvcache(q=q, k_cache=poisoned.view(4, 64, 1, 656), head_dim_v=512,
                                          softmax_scale=0.1, indices=idx, is_fp8_kvcache=True)
    assert torch.equal(again, out)


def test_fp8_kernel_reads_the_tile_scales():
    """A wrong tile scale in a listed row changes the output: the scales are read, per tile."""
    q, cache, idx = _fp8_kernel_inputs(seed=4)
    out, _ = ref.flash_mla_with_kvcache(q=q, k_cache=cache, head_dim_v=512, softmax_scale=0.1, indices=idx,
                                        is_fp8_kvcache=True)
    bad = cache.view(torch.uint8).clone().reshape(-1, 656)
    row = int(idx[1, 0, 0])
    # Tile 3's scale (the largest values of _cache, so the row's score moves: with these
    # magnitudes a small tile's change can vanish in the softmax).
    bad[row, 512 + 12:512 + 16].view(torch.float32).mul_(2.0)
    got, _ = ref.flash_mla_with_kvcache(q=q, k_cache=bad.view(4, 64, 1, 656), head_dim_v=512, softmax_scale=0.1,
                                        indices=idx, is_fp8_kvcache=True)
    assert torch.equal(got[0], out[0]) and not torch.equal(got[1], out[1])


def test_fp8_kernel_refuses_an_unquantized_cache():
    q, _, idx = _fp8_kernel_inputs()
    with pytest.raises(TypeError, match="packed"):
        ref.flash_mla_with_kvcache(q=q, k_cache=_cache(blocks=4), head_dim_v=512, indices=idx, is_fp8_kvcache=True)
