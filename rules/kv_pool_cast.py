"""KVP201 kv-pool-cast: report every cast of a KV-cache buffer.

The catch-all: it decides each KV-buffer cast that no fixing rule rewrote, so
that every `.to(` of a KV buffer shows up in `audit` with a status and a
reason: hot (a whole layer pool is cast; which consumer, and what a rewrite
would need), unsupported (the data flow hides what the kernel reads),
gathered (only indexed rows are cast), or fixed-upstream.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.analysis.classify import dead_result
from kvpatch.analysis.helpers import SPARSE_KERNELS, HelperPath, follow
from kvpatch.analysis.match import Consumer, UnitContext, consumer_names, describe, is_mla_run
from kvpatch.analysis.tensorops import PAGED_KEYWORDS
from kvpatch.rule import Decision, Invalid, Rule, Upstream, Valid
from kvpatch.sites import FIXED_UPSTREAM, GATHERED, HOT, UNSUPPORTED


def paged_keyword(c: Consumer) -> str:
    if c.call is None:
        return ""
    for a in c.call.args:
        if a.keyword is not None and a.keyword.value in PAGED_KEYWORDS:
            return a.keyword.value
    return ""


class KvPoolCast(Rule):
    ID = "KVP201"
    NAME = "kv-pool-cast"
    SUMMARY = "Every cast of a KV-cache buffer, with its status and the reason"
    KIND = "cast"
    PRIORITY = 90
    FALLBACK = True  # decides every KV-buffer cast no other rule claimed
    CHECKED_ON = ("sglang 2e4babdb0 (2025-05-15)", "sglang 3cc3d9b95 (2025-08-21)",
                  "sglang eae59b337 (2025-11-14)", "sglang c5251a98a (2026-05-21)",
                  "sglang ea8f4e9f3 (2026-06-26)", "sglang 4ad990ba7 (2026-08-06)")

    VALID = (
        Valid(
            """
def forward_decode(self, q, layer, forward_batch):
    kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    rows = kv[forward_batch.kv_indices].to(q.dtype)
    return self.kernel(q, rows)
""",
            why="gathered before the cast: only the indexed rows are cast",
        ),
        Valid(
            """
def forward_decode(self, q, layer, forward_batch):
    kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    q = q.to(kv_cache.dtype)
    kv = kv_cache.to(q.dtype)
    return self.kernel(q, kv[forward_batch.kv_indices])
""",
            why="q is cast to the pool dtype on every path first: the pool cast is a no-op",
        ),
        Valid(
            """
def forward_extend(self, q, layer, forward_batch):
    # k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
    k_buf = forward_batch.attn_dcp_metadata.dcp_kv_buffer.to(q.dtype)
    return self.kernel(q, k_buf)
""",
            why="a commented-out copy, and a cast of a compact DCP buffer: neither is a pool",
        ),
        Valid(
            """
def forward_decode(self, q, layer, forward_batch):
    k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    return cutlass_mla_decode(q, k_cache.view(-1, 64, 576), forward_batch.seq_lens)
""",
            why="the kernel reads the FP8 pool itself: no cast at all",
        ),
        Valid(
            """
def forward_decode(self, q, layer, forward_batch):
    rows = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[forward_batch.kv_indices].to(q.dtype)
    rows = None
    return self.kernel(q, forward_batch.kv_indices)
""",
            why="a dead store of gathered rows: wasted, but never a pool-wide cast",
        ),
    )

    INVALID = (
        Invalid(
            """
class FlashAttentionBackend:
    def forward_decode(self, q, k, v, layer, forward_batch):
        if self.kv_cache_dtype_str != "auto" and layer.head_dim <= 256:
            q = q.to(self.kv_cache_dtype)
        kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        c_kv = kv_cache[:, :, : layer.v_head_dim]
        return flash_attn_with_kvcache(
            q=q, k_cache=kv_cache, v_cache=c_kv, page_table=self.forward_metadata.page_table
        )
""",
            status=HOT,
            why="FA3 absorbed MLA: the earlier q cast is guarded; consumed through page_table",
        ),
        Invalid(
            """
class NpuBackend:
    def _kv(self, layer):
        return self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(self.input_dtype)
""",
            status=UNSUPPORTED,
            why="the cast escapes through return: what the kernel reads is decided elsewhere",
        ),
        Invalid(
            """
def forward(self, q, layer, forward_batch, dcp):
    if dcp:
        buf = forward_batch.dcp_buffer
    else:
        buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
    buf = buf.to(q.dtype)
    return self.kernel(q, buf)
""",
            status=UNSUPPORTED,
            why="the cast input is the pool on one path and another buffer on the other",
        ),
        Invalid(
            """
def forward_extend(self, q, layer, forward_batch):
    k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    if self.kv_cache_dtype == fp8_dtype:
        k_cache = k_cache.to(q.dtype)
        v_cache = v_cache.to(q.dtype)
    return mha_varlen_fwd(q, k_cache, v_cache, block_table=forward_batch.block_table)
""",
            status=HOT,
            why="an MHA pool read as a (k, v) tuple, both halves cast under a guard",
        ),
        Invalid(
            """
class AiterAttnBackend:
    def forward_decode(self, q, layer, forward_batch):
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return mla_decode_fwd(q, k_buffer.shape[0], self.kv_indptr, self.kv_indices)
""",
            status=HOT,
            why="a dead store read only for its shape: still casts the whole pool (KVP104 deletes unread ones)",
        ),
    )

    def fixed_upstream(self, call: cst.Call, ctx: UnitContext) -> Optional[Upstream]:
        # The FP8 pool handed to an MLA kernel with no cast anywhere on its way.
        if not ctx.file.module.uses_mla_wrapper:
            return None
        runs = [c for c in ctx.consumers(call) if is_mla_run(c)]
        if not runs:
            return None
        return Upstream(call, consumer_names(runs, ctx),
                        "no cast: the pool reaches the MLA kernel as stored, which reads the KV-cache dtype "
                        "itself (an upstream fix, or SGLang before the May 2025 cast): nothing to rewrite")

    def decide(self, cand: CastCandidate, ctx: UnitContext) -> Decision:
        kind = cand.origin.kind
        kernels = consumer_names(cand.consumers, ctx)
        if kind == "gathered":
            if any(is_mla_run(c) for c in cand.consumers):
                return Decision(FIXED_UPSTREAM, "the buffer is gathered before the cast: the MLA kernel's "
                                                "rows are cast, not the pool (fixed upstream)")
            return Decision(GATHERED, "gathered before the cast: only the indexed rows are cast")
        if kind == "mixed":
            others = [f"`{ctx.code(d.stmt)}` (line {ctx.line(d.stmt)})" for d, _ in cand.origin.others if d.stmt is not None]
            return Decision(UNSUPPORTED, "the cast input is a KV pool on some paths and another value on others"
                            + (f" ({', '.join(others[:2])})" if others else "")
                            + ": rewriting it could gather from the wrong buffer")
        guard = f" {cand.guard_note}." if cand.guard_note else ""
        dead = dead_result(cand.call, cand.consumers, ctx)
        if dead:
            return Decision(HOT, f"full-pool cast that is a dead store: {dead}. It still casts the whole layer "
                                 f"pool on every call, for nothing: a rewrite needs the read taken from the "
                                 f"uncast pool, then the cast deleted.{guard}")
        escapes = [c for c in cand.consumers if c.kind in ("return", "yield", "store", "unknown")]
        if escapes:
            return Decision(UNSUPPORTED, f"full-pool cast whose result escapes through {describe(escapes[0], ctx)}: "
                                         f"the kernel and the rows it reads are not visible in this function.{guard}")
        if cand.form.kind != "to":
            return Decision(HOT, f"full-pool `.{cand.form.method}()` cast consumed by {kernels}; no rule rewrites "
                                 f"this cast form.{guard}")
        if not cand.consumers:
            return Decision(HOT, f"full-pool cast; no consumer found in this function.{guard}")
        return Decision(HOT, f"full-pool cast consumed by {kernels}: {needs(cand.consumers, ctx)}.{guard}")


def _own_method(c: Consumer) -> bool:
    """`self.<method>(...)`: a helper of the same class, not a kernel."""
    f = c.call.func if c.call is not None else None
    return isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and f.value.value == "self"


def needs(consumers, ctx: UnitContext) -> str:
    """What a rewrite would need, per kind of consumer (one clause each)."""
    paged, helpers, other = [], [], []
    for c in consumers:
        name = describe(c, ctx)
        kw = "" if _own_method(c) else paged_keyword(c)
        group = (helpers if _own_method(c) else paged if kw else other)
        item = f"{name} (`{kw}=`)" if kw else name
        if item not in group:
            group.append(item)
    out = []
    if paged:
        out.append(f"{', '.join(paged)} {'takes' if len(paged) == 1 else 'take'} the cache with a page table but no lengths argument kvpatch can bind "
                   f"(it binds flash_attn_with_kvcache's `cache_seqlens=`, unified_attention's `seqused_k=` and "
                   f"the signatures of sgl-kernel's flash_mla_* and aiter's paged_attention_ragged): a rewrite "
                   f"needs the argument that bounds the pages each request reads, proven equal at the cast")
    if helpers:
        paths = helper_paths(consumers, ctx)
        if all(p.sparse for p in paths):
            need = ("every one reaches a kernel whose rows kvpatch knows (the index argument named above); a "
                    "rewrite needs the gathered cast moved next to each kernel (or those indices passed up and "
                    "proven equal at the cast): kvpatch does not rewrite across methods yet")
        else:
            need = ("a rewrite needs every helper followed to a kernel whose rows kvpatch knows, each kernel's "
                    "index structure then cast next to it or passed up and proven equal at the cast")
        out.append(f"{', '.join(helpers)} {'is a method' if len(helpers) == 1 else 'are methods'} of this class, "
                   f"followed into: {'; '.join(p.describe() for p in paths)}: {need}")
    known = [describe(c, ctx) for c in consumers if not _own_method(c) and _indexed(c)]
    known = [k for k in dict.fromkeys(known) if k in other]
    if known:
        out.append(f"{', '.join(known)} {'reads' if len(known) == 1 else 'read'} only the rows of its index "
                   f"argument ({'; '.join(SPARSE_KERNELS[k.strip('`')][2] for k in known)}): a rewrite needs that "
                   f"row cast next to the call")
        other = [o for o in other if o not in known]
    if other:
        out.append(f"{', '.join(other)} {'takes' if len(other) == 1 else 'take'} the whole cast pool with no index "
                   f"structure kvpatch knows (the kv_indices of a planned wrapper, a page table with its lengths, "
                   f"or a ragged kv_indptr/kv_indices list): a rewrite needs the kernel's row contract")
    return "; ".join(out)


def _indexed(c: Consumer) -> bool:
    """A call of a kernel with a known row contract, handed its index argument."""
    f = c.call.func if c.call is not None else None
    name = f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else ""
    if name not in SPARSE_KERNELS:
        return False
    ipos, ikw = SPARSE_KERNELS[name][1]
    plain = [a for a in c.call.args if a.keyword is None and not a.star]
    return any(a.keyword is not None and a.keyword.value == ikw for a in c.call.args) or (
        ipos is not None and len(plain) > ipos)


def helper_paths(consumers, ctx: UnitContext):
    """Each `self.<helper>(...)` consumer followed into the helper (analysis/helpers.py)."""
    facts = ctx.class_facts
    out = []
    for c in consumers:
        if not _own_method(c):
            continue
        arg = c.call.args[c.arg_index] if c.arg_index is not None and c.arg_index < len(c.call.args) else None
        keyword = arg.keyword.value if arg is not None and arg.keyword is not None else c.keyword
        starred = arg is not None and arg.star != ""
        index = (sum(1 for a in c.call.args[: c.arg_index] if a.keyword is None)
                 if arg is not None and keyword is None else None)
        path = follow(c.call.func.attr.value, index, keyword, starred, facts, ctx.file.classes)
        if path.method not in [p.method for p in out]:
            out.append(path)
    return out


__all__ = ["HelperPath", "KvPoolCast", "helper_paths", "needs", "paged_keyword"]
