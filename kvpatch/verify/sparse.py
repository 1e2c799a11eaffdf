"""Verify the sparse helper family (KVP105): NSA/DSA's pool cast handed to ``self._forward_*``.

NSA's ``forward_extend`` casts the whole pool and hands it to helper methods of its class
(``_forward_flashmla_sparse``, ``_forward_flashmla_kv``, ``_forward_tilelang``,
``_forward_fa3``; and ``dequantize_k_cache_paged`` inline), each calling a kernel told its
rows. KVP105 defers the cast (``kv_rows_deferred``) and casts each kernel's rows next to it
(``kv_rows_at_kernel``). Both sides (the checkout's original file and its patched one) run
their own ``forward_extend`` and ``forward_decode`` on one random FP8 pool, every
implementation the forwards switch on (``self.nsa_prefill_impl == "..."`` or, before
2025-11, a module constant such as ``NSA_PREFILL_IMPL``), with ``sparse_reference`` and
``fa3_reference`` standing in for the kernels (sgl-kernel's FlashMLA, tilelang and FA3 need
an SM90 GPU with sgl-kernel). The metadata is built as ``init_forward_metadata`` leaves
it: per-request pool slots (``page_table_1``) with stale entries past each length, top-k
positions per query token (causal, ``-1`` past the valid ones) that the backend's own
index transform turns into slots, and for the RAGGED top-k (an FP8 store) the flattened
table and offsets that ``dequantize_k_cache_paged`` reads. The deferred buffer is poisoned
(NaN) before every patched call, so a row a kernel reads but its wrapper did not cast
shows; outputs must be bit-identical; a full-pool copy in the patched run fails
(``FullPoolGuard``). Decode casts nothing in the original (a BF16 store reaches the
kernels as is): it runs on a BF16 pool, and the wrappers must pass it through untouched.
The FP8-compute path (the module constant ``NSA_FLASHMLA_BACKEND_DECODE_COMPUTE_FP8``,
whatever ``*COMPUTE_FP8*`` name the file reads) runs too, for every kernel path that reached
``flash_mla_with_kvcache``: the constant is set on both sides, the helper quantizes the cache
it got (``quantize_k_cache``, the row-wise step KVP105 wraps) into FlashMLA's 656-byte
packed rows, and the FP8 kernel reads them through ``indices`` (``fp8_packed_reference``).
In extend the quantized buffer is the deferred one, so a row the wrapper left uncast
quantizes to NaN and shows. In decode the original itself quantizes the whole BF16 store
(upstream's "inefficiently quantize the whole cache"): the patched run may copy the pool
exactly as the original does, and no more.
A rewritten kernel call no passing case reached is listed as not verified, with why.
"""

from __future__ import annotations

import ast
import os
import types
from collections import Counter
from functools import wraps

import torch

from kvpatch.analysis.helpers import ROW_WISE, SPARSE_KERNELS
from kvpatch.names import MODE_ENV, MODE_FUSED, MODE_GATHER, MODE_NATIVE, RUNTIME_ALIAS

from . import sparse_reference as ref
from .fa3 import FA3Side, FA3Verifier, Layer, Meta, load_target
from .fakes import DECODE, EXTEND, Mode
from .judge import FullPoolGuard
from .report import CaseResult
from .side import ForwardBatch, call_bound
from .targets import FA3_KERNEL, FORWARDS
from .world import HEAD_DIM, KV_LORA, Q_DTYPE, ROPE, SM_SCALE, HarnessError

KERNEL_NAME = ref.KERNEL_NAME
WRAP = "kv_rows_at_kernel"  # the runtime's per-kernel cast (KVP105's EMITS[1])
HEADS, TOPK, PAGE = 16, 64, 64  # FlashMLA's sparse decode reads pages of 64 slots
# (prefix lens, extend lens) per prefill case; context lengths per decode case. Contexts
# longer than TOPK make the top-k a real selection: most of the pool is read by nobody.
EXTEND_CASES = (([0], [40]), ([100, 0, 7], [20, 13, 1]), ([150, 30], [5, 9]))
DECODE_CASES = ([37], [300, 5, 129])
STORE_FP8 = "store_fp8"  # nsa_kv_cache_store_fp8: RAGGED top-k, dequantize_k_cache_paged inline
COMPUTE_FP8 = "compute_fp8"  # the *COMPUTE_FP8 module constant on: quantize_k_cache + FP8 FlashMLA
MODELLED = frozenset(SPARSE_KERNELS)  # every kernel KVP105 wraps has a reference here


def impl_switches(source: str, cls_name: str):
    """{forward: {impl: (where, name)}}: the string a forward compares to pick its kernel path,
    and what holds it: ("self", attr) or ("module", constant)."""
    out = {f: {} for f in FORWARDS}
    for cls in ast.parse(source).body:
        if isinstance(cls, ast.ClassDef) and cls.name == cls_name:
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in FORWARDS:
                    for n in ast.walk(fn):
                        if (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.Eq)
                                and isinstance(n.comparators[0], ast.Constant)
                                and isinstance(n.comparators[0].value, str)):
                            left, value = n.left, n.comparators[0].value
                            if (isinstance(left, ast.Attribute) and isinstance(left.value, ast.Name)
                                    and left.value.id == "self" and "impl" in left.attr):
                                out[fn.name].setdefault(value, ("self", left.attr))
                            elif isinstance(left, ast.Name) and "IMPL" in left.id:
                                out[fn.name].setdefault(value, ("module", left.id))
    return out


def compute_fp8_flag(source: str):
    """The module-level name the file reads to pick FlashMLA's FP8 compute
    (``NSA_FLASHMLA_BACKEND_DECODE_COMPUTE_FP8``), or None: the name it imports or binds
    that has COMPUTE_FP8 in it. Two such names: None (which one gates what is unknown)."""
    names = set()
    for n in ast.parse(source).body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name for a in n.names if "COMPUTE_FP8" in (a.asname or a.name)}
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name) and "COMPUTE_FP8" in t.id}
    return next(iter(names)) if len(names) == 1 else None


def wrapped_kernels(source: str, cls_name: str):
    """(method, kernel) of every call of the class whose argument the rewrite wrapped in WRAP."""
    points = []
    for cls in ast.parse(source).body:
        if isinstance(cls, ast.ClassDef) and cls.name == cls_name:
            for fn in cls.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                for n in ast.walk(fn):
                    name = getattr(n.func, "attr", getattr(n.func, "id", "")) if isinstance(n, ast.Call) else ""
                    if name and name != WRAP and any(
                            isinstance(a, ast.Call) and getattr(a.func, "attr", "") == WRAP
                            and getattr(a.func.value, "id", "") == RUNTIME_ALIAS
                            for a in [*n.args, *(k.value for k in n.keywords)]):
                        points.append((fn.name, name))
    return points


class Pool:
    """The MLA pool as NSA reads it: one [slots, 1, 576] buffer per layer."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf

    def get_key_buffer(self, layer_id):
        return self.buf

    def set_mla_kv_buffer(self, *a, **k):
        raise HarnessError("set_mla_kv_buffer called: the sparse verify cases pass k=None")

    def pool_ptr(self) -> int:
        return self.buf.untyped_storage().data_ptr()


class Case:
    """One batch: per-request slots, per-token top-k positions, queries; one kernel path."""

    def __init__(self, gen, dev, pool, slots, prefix, extend, impl, store_fp8=False, compute_fp8=False):
        self.pool, self.impl, self.store_fp8, self.compute_fp8 = pool, impl, store_fp8, compute_fp8
        self.prefix, self.extend = list(prefix), list(extend)
        self.lens = [p + e for p, e in zip(prefix, extend)]
        width = max(self.lens) + 4
        table = torch.randint(1, slots, (len(self.lens), width), generator=gen, device=dev)  # stale past len
        used = torch.randperm(slots - 1, generator=gen, device=dev) + 1
        off = 0
        for b, n in enumerate(self.lens):
            table[b, :n] = used[off: off + n]
            off += n
        self.table = table.to(torch.int32)
        topk, offsets, nvalid = [], [], []
        for b, (p, e) in enumerate(zip(prefix, extend)):
            for pos in range(p, p + e):  # causal: a token selects among positions <= its own
                k = min(pos + 1, TOPK)
                row = torch.full((TOPK,), -1, dtype=torch.int32, device=dev)
                row[:k] = torch.randperm(pos + 1, generator=gen, device=dev)[:k].to(torch.int32)
                topk.append(row)
                offsets.append(sum(self.lens[:b]))
                nvalid.append(k)
        self.topk = torch.stack(topk)
        t = len(nvalid)
        nv = torch.tensor(nvalid, dtype=torch.int32, device=dev)
        self.meta_fields = dict(
            page_table_1=self.table, nsa_extend_seq_lens_list=self.extend,
            page_table_1_flattened=torch.cat([self.table[b, :n] for b, n in enumerate(self.lens)]),
            topk_indices_offset=torch.tensor(offsets, dtype=torch.int32, device=dev),
            nsa_cache_seqlens_int32=nv, nsa_cu_seqlens_q=torch.arange(t + 1, dtype=torch.int32, device=dev),
            nsa_cu_seqlens_k=torch.cat([nv.new_zeros(1), nv.cumsum(0).to(torch.int32)]), nsa_max_seqlen_q=1,
            flashmla_metadata=Meta())
        self.q_nope = torch.randn((t, HEADS, KV_LORA), generator=gen, device=dev).to(Q_DTYPE)
        self.q_pe = torch.randn((t, HEADS, ROPE), generator=gen, device=dev).to(Q_DTYPE)

    def label(self):
        return f"kv_lens={self.lens} q_lens={self.extend} topk={TOPK}"


class SparseSide(FA3Side):
    def __init__(self, name, module, filename, source, pool, device, rel, cls_name, switches):
        super().__init__(name, module, filename, source, pool, device, rel, cls_name)
        self.switches, self.entered = switches, set()
        self.fp8_flag = compute_fp8_flag(source)
        b = self.backend
        b.__dict__.update(use_mha=False, nsa_kv_cache_store_fp8=False, real_page_size=PAGE, kv_cache_dim=HEAD_DIM,
                          device_sm_major=9, nsa_index_topk=TOPK, num_q_heads=HEADS, num_splits=0)
        called = {m for m, _ in wrapped_kernels(source, cls_name)} - set(FORWARDS)
        for m in called:  # record which helpers a run entered (coverage, not behaviour)
            fn = getattr(type(b), m, None)
            if callable(fn):
                b.__dict__[m] = self._recording(m, getattr(b, m))

    def _recording(self, name, bound):
        @wraps(bound)
        def helper(*a, **k):
            self.entered.add(name)
            return bound(*a, **k)
        return helper

    def forward(self, kind: str, case: Case, meta=None, q_nope=None, q_pe=None):
        b, fwd = self.backend, "forward_decode" if kind == DECODE else "forward_extend"
        where = self.switches[fwd].get(case.impl)
        if where is None:
            raise HarnessError(f"{self.cls_name}.{fwd} has no {case.impl!r} path")
        setattr(b if where[0] == "self" else self.module, where[1], case.impl)
        if self.fp8_flag:  # set on every case: off unless the case is the FP8-compute one
            setattr(self.module, self.fp8_flag, case.compute_fp8)
        elif case.compute_fp8:
            raise HarnessError(f"{self.cls_name}: no single *COMPUTE_FP8 module constant to switch FP8 compute on")
        b.nsa_kv_cache_store_fp8, b.token_to_kv_pool = case.store_fp8, case.pool
        b.forward_metadata = Meta(**case.meta_fields)
        layer = Layer(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=1, tp_v_head_num=1, head_dim=HEAD_DIM,
                      qk_head_dim=HEAD_DIM, v_head_dim=KV_LORA, scaling=SM_SCALE, logit_cap=0.0,
                      is_cross_attention=False)
        fb = ForwardBatch(forward_mode=Mode(kind), batch_size=len(case.lens), token_to_kv_pool=case.pool,
                          extend_prefix_lens_cpu=case.prefix, extend_seq_lens_cpu=case.extend,
                          seq_lens_cpu=torch.tensor(case.lens))
        o = call_bound(getattr(b, fwd), dict(q=case.q_nope, k=None, v=None, layer=layer, forward_batch=fb,
                                             save_kv_cache=False, q_rope=case.q_pe, k_rope=None,
                                             topk_indices=case.topk.clone()), what=f"{self.cls_name}.{fwd}")
        o = o[0] if isinstance(o, tuple) else o
        if not isinstance(o, torch.Tensor):
            raise HarnessError(f"{self.cls_name}.{fwd} ({case.impl}) returned {type(o).__name__}, not a tensor: "
                               "the kernel it calls on this path has no reference in verify")
        return o


class SparseVerifier(FA3Verifier):
    def __init__(self, rel, orig, pat, rt, world, report, gen, bf16_world):
        super().__init__(rel, orig, pat, rt, world, report, gen)
        self.bf16 = bf16_world  # decode's pool: a BF16 store, which the original reads as is
        self.reached = set()    # (method, kernel) of the wrapped calls passing cases ran
        self.kernels = {}       # (kind, impl) -> kernels its cases called (sparse_reference.CALLS)
        self.upstream_copies = None  # decode, FP8 compute: the original's own full-pool copies

    def case_result(self, kind, exec_, label, variant="") -> CaseResult:
        fwd = "forward_decode" if kind == DECODE else "forward_extend"
        c = CaseResult(file=self.rel, qualname=f"{self.pat.cls_name}.{fwd}", path="decode" if kind == DECODE
                       else "prefill", mode=MODE_GATHER, exec=exec_, batch=label, kernel=KERNEL_NAME, variant=variant)
        self.report.cases.append(c)
        return c

    def case(self, kind, impl, prefix, extend, store_fp8=False, compute_fp8=False):
        saved = self.world
        self.world = self.bf16 if kind == DECODE else saved  # FA3Verifier.eager guards self.world's pool
        try:
            cs = Case(self.gen, self.dev, self.world.pool, self.world.slots, prefix, extend, impl, store_fp8,
                      compute_fp8)
            ref.CALLS.clear()
            self.pat.entered.clear()
            n = len(self.report.cases)
            self.upstream_copies = self._original_copies(cs) if kind == DECODE and compute_fp8 else None
            self.eager(kind, cs, impl + (f"+{STORE_FP8}" if store_fp8 else "")
                       + (f"+{COMPUTE_FP8}" if compute_fp8 else ""))
        finally:
            self.world, self.upstream_copies = saved, None
        self.kernels.setdefault((kind, impl), set()).update(k for k, _ in ref.CALLS)
        c = self.report.cases[n]
        if not c.passed:
            return
        c.message = "kernels: " + (", ".join(sorted({k for k, _ in ref.CALLS})) or "(none counted)") + (
            f"; {c.message}" if c.message else "")
        if kind == EXTEND:  # the cast is deferred in extend only: there the wrapped calls cast rows
            # A kernel called from a helper the patched side entered (or inline in the forward).
            self.reached |= {(m, k) for k, m in ref.CALLS if m in self.pat.entered or m in FORWARDS}
            self.reached |= {(m, FA3_KERNEL) for m in self.pat.entered}  # FA3's reference is not counted

    def _original_copies(self, cs):
        """What the original's decode copies of the whole store itself, op and shape (the
        FP8-compute helper quantizes the cache it is handed, the store as is in decode)."""
        guard = FullPoolGuard(self.world.pool_ptr(), self.world.store.numel(), self.orig)
        try:
            with guard:
                self.orig.forward(DECODE, cs)
        except Exception:
            return Counter()  # eager reports the original's failure itself
        return Counter(h.split(" at ")[0] for h in guard.hits)

    def judge(self, c, out, ref, hits, fused_before=None):
        if self.upstream_copies is not None:  # tolerate the copies the original makes, one for one
            left, kept = Counter(self.upstream_copies), []
            for h in hits:
                key = h.split(" at ")[0]
                if left[key] > 0:
                    left[key] -= 1
                else:
                    kept.append(h)
            if len(kept) < len(hits):
                c.message = f"{len(hits) - len(kept)} full-store copies made by the original too (upstream's quantize)"
            hits = kept
        super().judge(c, out, ref, hits, fused_before)

    def selfcheck_forward(self):
        impl = next(iter(self.orig.switches["forward_extend"]))
        self.orig.forward(EXTEND, Case(self.gen, self.dev, self.world.pool, self.world.slots, [3], [5], impl))

    def run(self, graph: bool, quick: bool = False):
        self.guard_selfcheck()
        for impl in self.pat.switches["forward_extend"]:
            for prefix, extend in EXTEND_CASES[:2] if quick else EXTEND_CASES:
                self.case(EXTEND, impl, prefix, extend)
                if any(prefix):  # an FP8 store: RAGGED top-k, the prefix dequantized inline
                    self.case(EXTEND, impl, prefix, extend, store_fp8=True)
            if self._fp8_compute(EXTEND, impl):
                for prefix, extend in EXTEND_CASES[:2] if quick else EXTEND_CASES:
                    self.case(EXTEND, impl, prefix, extend, compute_fp8=True)
        for impl in self.pat.switches["forward_decode"]:
            for lens in DECODE_CASES[:1] if quick else DECODE_CASES:
                self.case(DECODE, impl, [n - 1 for n in lens], [1] * len(lens))
            if self._fp8_compute(DECODE, impl):
                for lens in DECODE_CASES[:1] if quick else DECODE_CASES:
                    self.case(DECODE, impl, [n - 1 for n in lens], [1] * len(lens), compute_fp8=True)

    def _fp8_compute(self, kind, impl):
        """Whether (kind, impl) has an FP8-compute variant to run: both files read a
        *COMPUTE_FP8 constant, and the path's BF16 cases called flash_mla_with_kvcache (the
        one kernel the constant switches to FP8). A store kept in FP8 is not combined with it:
        that pool would be the packed format, which verify's pools are not."""
        return bool(self.pat.fp8_flag and self.orig.fp8_flag
                    and "flash_mla_with_kvcache" in self.kernels.get((kind, impl), ()))


def verify_sparse_target(t, sandbox, world, modes, graph, quick, report, log, find_runtime, redirect):
    """The sparse-helper cases of one target file (``harness._verify_target``'s counterpart)."""
    loaded = load_target(t, sandbox, report, find_runtime, redirect)
    if loaded is None:
        return
    omod, pmod, rt, patched_src = loaded
    switches = impl_switches(patched_src, t.cls)
    if not switches["forward_extend"]:
        report.errors.append(f"{t.rel}: {t.cls}.forward_extend picks no kernel path by an impl name: "
                             "verify cannot drive its helpers")
        return
    gen = torch.Generator(device=world.device).manual_seed(1)
    pool = Pool(world.pool.get_key_buffer(0))
    fp8 = types.SimpleNamespace(device=world.device, slots=world.slots, store=world.store, pool=pool,
                                pool_ptr=world.pool_ptr)
    bf16_pool = Pool(pool.buf.to(Q_DTYPE))
    bf16 = types.SimpleNamespace(device=world.device, slots=world.slots, store=bf16_pool.buf, pool=bf16_pool,
                                 pool_ptr=bf16_pool.pool_ptr)
    try:
        orig = SparseSide("original", omod, f"<original {t.original_from}>", t.original, pool, world.device,
                          t.rel, t.cls, impl_switches(t.original, t.cls))
        pat = SparseSide("patched", pmod, str(t.path), patched_src, pool, world.device, t.rel, t.cls, switches)
    except HarnessError as exc:
        report.errors.append(str(exc))
        return
    report.files.append(t.rel)
    if MODE_NATIVE in modes or MODE_FUSED in modes:
        report.notes.append(f"{t.rel}: the deferred row cast has no native FP8 or fused mode: verified gathered")
    report.notes.append(f"{t.rel}: the sparse kernels run as torch references ({KERNEL_NAME}, reference-fa3) on "
                        f"{world.device}: sgl-kernel's FlashMLA, tilelang and FA3 did not run")
    os.environ[MODE_ENV] = MODE_GATHER
    rt.reset()
    log(f"{t.rel}: sparse helpers ({t.cls}), original from {t.original_from}, kernel {KERNEL_NAME}")
    v = SparseVerifier(t.rel, orig, pat, rt, fp8, report, gen, bf16)
    try:
        v.run(graph, quick)
    finally:
        rt.reset()
    for method, kernel in wrapped_kernels(patched_src, t.cls):
        if (method, kernel) in v.reached:
            continue
        why = ("its kernel has no reference in verify" if kernel not in MODELLED | ROW_WISE else
               "a row-wise step before the FP8 kernel, and the file has no single *COMPUTE_FP8 module "
               "constant verify can switch on" if kernel in ROW_WISE and not pat.fp8_flag
               else "no passing case reached it")
        report.unverified.append(f"{t.rel}: {t.cls}.{method}: the wrapped {kernel} call was not verified: {why}")
