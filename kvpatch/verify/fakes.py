"""Torch implementations of the SGLang objects the verified math runs through.

The backend file under test is real; everything it calls to get its indices is
served from here (through ``stubs.REAL``, by attribute name, or set on the
backend and the forward batch by ``side``): the kv-indices kernel, the
KV index translator of 0.5.19+ (a static pool: ids pass through untranslated),
the ``KVLocPlan`` of 0.5.22+, the forward modes and the speculative-decoding
inputs (``generate_attn_arg_prefill``). Each fills its outputs in place where
SGLang's does, since the CUDA-graph replay paths rely on that.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch


class KvIndicesKernel:
    """Torch version of SGLang's create_flashinfer_kv_indices_triton.

    Used as ``kernel[grid](req_to_token, req_pool_indices, paged_kernel_lens,
    kv_indptr, kv_start_idx, kv_indices, req_to_token_stride[, PAGE_SIZE])``.
    It writes into ``kv_indices`` in place, as the Triton kernel does (the
    CUDA-graph replay path relies on that). Host loop: it runs at plan time,
    outside graph capture, where SGLang's kernel runs too.
    """

    def __getitem__(self, grid):
        return self

    def __call__(self, req_to_token, req_pool_indices, page_kernel_lens, kv_indptr,
                 kv_start_idx, kv_indices, req_to_token_stride=None, PAGE_SIZE=1, **_):
        bs = int(page_kernel_lens.numel())
        rows = req_pool_indices[:bs].tolist()
        lens = page_kernel_lens[:bs].tolist()
        starts = kv_indptr[:bs].tolist()
        offs = kv_start_idx[:bs].tolist() if kv_start_idx is not None else [0] * bs
        p = int(PAGE_SIZE)
        for b in range(bs):
            toks = req_to_token[rows[b], offs[b]: offs[b] + lens[b]]
            if p > 1:
                toks = toks[::p] // p
            kv_indices[starts[b]: starts[b] + toks.numel()] = toks.to(kv_indices.dtype)


KV_INDICES_KERNEL = KvIndicesKernel()


class KVLocPlan:
    """0.5.22+: the per-iteration plan of where a batch's KV lives. A static
    pool builds no read table, so the translator reads req_to_token rows."""

    def has_read_table(self, *a, **k):
        return False

    def is_read_by(self, *a, **k):
        return True


class Translator:
    """SGLang's KVIndexTranslator (0.5.19+). With no ``v2p``, a static pool: every
    read is the ``req_to_token`` passthrough. With ``v2p`` (unified memory), the
    request table holds virtual ids and every read stream it packs is translated
    to pool rows, as SGLang's translating reader does (pack_read_stream returns
    True: the ids are physical). One method per name the releases call
    (build_index_table / index_table_for_batch of 0.5.19, fill_packed_read_stream
    of 0.5.20, pack_read_stream / read_source of 0.5.22+)."""

    full_v2p_table = None

    def __init__(self, req_to_token: torch.Tensor, v2p: Optional[torch.Tensor] = None):
        self.req_to_token = req_to_token
        self.v2p = v2p
        self.is_translating = self.reads_are_translated = v2p is not None
        self.translated = 0  # ids translated so far: a unified case that translated none proves nothing

    @property
    def needs_read_translate(self) -> bool:
        return self.is_translating or DCP.size > 1

    def translate(self, ids: torch.Tensor) -> torch.Tensor:
        """Virtual ids -> pool rows (the identity on a static pool)."""
        if self.v2p is None:
            return ids
        self.translated += int(ids.numel())
        return self.v2p[ids.long()].to(ids.dtype)

    def table(self, req_pool_indices):
        """KVIndexTable of the request rows (ids[row_ids[b] * row_stride + j]): the
        passthrough, or under unified memory a read table already translated to
        pool rows (what a translating reader hands the index kernels)."""
        return _IndexTable(self, req_pool_indices)

    def build_index_table(self, *, req_pool_indices, seq_lens=None, **_):
        return self.table(req_pool_indices)

    def index_table_for_batch(self, forward_batch):
        return self.table(forward_batch.req_pool_indices)

    def make_capture_tables(self, **_):
        return None

    def read_source(self, plan=None, *, req_pool_indices, bs=None, **_):
        return self.table(req_pool_indices)

    def read_table(self, plan, **_):
        return self.table(plan.req_pool_indices)

    def pack_read_stream(self, plan=None, *, req_pool_indices, seq_lens, indptr, out,
                         kv_start_idx=None, token_mapping=None, **_):
        if token_mapping is not None:
            raise NotImplementedError("verify fakes: SWA token_mapping is not modelled")
        KV_INDICES_KERNEL(self.req_to_token, req_pool_indices, seq_lens, indptr, kv_start_idx,
                          out)
        if self.v2p is None:
            return False
        n = int(indptr[int(seq_lens.numel())])
        out[:n] = self.translate(out[:n])
        return True

    def fill_packed_read_stream(self, *, req_pool_indices, seq_lens, indptr, out,
                                kv_start_idx=None, **_):
        return self.pack_read_stream(None, req_pool_indices=req_pool_indices,
                                     seq_lens=seq_lens, indptr=indptr, out=out,
                                     kv_start_idx=kv_start_idx)

    def translate_dcp_read_ids(self, ids):
        """Widened read ids -> pool rows: ``// dcp_size`` is the DCP part (0.5.19+)."""
        if DCP.size > 1:
            DCP.translated += int(ids.numel())
            ids = ids // DCP.size
        return self.translate(ids)


class _IndexTable:
    """A KVIndexTable whose ids are translated when a kernel reads them, so that
    a table built and never read (a release that takes no kv_view) counts no
    translation."""

    entry_page_size = 1
    v2p = None

    def __init__(self, translator: Translator, req_pool_indices):
        self._translator = translator
        self.row_ids = req_pool_indices
        self.row_stride = translator.req_to_token.stride(0)
        self.is_translated = translator.v2p is not None

    @property
    def ids(self):
        return self._translator.translate(self._translator.req_to_token)


# --- decode context parallelism (DCP): one rank of DCP.size -----------------------------
# Token position j of a request lives on rank j % size, at the widened id
# row * size + j % size (row: that rank's pool row). A rank's decode plans only
# its own tokens: SGLang's plan_dcp_decode_metadata compacts them in place, and
# turns them into pool rows itself (before 0.5.19) or leaves that to
# translate_dcp_read_ids (0.5.19+, ``planner_translates`` False).


class _Dcp:
    size, rank, planner_translates, translated = 1, 0, True, 0


DCP = _Dcp()


def dcp_local_lens(lens: torch.Tensor) -> torch.Tensor:
    """Tokens of each request on this rank: len // size + (rank < len % size)."""
    return lens // DCP.size + (DCP.rank < lens % DCP.size).to(lens.dtype)


def update_local_kv_lens_for_dcp(kv_len_arr):
    if DCP.size > 1:
        kv_len_arr.copy_(dcp_local_lens(kv_len_arr))


def plan_dcp_decode_metadata(kv_lens, kv_indptr, kv_indices, init_metadata_replay=False,
                             fast_decode_kwargs=None, bs=None, *_, **__):
    """Shard a decode batch's kv_indices to this rank in place (host loop, at plan
    time as SGLang's runs); kv_lens and kv_indptr become the per-rank ones."""
    bs = int(kv_lens.numel()) if bs is None else int(bs)
    local = dcp_local_lens(kv_lens[:bs].clone())
    starts = kv_indptr[: bs + 1].tolist()
    parts = [kv_indices[starts[b]: starts[b + 1]][DCP.rank:: DCP.size] for b in range(bs)]
    ids = torch.cat(parts) if parts else kv_indices[:0]
    if DCP.planner_translates:
        ids = ids // DCP.size
        DCP.translated += int(ids.numel())
    n = int(ids.numel())
    kv_indices[:n] = ids
    kv_lens[:bs].copy_(local)
    kv_indptr[1: bs + 1] = torch.cumsum(local, dim=0).to(kv_indptr.dtype)
    return n


class SpecInputType(enum.IntEnum):
    """sglang.srt.speculative.spec_info.SpecInputType (members of 0.5.23): the
    backend compares against DFLASH_VERIFY, so it must be a real enum here."""

    EAGLE_DRAFT = enum.auto()
    EAGLE_DRAFT_EXTEND = enum.auto()
    EAGLE_VERIFY = enum.auto()
    FROZEN_KV_MTP_DRAFT = enum.auto()
    FROZEN_KV_MTP_VERIFY = enum.auto()
    DFLASH_DRAFT = enum.auto()
    DFLASH_VERIFY = enum.auto()
    NGRAM_VERIFY = enum.auto()


class SpecInput:
    """Base of the speculative inputs (the backend asserts isinstance on it)."""

    spec_input_type: Optional[SpecInputType] = None
    custom_mask = None
    ragged_verify_layout = None
    topk = 1

    def __init__(self, req_to_token: torch.Tensor, tokens: int):
        self.req_to_token = req_to_token
        self.draft_token_num = self.num_tokens_per_req = tokens
        self.calls = []  # which SGLang hooks ran: the case says which path it verified

    def is_draft_input(self):
        return False

    def is_verify_input(self):
        return False

    def _indices(self, req_pool_indices, kv_lens, out=None, translator=None):
        bs = int(kv_lens.numel())
        indptr = torch.zeros((bs + 1,), dtype=torch.int32, device=req_pool_indices.device)
        indptr[1:] = torch.cumsum(kv_lens, dim=0)
        if out is None:
            out = torch.empty((int(kv_lens.sum()),), dtype=torch.int32,
                              device=req_pool_indices.device)
        KV_INDICES_KERNEL(self.req_to_token, req_pool_indices, kv_lens, indptr, None, out)
        if translator is not None and translator.v2p is not None:  # 0.5.19+: through the translator
            n = int(indptr[-1])
            out[:n] = translator.translate(out[:n])
        return out, indptr


class EagleVerifyInput(SpecInput):
    """Target verify of EAGLE / MTP (topk 1: no custom mask) or DFLASH: the kernel
    reads each request's prefix plus its draft_token_num draft tokens."""

    spec_input_type = SpecInputType.EAGLE_VERIFY

    def __init__(self, req_to_token, tokens, dflash=False):
        super().__init__(req_to_token, tokens)
        if dflash:
            self.spec_input_type = SpecInputType.DFLASH_VERIFY

    def is_verify_input(self):
        return True

    def generate_attn_arg_prefill(self, req_pool_indices, paged_kernel_lens,
                                  paged_kernel_lens_sum=None, req_to_token=None, *,
                                  kv_indices_buf=None, kv_start_idx=None, translator=None, **_):
        # Old releases pass req_to_token positionally, new ones translator= and
        # plan=: the rows are the same req_to_token rows either way.
        self.calls.append("generate_attn_arg_prefill"
                          + ("(kv_indices_buf=)" if kv_indices_buf is not None else ""))
        if kv_start_idx is not None:
            raise NotImplementedError("verify fakes: kv_start_idx is not modelled")
        n = self.draft_token_num
        bs = int(req_pool_indices.numel())
        qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32,
                                 device=req_pool_indices.device)
        kv_indices, kv_indptr = self._indices(req_pool_indices, paged_kernel_lens + n,
                                              out=kv_indices_buf, translator=translator)
        return kv_indices, kv_indptr, qo_indptr, self.custom_mask


class EagleDraftInput(SpecInput):
    """Draft extend: each request appends accept_length (here num_tokens_per_req)
    tokens and attends to its whole sequence, seq_lens included them."""

    spec_input_type = SpecInputType.EAGLE_DRAFT_EXTEND

    def __init__(self, req_to_token, tokens, bs, device):
        super().__init__(req_to_token, tokens)
        self.accept_length = torch.full((bs,), tokens, dtype=torch.int32, device=device)

    def is_draft_input(self):
        return True

    def generate_attn_arg_prefill(self, req_pool_indices, paged_kernel_lens,
                                  paged_kernel_lens_sum=None, req_to_token=None, translator=None, **_):
        self.calls.append("generate_attn_arg_prefill")
        bs = int(self.accept_length.numel())
        qo_indptr = torch.zeros((bs + 1,), dtype=torch.int32, device=req_pool_indices.device)
        qo_indptr[1:] = torch.cumsum(self.accept_length, dim=0)
        kv_indices, kv_indptr = self._indices(req_pool_indices, paged_kernel_lens, translator=translator)
        return kv_indices, kv_indptr, qo_indptr, None


# The forward modes a case can run in, with what ForwardMode.is_* answers for
# each (SGLang: TARGET_VERIFY is an extend; DRAFT_EXTEND(_V2) is not, unless
# asked with include_draft_extend_v2).
DECODE, EXTEND, TARGET_VERIFY, DRAFT_EXTEND = "decode", "extend", "target_verify", "draft_extend"
_MODE_TRUE = {
    DECODE: {"is_decode", "is_decode_or_idle"},
    EXTEND: {"is_extend", "is_extend_or_draft_extend_or_mixed"},
    TARGET_VERIFY: {"is_target_verify", "is_extend"},
    # Both generations of draft extend: a release asks is_draft_extend() (v1, through
    # spec_info) or is_draft_extend_v2() (the host-array extend path of 0.5.2x).
    DRAFT_EXTEND: {"is_draft_extend", "is_draft_extend_v2"},
}


class Mode:
    """ForwardMode as the verified paths query it."""

    def __init__(self, kind: str):
        if kind not in _MODE_TRUE:
            raise ValueError(f"unknown forward mode {kind!r}")
        self.kind = kind

    def __getattr__(self, attr):
        if attr.startswith("is_"):
            answer = attr in _MODE_TRUE[self.kind]
            return lambda *a, **k: answer
        raise AttributeError(attr)

    def __repr__(self):
        return f"<ForwardMode {self.kind}>"
