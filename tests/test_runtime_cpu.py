"""CPU tests of the runtime a patched checkout imports (kvpatch/runtime/: its parts, joined).

The module is loaded from its file under the name a patched checkout gives it, so these
tests also show it works without kvpatch importable.
"""

import ast
import logging
import os
import subprocess
import sys
import textwrap

import pytest
torch = pytest.importorskip("torch", reason="the runtime tests need torch (pip install kvpatch[test])")

from kvpatch.runtime import TEMPLATE, load_template

RUNTIME = TEMPLATE
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


_RT = load_template()


@pytest.fixture
def rt(monkeypatch):
    monkeypatch.delenv("KVPATCH_MODE", raising=False)
    _RT.reset()
    yield _RT
    _RT.reset()


def set_mode(monkeypatch, rt, value):
    monkeypatch.setenv("KVPATCH_MODE", value)
    rt.reset()


def fake_native_host(monkeypatch, rt, version="0.6.18.post1", cap=(9, 0)):
    monkeypatch.setattr(rt, "_cuda_available", lambda: True)
    monkeypatch.setattr(rt, "_flashinfer_version", lambda: version)
    monkeypatch.setattr(rt, "_device_capability", lambda device: cap)


class FakeWrapper:
    """A flashinfer BatchMLAPagedAttentionWrapper as a routed plan call leaves it: its
    indices buffer, and the count plan_rows noted from the call's kv_indptr."""

    def __init__(self, indices=None, indptr=None, page_size=1, backend="fa3", device="cpu"):
        self._page_size = page_size
        self._backend = backend
        self.device = torch.device(device)
        if indices is not None:
            self._kv_indices_buf = indices
            self._kv_indptr_buf = indptr
            if indptr is not None:
                _RT.plan_rows(self, indptr)


def fp8_pool(*shape, seed=0):
    """Random FP8 bytes as SGLang stores them (uint8), viewed as float8_e4m3fn.

    NaN encodings are excluded so results compare bit for bit; zeros are excluded so an
    untouched zero row cannot look cast.
    """
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    raw[(raw & 0x7F) == 0] = 0x21
    return raw.view(FP8)


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def is_poison(t):
    return bool(torch.isnan(t.float()).all())


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def row_mask(n, rows):
    m = torch.zeros(n, dtype=torch.bool)
    m[torch.as_tensor(rows, dtype=torch.long)] = True
    return m


def gather_twice(rt, kv, wrapper, kv_indptr=None, q_dtype=BF16):
    """Create the shadow, poison it, then gather: stale rows cannot hide a missed one."""
    rt.kv_for_kernel(kv, wrapper, q_dtype, kv_indptr=kv_indptr)
    rt.poison_shadows()
    return rt.kv_for_kernel(kv, wrapper, q_dtype, kv_indptr=kv_indptr)


# --------------------------------------------------------------------------- kv_for_kernel


def test_off_mode_is_exactly_to(rt, monkeypatch):
    set_mode(monkeypatch, rt, "off")
    kv = fp8_pool(64, 1, 576)
    w = FakeWrapper(i32([1, 2, 3]), i32([0, 3]))
    out = rt.kv_for_kernel(kv, w, BF16, kv_indptr=i32([0, 3]))
    assert out.dtype == BF16 and out.shape == kv.shape
    assert torch.equal(bits(out), bits(kv.to(BF16)))
    assert rt._shadows == {}  # no shadow: off never gathers


def test_gather_writes_exactly_the_planned_rows(rt, monkeypatch):
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(200, 1, 576)
    idx = i32([7, 3, 150, 3, 199, 0, 42, 11, 12, 13])  # a duplicate, both ends
    w = FakeWrapper(idx, i32([0, 4, 8]))
    first = rt.kv_for_kernel(kv, w, BF16)
    rt.poison_shadows()
    out = rt.kv_for_kernel(kv, w, BF16)
    assert out is first  # persistent, not reallocated
    assert out.shape == kv.shape and out.dtype == BF16
    read = idx[:8].long()
    assert torch.equal(bits(out[read]), bits(kv.to(BF16)[read]))
    assert is_poison(out[~row_mask(200, read)])  # nothing else touched (idx[8:] included)


def test_shadow_is_shared_across_layers_of_one_shape(rt, monkeypatch):
    """At most two shadows per shape, however many layers: the last two sources cast (an MHA
    layer's k and v, both read by one kernel) hold their own; a third takes the older one."""
    set_mode(monkeypatch, rt, "gather")
    w = FakeWrapper(i32([1, 5]), i32([0, 2]))
    pools = [fp8_pool(16, 1, 576, seed=s) for s in (1, 2, 3)]
    a = rt.kv_for_kernel(pools[0], w, BF16)
    b = rt.kv_for_kernel(pools[1], w, BF16)
    assert a is not b and torch.equal(bits(a[[1, 5]]), bits(pools[0].to(BF16)[[1, 5]]))
    d = rt.kv_for_kernel(pools[2], w, BF16)
    c = rt.kv_for_kernel(pools[2], w, torch.float16)
    assert d is a and c is not a and len(rt._shadows) == 3
    assert torch.equal(bits(b[[1, 5]]), bits(pools[1].to(BF16)[[1, 5]]))
    assert torch.equal(bits(d[[1, 5]]), bits(pools[2].to(BF16)[[1, 5]]))


@pytest.mark.parametrize(
    "planned_n, backend_n, expect",
    [
        (10, 30, 10),  # the backend's buffer says more: not what the kernel was planned with
        (10, 5, 10),
        (10, 999, 10),
        (999, 0, 40),  # clamp to the indices buffer (DCP / verify)
        (-4, -2, 0),  # garbage negative counts write nothing
    ],
)
def test_count_is_the_routed_plans_clamped(rt, monkeypatch, planned_n, backend_n, expect):
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(100, 1, 576)
    idx = torch.randperm(100, generator=torch.Generator().manual_seed(3))[:40].to(torch.int32)
    w = FakeWrapper(idx, i32([0, 0, planned_n]))
    backend_indptr = i32([0, 1, backend_n, 77, 88])  # max-bs sized, passed by kvpatch 0.1 rewrites
    out = gather_twice(rt, kv, w, kv_indptr=backend_indptr)
    read = idx[:expect].long()
    assert torch.equal(bits(out[read]), bits(kv.to(BF16)[read]))
    assert is_poison(out[~row_mask(100, read)])


def test_stale_wrapper_indptr_is_not_the_count(rt, monkeypatch):
    """SGLang 0.5.23's DFLASH verify replay: fast_mla_decode_plan gets host arrays and
    never refreshes the wrapper's _kv_indptr_buf (capture-time: 20 rows). The routed
    plan's kv_indptr (9,389 rows) is what the kernel reads."""
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(12000, 1, 576)
    idx = torch.randperm(12000, generator=torch.Generator().manual_seed(5))[:10000].to(torch.int32)
    w = FakeWrapper(idx, i32([0, 20]))  # capture-time plan
    rt.plan_rows(w, torch.tensor([0, 4000, 9389], dtype=torch.int32))  # the replay's plan call
    assert int(w._kv_indptr_buf[-1]) == 20  # stale, as on the GPU
    out = gather_twice(rt, kv, w)
    read = idx[:9389].long()
    assert torch.equal(bits(out[read]), bits(kv.to(BF16)[read]))
    assert is_poison(out[~row_mask(12000, read)])


def test_sabotaged_count_from_the_wrapper_buffer_misses_rows(rt, monkeypatch):
    """The check above can fail: a runtime that counts from _kv_indptr_buf (kvpatch 0.1)
    leaves rows the kernel reads as poison."""
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(12000, 1, 576)
    idx = torch.randperm(12000, generator=torch.Generator().manual_seed(5))[:10000].to(torch.int32)
    w = FakeWrapper(idx, i32([0, 20]))
    real = rt.plan_rows
    monkeypatch.setattr(rt, "plan_rows", lambda wrapper, kv_indptr: kv_indptr)  # the count is never updated
    rt.plan_rows(w, torch.tensor([0, 4000, 9389], dtype=torch.int32))
    out = gather_twice(rt, kv, w)
    read = idx[:9389].long()
    assert is_poison(out[read[20:]])  # rows 20.. of what the kernel reads were never cast
    assert real is not rt.plan_rows


def test_unplanned_wrapper_casts_the_whole_pool(rt, monkeypatch, caplog):
    """No routed plan was seen (a plan call the rewrite missed, an old patch): slow, never wrong."""
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(64, 1, 576)
    w = FakeWrapper()
    w._kv_indices_buf, w._kv_indptr_buf = i32([1, 2, 3]), i32([0, 3])  # planned behind kvpatch's back
    with caplog.at_level(logging.WARNING, logger="kvpatch.runtime"):
        out = rt.kv_for_kernel(kv, w, BF16)
    assert torch.equal(bits(out), bits(kv.to(BF16)))
    assert "no plan of FakeWrapper was routed" in caplog.text


def test_plan_rows_keeps_one_count_tensor_per_wrapper(rt, monkeypatch):
    """A captured graph reads the count tensor it saw at capture: later plans must
    write into that same tensor, never rebind it."""
    w = FakeWrapper(i32([5, 6, 7, 8]), i32([0, 2]))
    first = w._kvpatch_rows
    assert rt.plan_rows(w, i32([0, 1, 3])) is not None
    assert w._kvpatch_rows is first and int(first) == 3
    dev = i32([0, 4])
    assert rt.plan_rows(w, dev) is dev  # the plan call still gets its own argument
    assert w._kvpatch_rows is first and int(first) == 4


def test_host_indptr_inside_capture_is_not_frozen(rt, monkeypatch, caplog):
    """A host count inside graph capture would be baked into the graph: unknown instead."""
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(32, 1, 576)
    w = FakeWrapper(i32([1, 2, 3]), i32([0, 2]))
    monkeypatch.setattr(rt, "_capturing", lambda: True)
    with caplog.at_level(logging.WARNING, logger="kvpatch.runtime"):
        rt.plan_rows(w, i32([0, 3]))
    monkeypatch.setattr(rt, "_capturing", lambda: False)
    out = rt.kv_for_kernel(kv, w, BF16)
    assert torch.equal(bits(out), bits(kv.to(BF16)))  # whole pool, correct
    assert "host kv_indptr inside graph capture" in caplog.text


def test_backend_indptr_too_short_is_ignored(rt, monkeypatch):
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(50, 1, 576)
    idx = i32(list(range(20)))
    w = FakeWrapper(idx, i32([0, 0, 6]))
    out = gather_twice(rt, kv, w, kv_indptr=i32([0, 15]))  # has no entry at position 2
    assert torch.equal(bits(out[:6]), bits(kv.to(BF16)[:6]))
    assert is_poison(out[6:])


@pytest.mark.parametrize("layout", ["paged", "flat"])
def test_rows_per_index_covers_whole_pages(rt, monkeypatch, layout):
    set_mode(monkeypatch, rt, "gather")
    pages, ps = 12, 4
    kv = fp8_pool(pages, ps, 1, 576) if layout == "paged" else fp8_pool(pages * ps, 1, 576)
    idx = i32([9, 2, 11, 5, 0])
    w = FakeWrapper(idx, i32([0, 3]), page_size=ps)
    out = gather_twice(rt, kv, w)
    ref = kv.to(BF16).reshape(pages, ps, 576)
    got = out.reshape(pages, ps, 576)
    read = idx[:3].long()
    assert torch.equal(bits(got[read]), bits(ref[read]))
    assert is_poison(got[~row_mask(pages, read)])


def test_strided_source_view(rt, monkeypatch):
    set_mode(monkeypatch, rt, "gather")
    base = fp8_pool(80, 1, 1200)
    kv = base[:, :, 600:1176]  # [80, 1, 576], row stride 1200, storage offset 600
    assert not kv.is_contiguous()
    idx = i32([79, 0, 33, 34, 60])
    out = gather_twice(rt, kv, FakeWrapper(idx, i32([0, 5])))
    assert out.shape == kv.shape
    assert torch.equal(bits(out[idx.long()]), bits(kv.to(BF16)[idx.long()]))
    assert is_poison(out[~row_mask(80, idx)])


def test_non_contiguous_inner_row_uses_torch_and_is_correct(rt):
    kv = fp8_pool(576, 30).t().unsqueeze(1)  # [30, 1, 576], inner stride 30
    dst = torch.full(kv.shape, float("nan"), dtype=BF16)
    idx = i32([4, 29, 0])
    path = rt.gather_cast(kv, dst, idx, i32([0, 3]), 1)
    assert path == "torch"
    assert torch.equal(bits(dst[idx.long()]), bits(kv.to(BF16)[idx.long()]))
    assert is_poison(dst[~row_mask(30, idx)])


def test_multi_head_slots_are_gathered_whole(rt, monkeypatch):
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(40, 4, 64)  # a slot is 4 heads x 64
    idx = i32([39, 2, 17])
    out = gather_twice(rt, kv, FakeWrapper(idx, i32([0, 3])))
    assert torch.equal(bits(out[idx.long()]), bits(kv.to(BF16)[idx.long()]))
    assert is_poison(out[~row_mask(40, idx)])


def test_pool_whose_slots_are_not_rows_is_cast_whole(rt, monkeypatch, caplog):
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(30, 2, 600)[:, :, :576]  # head stride 600: a slot is not one row
    with caplog.at_level(logging.WARNING, logger="kvpatch.runtime"):
        out = rt.kv_for_kernel(kv, FakeWrapper(i32([1]), i32([0, 1])), BF16)
    assert torch.equal(bits(out), bits(kv.to(BF16)))
    assert any("strides" in r.getMessage() for r in caplog.records)


def test_same_dtype_is_passed_through(rt, monkeypatch):
    set_mode(monkeypatch, rt, "gather")
    kv = torch.randn(10, 1, 576, dtype=BF16)
    assert rt.kv_for_kernel(kv, FakeWrapper(i32([1]), i32([0, 1])), BF16) is kv
    assert rt._shadows == {}


def test_native_planned_wrapper_gets_the_fp8_pool(rt, monkeypatch):
    set_mode(monkeypatch, rt, "native")
    fake_native_host(monkeypatch, rt)
    w = FakeWrapper(i32([1]), i32([0, 1]), device="cuda")
    assert rt.plan_kv_dtype(w, BF16, BF16, FP8, False) is FP8
    kv = fp8_pool(10, 1, 576)
    assert rt.kv_for_kernel(kv, w, BF16) is kv
    assert rt.run_kwargs(w) == {"ckv_scale": 1.0, "kpe_scale": 1.0}


@pytest.mark.parametrize("wrapper", [object(), FakeWrapper()], ids=["object", "unplanned"])
def test_wrapper_without_indices_falls_back_with_one_warning(rt, monkeypatch, caplog, wrapper):
    set_mode(monkeypatch, rt, "gather")
    kv = fp8_pool(20, 1, 576)
    with caplog.at_level(logging.WARNING, logger="kvpatch.runtime"):
        a = rt.kv_for_kernel(kv, wrapper, BF16)
        b = rt.kv_for_kernel(kv, wrapper, BF16)
    assert torch.equal(bits(a), bits(kv.to(BF16))) and torch.equal(bits(b), bits(a))
    records = [r for r in caplog.records if r.name == "kvpatch.runtime"]
    assert len(records) == 1 and "whole pool" in records[0].getMessage()


# --------------------------------------------------------------------------- gather_cast


def test_gather_cast_skips_out_of_range_indices(rt):
    src = fp8_pool(30, 1, 576)
    dst = torch.full(src.shape, float("nan"), dtype=BF16)
    idx = i32([3, -1, 30, 1000, 29, 3])
    path = rt.gather_cast(src, dst, idx, i32([0, 6]), 1)
    assert path == "torch"  # CPU
    assert torch.equal(bits(dst[[3, 29]]), bits(src.to(BF16)[[3, 29]]))
    assert is_poison(dst[~row_mask(30, [3, 29])])


def test_gather_cast_with_no_valid_rows_touches_nothing(rt):
    src = fp8_pool(30, 1, 576)
    dst = torch.full(src.shape, float("nan"), dtype=BF16)
    rt.gather_cast(src, dst, i32([5, 6]), i32([0, 0]), 1)  # n = 0
    rt.gather_cast(src, dst, i32([-5, 99]), i32([0, 2]), 1)  # n = 2, both invalid
    assert is_poison(dst)


def test_gather_cast_rejects_mismatched_buffers(rt):
    with pytest.raises(ValueError):
        rt.gather_cast(fp8_pool(4, 576), torch.empty(5, 576, dtype=BF16), i32([0]), i32([0, 1]), 1)


# --------------------------------------------------------------------------- plan / run


def native_wrapper(backend="fa3"):
    return FakeWrapper(i32([0]), i32([0, 1]), backend=backend, device="cuda")


def test_plan_kv_dtype_native_and_recorded(rt, monkeypatch):
    fake_native_host(monkeypatch, rt)
    set_mode(monkeypatch, rt, "native")
    w = native_wrapper()
    assert rt.mode() == "native"
    assert rt.plan_kv_dtype(w, BF16, BF16, FP8, False) is FP8
    assert w._kvpatch_kv_dtype is FP8
    assert rt.run_kwargs(w) == {"ckv_scale": 1.0, "kpe_scale": 1.0}
    # A later bf16 plan of the same wrapper is followed too.
    assert rt.plan_kv_dtype(w, BF16, BF16, torch.uint8, False) is BF16
    assert w._kvpatch_kv_dtype is BF16 and rt.run_kwargs(w) == {}


@pytest.mark.parametrize(
    "case",
    [
        dict(kv_cache_dtype=torch.uint8),  # FlashInfer would pick an FP4 kernel
        dict(kv_cache_dtype=torch.float8_e5m2),
        dict(kv_cache_dtype=BF16),
        dict(kv_cache_dtype=None),
        dict(q_dtype=torch.float16),
        dict(version="0.6.13"),
        dict(version="0.6.14rc1"),
        dict(version="0.5.3"),
        dict(version=None),
        dict(version="0.6.17", backend="fa2"),  # fa2 FP8 MLA needs 0.6.18
        dict(version="0.6.18rc2", backend="fa2"),
        dict(backend="cutlass"),
        dict(backend=None),
        dict(cap=(8, 0)),
        dict(cap=(10, 0)),
        dict(cap=None),
        dict(causal=True),  # prefill/verify: always gathered
        dict(causal=True, env="native"),
        dict(env="auto"),  # auto prefers the fused gather when Triton is there
        dict(device="cpu"),
        dict(env="gather"),
        dict(env="off"),
    ],
    ids=lambda c: ",".join("%s=%s" % kv for kv in c.items()),
)
def test_plan_kv_dtype_never_fp8_when_unsupported(rt, monkeypatch, case):
    set_mode(monkeypatch, rt, case.get("env", "native"))
    fake_native_host(monkeypatch, rt, case.get("version", "0.6.18.post1"), case.get("cap", (9, 0)))
    monkeypatch.setattr(rt, "_triton_available", lambda: True)
    w = FakeWrapper(i32([0]), i32([0, 1]), backend=case.get("backend", "fa3"),
                    device=case.get("device", "cuda"))
    kv_dtype = BF16
    got = rt.plan_kv_dtype(w, case.get("q_dtype", BF16), kv_dtype,
                           case.get("kv_cache_dtype", FP8), case.get("causal", False))
    assert got is kv_dtype
    assert w._kvpatch_kv_dtype is kv_dtype
    assert rt.run_kwargs(w) == {}


@pytest.mark.parametrize(
    "version, backend, expect",
    [("0.6.14", "fa3", FP8), ("0.6.14", "fa2", BF16), ("0.6.18", "fa2", FP8),
     ("0.7.0rc1", "fa2", FP8), ("0.6.18.post1+cu130", "fa2", FP8)],
)
def test_plan_kv_dtype_version_gates(rt, monkeypatch, version, backend, expect):
    set_mode(monkeypatch, rt, "native")
    fake_native_host(monkeypatch, rt, version)
    assert rt.plan_kv_dtype(native_wrapper(backend), BF16, BF16, FP8, False) is expect


def test_causal_plans_never_native(rt, monkeypatch):
    set_mode(monkeypatch, rt, "native")
    fake_native_host(monkeypatch, rt)
    assert rt.plan_kv_dtype(native_wrapper(), BF16, BF16, FP8, False) is FP8
    assert rt.plan_kv_dtype(native_wrapper(), BF16, BF16, FP8, True) is BF16


def test_run_kwargs_unplanned_wrapper_is_empty(rt):
    assert rt.run_kwargs(object()) == {}
    assert rt.run_kwargs(FakeWrapper()) == {}


def test_plan_kv_dtype_on_an_object_without_dict(rt, monkeypatch):
    set_mode(monkeypatch, rt, "native")
    fake_native_host(monkeypatch, rt)
    assert rt.plan_kv_dtype(object(), BF16, BF16, FP8, False) is BF16


# --------------------------------------------------------------------------- mode


@pytest.mark.parametrize("raw, expect", [("GATHER", "gather"), (" Off ", "off"),
                                         ("gather", "gather"), ("", "gather"), ("Auto", "gather")])
def test_mode_env_is_case_insensitive(rt, monkeypatch, raw, expect):
    monkeypatch.setattr(rt, "_cuda_available", lambda: False)
    set_mode(monkeypatch, rt, raw)
    assert rt.mode() == expect


def test_invalid_mode_names_the_allowed_values(rt, monkeypatch):
    set_mode(monkeypatch, rt, "fast")
    with pytest.raises(ValueError) as err:
        rt.mode()
    for name in ("auto", "gather", "native", "off", "fast"):
        assert name in str(err.value)


def test_mode_is_cached_until_reset(rt, monkeypatch):
    set_mode(monkeypatch, rt, "gather")
    assert rt.mode() == "gather"
    monkeypatch.setenv("KVPATCH_MODE", "off")
    assert rt.mode() == "gather"
    rt.reset()
    assert rt.mode() == "off"


@pytest.mark.parametrize(
    "cuda, triton, version, expect",
    [(True, True, "0.6.18.post1", "gather"),  # the fused gather beats the FP8 kernel
     (True, False, "0.6.18.post1", "native"), (True, False, "0.6.14", "native"),
     (True, False, "0.6.13", "gather"), (True, False, None, "gather"),
     (False, False, "0.6.18.post1", "gather")],
)
def test_auto_mode_resolution(rt, monkeypatch, cuda, triton, version, expect):
    monkeypatch.setattr(rt, "_cuda_available", lambda: cuda)
    monkeypatch.setattr(rt, "_triton_available", lambda: triton)
    monkeypatch.setattr(rt, "_flashinfer_version", lambda: version)
    assert rt.mode() == expect


def test_forced_native_without_support_warns_once_and_gathers(rt, monkeypatch, caplog):
    monkeypatch.setattr(rt, "_cuda_available", lambda: True)
    monkeypatch.setattr(rt, "_flashinfer_version", lambda: "0.6.3")
    set_mode(monkeypatch, rt, "native")
    with caplog.at_level(logging.WARNING, logger="kvpatch.runtime"):
        assert rt.mode() == "gather"
        assert rt.mode() == "gather"
    records = [r for r in caplog.records if r.name == "kvpatch.runtime"]
    assert len(records) == 1 and "0.6.3" in records[0].getMessage()


@pytest.mark.parametrize(
    "text, expect",
    [("0.6.18.post1", (0, 6, 18, 1)), ("0.7.0rc1", (0, 7, 0, 0)), ("0.6.14", (0, 6, 14, 1)),
     ("0.6.18+cu130torch2.11", (0, 6, 18, 1)), ("0.6.18.dev20250101", (0, 6, 18, 0)),
     ("1.0", (1, 0, 0, 1)), ("0.6.18a1", (0, 6, 18, 0)), ("v0.2.5", (0, 2, 5, 1)),
     ("garbage", None), (None, None)],
)
def test_parse_version(rt, text, expect):
    assert rt._parse_version(text) == expect


# --------------------------------------------------------------------------- module hygiene


def test_module_imports_only_stdlib_and_torch_at_top_level():
    tree = ast.parse(RUNTIME.read_text())
    top, nested = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, "relative import breaks the copied module"
                names = [node.module]
            else:
                names = [a.name for a in node.names]
            (top if node in tree.body else nested).update(n.split(".")[0] for n in names)
    assert not any(n.startswith("kvpatch") for n in top | nested)
    assert top <= {"logging", "math", "os", "re", "torch"}, top
    assert "triton" in nested and "triton" not in top  # lazy, CUDA only


def test_version_stamps_are_literal_strings():
    tree = ast.parse(RUNTIME.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    found[t.id] = node.value.value
    assert found["__kvpatch_runtime_version__"] == "15"
    assert isinstance(found["__kvpatch_version__"], str) and found["__kvpatch_version__"]


def test_cpu_use_never_imports_triton():
    script = textwrap.dedent(
        """
        import importlib.util, sys
        import torch
        tried = []
        class Spy:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "triton":
                    tried.append(name)
                return None
        sys.meta_path.insert(0, Spy())
        spec = importlib.util.spec_from_file_location("_kvpatch_runtime", sys.argv[1])
        rt = importlib.util.module_from_spec(spec); spec.loader.exec_module(rt)
        class W: pass
        w = W(); w.device = torch.device("cpu"); w._backend = "fa3"; w._page_size = 1
        w._kv_indices_buf = torch.tensor([1, 2], dtype=torch.int32)
        w._kv_indptr_buf = torch.tensor([0, 2], dtype=torch.int32)
        kv = torch.ones(8, 1, 576).to(torch.float8_e4m3fn)
        rt.plan_kv_dtype(w, torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn, False)
        out = rt.kv_for_kernel(kv, w, torch.bfloat16)
        assert rt.mode() == "gather" and float(out[1].float().mean()) == 1.0
        print("TRIED", tried, "LOADED", "triton" in sys.modules)
        """
    )
    env = dict(os.environ, KVPATCH_MODE="auto", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", script, str(RUNTIME)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "TRIED [] LOADED False" in res.stdout, res.stdout


# --------------------------------------------------------------------------- Triton kernel, interpreted


INTERPRET_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys
    import torch
    spec = importlib.util.spec_from_file_location("_kvpatch_runtime", sys.argv[1])
    rt = importlib.util.module_from_spec(spec); spec.loader.exec_module(rt)
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16

    def pool(shape, seed):
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        raw[(raw & 0x7F) == 0x7F] = 0x3C
        raw[(raw & 0x7F) == 0] = 0x21
        return raw.view(fp8)

    def check(src, rpi, idx, ip1, pos1, ip2, pos2, n_expect, dtype=bf16, cfg=None):
        dst = torch.full(src.shape, float("nan"), dtype=dtype)
        assert rt.gather_cast(src, dst, idx, ip1, pos1, ip2, pos2, rpi,
                              backend="triton", config=cfg) == "triton"
        slots = src.shape[0] * (src.shape[1] if src.dim() == 4 else 1)
        s2, d2 = src.reshape(slots, -1), dst.view(slots, -1)
        ref = s2.to(dtype)
        units = s2.shape[0] // rpi
        use = idx[:n_expect].long()
        use = use[(use >= 0) & (use < units)]
        rows = (use[:, None] * rpi + torch.arange(rpi)).reshape(-1)
        hit = torch.zeros(s2.shape[0], dtype=torch.bool); hit[rows] = True
        w = 2 if dst.element_size() == 2 else 4
        iv = {2: torch.int16, 4: torch.int32}[w]
        assert torch.equal(d2[hit].contiguous().view(iv), ref[hit].contiguous().view(iv))
        assert torch.isnan(d2[~hit].float()).all()
        return int(hit.sum())

    g = torch.Generator().manual_seed(1)
    idx = torch.randperm(300, generator=g)[:120].to(torch.int32)
    idx[3], idx[9] = 5000, -2  # out of range: skipped
    ip1 = torch.tensor([0, 50], dtype=torch.int32)
    ip2 = torch.tensor([0, 90, 7], dtype=torch.int32)
    cfg = {"block_rows": 16, "programs_per_sm": 1}  # 4 programs: the persistent loop runs
    print(check(pool((300, 1, 576), 2), 1, idx, ip1, 1, ip2, 1, 90, cfg=cfg))
    print(check(pool((300, 1, 576), 2), 1, idx, ip1, 1, ip2, 1, 90, torch.float16, cfg))
    print(check(pool((300, 1, 576), 2), 1, idx, ip1, 1, None, 0, 50, cfg=cfg))
    print(check(pool((300, 1, 576), 2), 1, idx.long(), ip1.long(), 1, ip2.long(), 1, 90, cfg=cfg))
    ipbig = torch.tensor([0, 10**6], dtype=torch.int32)
    print(check(pool((300, 1, 576), 2), 1, idx, ipbig, 1, None, 0, 120, cfg=cfg))  # clamp
    base = pool((300, 1, 1200), 3)
    print(check(base[:, :, 600:1176], 1, idx, ip1, 1, ip2, 1, 90, cfg=cfg))  # strided
    pidx = torch.tensor([9, 2, 74, 5, 0, 40], dtype=torch.int32)
    print(check(pool((75, 4, 1, 576), 4), 4, pidx, torch.tensor([0, 4], dtype=torch.int32),
                1, None, 0, 4, cfg=cfg))  # pages
    print(check(pool((300, 1, 576), 5), 4, pidx, torch.tensor([0, 6], dtype=torch.int32),
                1, None, 0, 6, cfg=cfg))  # flat pool, 4 rows per index
    print(check(pool((64, 512), 6), 1, idx % 64, ip1, 1, None, 0, 50, cfg=cfg))  # no tail
    print(check(pool((64, 100), 7), 1, idx % 64, ip1, 1, None, 0, 50, cfg=cfg))  # masked tail
    print(check(pool((64, 4, 64), 9), 1, idx % 64, ip1, 1, None, 0, 50, cfg=cfg))  # 4 heads
    print(check(pool((64, 576), 8), 1, idx % 64, torch.tensor([0, 0], dtype=torch.int32),
                1, None, 0, 0, cfg=cfg))  # n = 0
    print("INTERPRETED OK")
    """
)


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton", reason="triton not installed: kernel not interpreted")
    np = pytest.importorskip("numpy", reason="the Triton interpreter needs numpy")
    if tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip("Triton 3.6's interpreter fails on numpy >= 2.3 scalars; needs numpy < 2.3")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", INTERPRET_SCRIPT, str(RUNTIME)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    counts = [int(x) for x in res.stdout.split()[:-2]]
    assert len(counts) == 12 and all(counts[:-1]) and counts[-1] == 0, res.stdout
    assert "INTERPRETED OK" in res.stdout


@pytest.mark.parametrize("cast", ["gather", "pages"])
def test_a_triton_launch_that_fails_falls_back_to_torch_once_and_is_not_retried(rt, monkeypatch, caplog, cast):
    """Both casts share one fallback: under "auto" a failed kernel launch is warned
    about once, the torch path gives the same bytes, and the key is not tried again;
    under backend="triton" the failure is raised."""
    src = torch.randn(64, 1, 8).to(FP8)
    launches = []

    def broken(*a, **k):
        launches.append(1)
        raise RuntimeError("no ptxas here")

    monkeypatch.setattr(rt, "_triton_ok", lambda *a: True)
    monkeypatch.setattr(rt, "_get_page_kernel", lambda: object())
    monkeypatch.setattr(rt, "_launch_gather" if cast == "gather" else "_launch", broken)
    monkeypatch.setattr(rt.torch.Tensor, "is_cuda", property(lambda t: True))
    idx = torch.tensor([3, 9, 40], dtype=torch.int32)
    table = torch.tensor([[3, 9]], dtype=torch.int32)

    def run(backend="auto"):
        dst = torch.zeros(64, 1, 8, dtype=BF16)
        if cast == "gather":
            path = rt.gather_cast(src, dst, idx, torch.tensor([0, 3], dtype=torch.int32), 1, backend=backend)
        else:
            path = rt.page_cast(src, dst, table, None, 4, backend=backend)
        return path, dst

    rows = [3, 9, 40] if cast == "gather" else [*range(12, 16), *range(36, 40)]
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            path, dst = run()
            assert path == "torch" and torch.equal(dst[rows], src[rows].to(BF16))
    assert len(launches) == 1, "a failed kernel must not be launched again"
    assert sum("Triton" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records) == 1
    rt.reset()
    with pytest.raises(RuntimeError, match="no ptxas"):
        run("triton")
