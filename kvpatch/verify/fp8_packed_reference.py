"""Torch reference of NSA's packed FP8 KV format: SGLang's ``quantize_k_cache`` (issue 20).

SGLang's NSA backend, on its FP8-compute path (``NSA_FLASHMLA_BACKEND_DECODE_COMPUTE_FP8``
with a BF16 cache), quantizes the cache it was handed and passes the result to FlashMLA's
``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``. The format is DeepSeek
V3.2 FlashMLA's, 656 bytes a token (one KV head, d = 576 = 512 latent + 64 rope):

    bytes [0, 512)    the 512 latent values as float8_e4m3fn, in 4 tiles of 128
    bytes [512, 528)  4 float32 scales, one a tile (little-endian, as ``.view(float32)``)
    bytes [528, 656)  the 64 rope values in the input dtype, bf16: copied, not quantized

A tile's scale is ``amax(|x|) / 448`` (448: e4m3's largest finite value), and its values
are ``clamp(x * (1 / scale), -448, 448)`` rounded to e4m3: a tile's largest magnitude
becomes +-448 and ``fp8 * scale`` gives the value back within e4m3's rounding (a relative
step of 2**-3). There is no epsilon: an all-zero tile gets scale 0 and NaN values, as in
SGLang (its Triton kernel says the reference has none, so it has none either).

The semantics were read from SGLang's ``nsa/quant_k_cache.py`` (the Triton kernel that is
the default, ``SGLANG_NSA_QUANT_K_CACHE_FAST``, and its torch ``_slow`` twin, which
divides by the scale instead of multiplying by its inverse) and ``nsa/dequant_k_cache.py``;
this is an implementation of that contract, not their code. Each token is quantized from
its own 576 values only: a row is never influenced by another row, which is what lets a
deferred buffer whose unread rows are poisoned quantize to the same bytes on its read rows.

The result has the dtype SGLang's function returns (float8_e4m3fn, 656 of them a token,
shape ``[..., 656]`` for an input ``[..., 576]``); its bytes are what matters, and the
readers here take a uint8 view of it as well.
"""

from __future__ import annotations

import torch

DV, D, TILE = 512, 576, 128
NUM_TILES = DV // TILE                     # 4
SCALE_BYTES = 4 * NUM_TILES                # 16: a float32 per tile
ROPE_BYTES = 2 * (D - DV)                  # 128: 64 bf16 values
PACKED = DV + SCALE_BYTES + ROPE_BYTES     # 656 bytes a token
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)      # 448.0


def quantize_k_cache(cache_k: torch.Tensor) -> torch.Tensor:
    """bf16 ``[..., 576]`` (SGLang passes ``[blocks, block_size, 1, 576]``) -> the packed
    rows, ``[..., 656]`` float8_e4m3fn (bytes as in the module docstring)."""
    if not isinstance(cache_k, torch.Tensor) or cache_k.shape[-1] != D:
        raise ValueError(f"quantize_k_cache: a [..., {D}] cache only, got {getattr(cache_k, 'shape', cache_k)}")
    if cache_k.dtype != torch.bfloat16:
        # SGLang's default (Triton) quantizer asserts bf16: the rope bytes are bf16's.
        raise TypeError(f"quantize_k_cache: the cache must be torch.bfloat16, got {cache_k.dtype}")
    lead = cache_k.shape[:-1]
    x = cache_k.reshape(-1, D)
    n = x.shape[0]
    tiles = x[:, :DV].float().view(n, NUM_TILES, TILE)
    scale = tiles.abs().amax(dim=-1) / FP8_MAX                      # [n, 4] float32
    q = (tiles * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch.empty((n, PACKED), dtype=torch.uint8, device=cache_k.device)
    out[:, :DV] = q.view(torch.uint8).reshape(n, DV)
    out[:, DV:DV + SCALE_BYTES] = scale.contiguous().view(torch.uint8)
    out[:, DV + SCALE_BYTES:] = x[:, DV:].contiguous().view(torch.uint8)
    return out.view(FP8).view(*lead, PACKED)


def _as_bytes(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype not in (FP8, torch.uint8) or packed.shape[-1] != PACKED:
        raise TypeError(f"packed FP8 KV rows are [..., {PACKED}] float8_e4m3fn or uint8 (quantize_k_cache's "
                        f"format), got {list(packed.shape)} {packed.dtype}")
    return packed.view(torch.uint8)


def tile_scales(packed: torch.Tensor) -> torch.Tensor:
    """The float32 scales of packed rows: ``[..., 4]``."""
    b = _as_bytes(packed)
    return b[..., DV:DV + SCALE_BYTES].contiguous().view(torch.float32)


def dequantize_rows(packed: torch.Tensor) -> torch.Tensor:
    """Packed rows ``[..., 656]`` -> float32 ``[..., 576]``: latent ``fp8 * scale`` per tile,
    rope the stored bf16 values (exact in float32)."""
    b = _as_bytes(packed)
    lead = b.shape[:-1]
    b2 = b.reshape(-1, PACKED)
    n = b2.shape[0]
    nope = b2[:, :DV].contiguous().view(FP8).float().view(n, NUM_TILES, TILE)
    scale = b2[:, DV:DV + SCALE_BYTES].contiguous().view(torch.float32)
    rope = b2[:, DV + SCALE_BYTES:].contiguous().view(torch.bfloat16).float()
    out = torch.cat([(nope * scale[..., None]).reshape(n, DV), rope], dim=-1)
    return out.view(*lead, D)


def gather_dequantized(k_cache: torch.Tensor, idx: torch.Tensor):
    """k_cache ``[blocks, block_size, 1, 656]`` packed; idx ``[k]`` flat token indices
    (block ``i // block_size``, offset ``i % block_size``) -> (rows float32 ``[k, 576]``,
    zero where invalid, valid ``[k]``). ``-1`` or out-of-range entries are skipped: only
    the listed rows' bytes are read (gathered first, then dequantized), never the rest."""
    flat = _as_bytes(k_cache).reshape(-1, PACKED)
    valid = (idx >= 0) & (idx < flat.shape[0])
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    rows = dequantize_rows(flat.index_select(0, safe))
    return torch.where(valid[:, None], rows, torch.zeros_like(rows)), valid
