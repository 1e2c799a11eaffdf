"""The world both sides of a verify share: shapes, the FP8 pool, the request table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

FP8 = torch.float8_e4m3fn
Q_DTYPE = torch.bfloat16
KV_LORA, ROPE, QK_NOPE = 512, 64, 128
HEAD_DIM = KV_LORA + ROPE
SM_SCALE = 1.0 / math.sqrt(QK_NOPE + ROPE)
# FlashInfer's own FP8 MLA tests compare against a bf16 reference at 1e-2..2e-2.
NATIVE_ATOL = 2e-2
NATIVE_RTOL = 2e-2


class HarnessError(Exception):
    """The harness could not drive this file (not a verdict on the patch)."""


# --- shapes ------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeShape:
    bs: int
    max_len: int
    heads: int = 16


@dataclass(frozen=True)
class PrefillShape:
    prefix: Tuple[int, ...]
    extend: Tuple[int, ...]
    heads: int = 16


@dataclass(frozen=True)
class SpecShape:
    """A speculative-decoding batch: target verify reads each request's prefix plus
    its ``tokens`` draft tokens; draft extend appends ``tokens`` accepted tokens."""

    bs: int
    max_prefix: int
    tokens: int = 4
    heads: int = 16


@dataclass
class Shapes:
    pool_slots: int
    decode: List[DecodeShape]
    prefill: List[PrefillShape]
    seed: int = 0
    spec: List[SpecShape] = field(default_factory=list)
    # Unified memory (0.5.19+ KV index translator): request tables hold virtual
    # ids and the translator maps them to pool rows through a permutation, so
    # the kernel reads rows that req_to_token never names.
    unified: bool = False
    # Decode context parallelism: verify as rank dcp_rank of dcp ranks (decode only:
    # under DCP prefill reads its own gathered buffer and speculative plans are off).
    dcp: int = 1
    dcp_rank: int = 0


CPU_SHAPES = Shapes(
    4096,
    decode=[DecodeShape(1, 37, 16), DecodeShape(3, 300, 16), DecodeShape(4, 257, 16)],
    prefill=[PrefillShape((100, 0), (20, 13), 16), PrefillShape((37,), (64,), 32),
             PrefillShape((250, 5, 1), (3, 40, 1), 64), PrefillShape((64, 17), (16, 9), 128)],
    spec=[SpecShape(1, 40, 2, 16), SpecShape(3, 200, 4, 64)],
)
QUICK_SHAPES = Shapes(
    4096,
    decode=[DecodeShape(1, 37, 16), DecodeShape(3, 300, 16)],
    prefill=[PrefillShape((100, 0), (20, 13), 16), PrefillShape((64,), (16,), 128)],
    spec=[SpecShape(2, 60, 4, 16)],
)
GPU_SHAPES = Shapes(
    65536,
    decode=[DecodeShape(1, 1024, 16), DecodeShape(8, 2048, 16), DecodeShape(16, 777, 128)],
    prefill=[PrefillShape((512, 0), (128, 77), 16), PrefillShape((300,), (64,), 32),
             PrefillShape((1000, 3), (31, 200), 64), PrefillShape((256, 128), (64, 64), 128)],
    spec=[SpecShape(8, 1024, 4, 16), SpecShape(16, 512, 8, 128)],
)
# gpu/verify_real.py: production-sized pool and batches.
BIG_SHAPES = Shapes(
    495_552,
    decode=[DecodeShape(1, 4096, 16), DecodeShape(32, 4096, 16), DecodeShape(128, 2048, 16),
            DecodeShape(32, 4096, 128)],
    prefill=[PrefillShape((1024, 1024), (256, 256), h) for h in (16, 32, 64, 128)],
    spec=[SpecShape(32, 4096, 4, 16), SpecShape(32, 2048, 8, 128)],
)


# --- the world both sides share: pool and request table ------------------------


class Pool:
    """SGLang's MLATokenToKVPool as the forward paths see it (FP8 in uint8 storage)."""

    def __init__(self, store: torch.Tensor):
        self.kv_buffer = [store]
        self.store_dtype, self.dtype = torch.uint8, FP8

    def get_key_buffer(self, layer_id):
        return self.kv_buffer[layer_id].view(self.dtype)

    def get_value_buffer(self, layer_id):
        return self.get_key_buffer(layer_id)[..., :KV_LORA]

    def get_kv_buffer(self, layer_id):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_mla_kv_buffer(self, *a, **k):  # the harness passes k=None: never called
        raise HarnessError("set_mla_kv_buffer called: the harness does not save KV")

    set_kv_buffer = set_mla_kv_buffer


@dataclass
class Batch:
    seq_lens: List[int]
    prefix: List[int]
    req_pool_indices: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    label: str

    @property
    def extend(self):
        return [s - p for s, p in zip(self.seq_lens, self.prefix)]


class World:
    def __init__(self, shapes: Shapes, device: torch.device):
        self.device = device
        self.slots = shapes.pool_slots
        self.gen = torch.Generator(device=device).manual_seed(shapes.seed)
        lens = ([s.max_len for s in shapes.decode]
                + [p + e for s in shapes.prefill for p, e in zip(s.prefix, s.extend)]
                + [s.max_prefix + s.tokens for s in shapes.spec])
        self.max_ctx = max(lens + [1]) + 8
        self.max_reqs = 2 * max([s.bs for s in shapes.decode + shapes.spec]
                                + [len(s.prefix) for s in shapes.prefill] + [1]) + 2
        vals = torch.randn((self.slots, 1, HEAD_DIM), generator=self.gen, device=device)
        # FP8 values in SGLang's uint8 storage; all finite, so any NaN in an
        # output comes from a poisoned (never gathered) shadow row.
        self.store = vals.to(FP8).view(torch.uint8)
        del vals
        self.pool = Pool(self.store)
        self.req_to_token = torch.zeros((self.max_reqs, self.max_ctx), dtype=torch.int32,
                                        device=device)
        self.v2p: Optional[torch.Tensor] = None  # virtual id -> pool row; slot 0 stays 0
        self.dcp = shapes.dcp
        if shapes.dcp > 1 and shapes.unified:
            raise HarnessError("verify models DCP and unified memory one at a time")
        if shapes.unified:
            perm = torch.randperm(self.slots - 1, generator=self.gen, device=device) + 1
            self.v2p = torch.cat([torch.zeros((1,), dtype=perm.dtype, device=device), perm]).to(torch.int32)

    def pool_ptr(self) -> int:
        return self.store.untyped_storage().data_ptr()

    def randint(self, lo, hi, n):
        return torch.randint(lo, hi + 1, (n,), generator=self.gen, device=self.device).tolist()

    def batch(self, seq_lens: Sequence[int], heads: int, prefix: Optional[Sequence[int]] = None,
              label: str = "") -> Batch:
        """Requests on random rows of req_to_token, tokens on scattered pool slots.

        Without ``prefix`` it is a decode batch: one query per request (its last token).
        """
        seq_lens = [int(x) for x in seq_lens]
        prefix = [s - 1 for s in seq_lens] if prefix is None else [int(x) for x in prefix]
        bs, total = len(seq_lens), sum(seq_lens)
        if total >= self.slots:
            raise HarnessError(f"batch of {total} tokens does not fit a pool of {self.slots}")
        g, d = self.gen, self.device
        slots = torch.randperm(self.slots - 1, generator=g, device=d)[:total].to(torch.int32) + 1
        rows = torch.randperm(self.max_reqs, generator=g, device=d)[:bs]
        off = 0
        for r, n in zip(rows.tolist(), seq_lens):
            ids = slots[off: off + n]
            if self.dcp > 1:  # widened: position j on rank j % dcp, at row * dcp + j % dcp
                ids = ids * self.dcp + torch.arange(n, device=d, dtype=ids.dtype) % self.dcp
            self.req_to_token[r, :n] = ids
            off += n
        nq = sum(s - p for s, p in zip(seq_lens, prefix))
        q_nope = torch.randn((nq, heads, KV_LORA), generator=g, device=d).to(Q_DTYPE)
        q_pe = torch.randn((nq, heads, ROPE), generator=g, device=d).to(Q_DTYPE)
        return Batch(seq_lens, prefix, rows.to(torch.int64), q_nope, q_pe, label)

