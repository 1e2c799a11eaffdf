"""GPU tests of the runtime's fused Triton gather-cast (run on a CUDA machine):

    python3 -m pytest tests/gpu/test_runtime_gpu.py

Every check compares against torch's own cast on the GPU, bit for bit, with the output
poisoned (NaN) first so a missed row cannot pass, and checks rows outside the read set are
still poison.
"""

import os

import pytest
torch = pytest.importorskip("torch", reason="the GPU tests need torch and a CUDA device")

from kvpatch.runtime import load_template

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the runtime's GPU tests need an NVIDIA GPU",
                allow_module_level=True)
pytest.importorskip("triton", reason="triton not importable: the fused kernel cannot run")

pytestmark = pytest.mark.gpu

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DEV = torch.device("cuda")


_RT = load_template("_kvpatch_runtime_gpu")


@pytest.fixture
def rt(monkeypatch):
    monkeypatch.setenv("KVPATCH_MODE", "gather")
    _RT.reset()
    yield _RT
    _RT.reset()
    torch.cuda.synchronize()


class FakeWrapper:
    """A wrapper as a routed plan call leaves it: indices buffer plus plan_rows' count."""

    def __init__(self, indices, indptr, page_size=1):
        self._kv_indices_buf = indices
        self._kv_indptr_buf = indptr
        self._page_size = page_size
        self._backend = "fa3"
        self.device = indices.device
        _RT.plan_rows(self, indptr)


def fp8_pool(*shape, seed=0):
    """Random FP8 bytes (uint8 storage viewed as e4m3fn): no NaN codes, no zeros."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    raw[(raw & 0x7F) == 0] = 0x21
    return raw.view(FP8)


def rand_slots(n, high, seed=0, dtype=torch.int32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randperm(high, generator=g, device=DEV)[:n].to(dtype)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def check_rows(dst, src, read_units, rpi=1, allowed_units=None):
    """dst == src.to(dst.dtype) on the rows of read_units; poison outside allowed_units."""
    slots = src.shape[0] * (src.shape[1] if src.dim() == 4 else 1)  # [pages, page_size, 1, D]
    s2, d2 = src.reshape(slots, -1), dst.reshape(slots, -1)
    units = s2.shape[0] // rpi

    def rows_of(u):
        u = u.long()
        u = u[(u >= 0) & (u < units)]
        return (u[:, None] * rpi + torch.arange(rpi, device=DEV)).reshape(-1)

    rows = rows_of(read_units)
    ref = s2.index_select(0, rows).to(dst.dtype)  # torch's cast, on the GPU
    assert torch.equal(bits(d2.index_select(0, rows)), bits(ref)), "a read row differs"
    allowed = torch.zeros(s2.shape[0], dtype=torch.bool, device=DEV)
    allowed[rows_of(read_units if allowed_units is None else allowed_units)] = True
    assert bool(torch.isnan(d2[~allowed].float()).all()), "a row outside the read set changed"


def poisoned(src, dtype=BF16):
    return torch.full(src.shape, float("nan"), dtype=dtype, device=DEV)


# --------------------------------------------------------------------------- kernel vs torch


@pytest.mark.parametrize("rows", [1, 4096, 131072])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_kernel_matches_torch_cast(rt, rows, idx_dtype):
    src = fp8_pool(200_000, 1, 576, seed=rows)
    dst = poisoned(src)
    idx = rand_slots(rows, 200_000, seed=rows + 1, dtype=idx_dtype)
    assert rt.gather_cast(src, dst, idx, i32([0, rows]), 1, backend="triton") == "triton"
    check_rows(dst, src, idx)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_other_query_dtypes(rt, dtype):
    src = fp8_pool(10_000, 1, 576, seed=3)
    dst = poisoned(src, dtype)
    idx = rand_slots(3000, 10_000, seed=4)
    rt.gather_cast(src, dst, idx, i32([0, 3000]), 1, backend="triton")
    check_rows(dst, src, idx)


def test_kernel_count_is_max_of_two_indptrs_and_clamped(rt):
    src = fp8_pool(50_000, 1, 576, seed=5)
    idx = rand_slots(20_000, 50_000, seed=6)
    for ip1, ip2, n in [(100, 7000, 7000), (9000, 10, 9000), (5, 10**8, 20_000)]:
        dst = poisoned(src)
        rt.gather_cast(src, dst, idx, i32([0, ip1]), 1, i32([0, 0, ip2, 3]), 2, backend="triton")
        check_rows(dst, src, idx[:n])


def test_kernel_skips_out_of_range_and_duplicate_indices(rt):
    src = fp8_pool(1000, 1, 576, seed=7)
    dst = poisoned(src)
    idx = i32([5, -1, 999, 1000, 2**30, 5, 17, -(2**31)])
    rt.gather_cast(src, dst, idx, i32([0, 8]), 1, backend="triton")
    check_rows(dst, src, idx)


@pytest.mark.parametrize("row_stride, start", [(1152, 0), (1152, 576), (600, 8), (576 + 16, 16)])
def test_kernel_strided_source(rt, row_stride, start):
    base = fp8_pool(60_000, 1, row_stride, seed=8)
    src = base[:, :, start:start + 576]
    assert src.stride(0) == row_stride
    dst = poisoned(src)
    idx = rand_slots(4096, 60_000, seed=9)
    rt.gather_cast(src, dst, idx, i32([0, 4096]), 1, backend="triton")
    check_rows(dst, src, idx)


@pytest.mark.parametrize("layout", ["paged", "flat"])
@pytest.mark.parametrize("page_size", [2, 16, 64])
def test_kernel_rows_per_index(rt, layout, page_size):
    pages = 4000
    shape = (pages, page_size, 1, 576) if layout == "paged" else (pages * page_size, 1, 576)
    src = fp8_pool(*shape, seed=page_size)
    dst = poisoned(src)
    idx = rand_slots(900, pages, seed=10)
    rt.gather_cast(src, dst, idx, i32([0, 700]), 1, rows_per_index=page_size, backend="triton")
    check_rows(dst, src, idx[:700], rpi=page_size)


@pytest.mark.parametrize("cfg", [dict(block_rows=8, num_warps=4, programs_per_sm=1),
                                 dict(block_rows=64, num_warps=8, programs_per_sm=16),
                                 dict(block_rows=16, num_warps=2, programs_per_sm=2)])
def test_kernel_tuning_configs_are_all_correct(rt, cfg):
    src = fp8_pool(100_000, 1, 576, seed=11)
    dst = poisoned(src)
    idx = rand_slots(33_333, 100_000, seed=12)
    rt.gather_cast(src, dst, idx, i32([0, 33_333]), 1, backend="triton", config=cfg)
    check_rows(dst, src, idx)


def test_kv_for_kernel_uses_triton_and_never_syncs(rt, monkeypatch):
    def no_torch(*a, **k):
        raise AssertionError("torch fallback used on CUDA")

    monkeypatch.setattr(rt, "_gather_cast_torch", no_torch)
    kv = fp8_pool(30_000, 1, 576, seed=13)
    idx = rand_slots(5000, 30_000, seed=14)
    w = FakeWrapper(idx, i32([0, 2000, 4500]))
    backend_indptr = i32([0, 2000, 4500, 0])
    rt.kv_for_kernel(kv, w, BF16, kv_indptr=backend_indptr)  # warm-up: compile, shadow
    rt.poison_shadows()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        out = rt.kv_for_kernel(kv, w, BF16, kv_indptr=backend_indptr)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_rows(out, kv, idx[:4500])


def test_no_new_cuda_memory_per_call(rt):
    """Runtime 3: the last two sources of a shape hold their own shadows (an MHA layer's k
    and v are both cast before the kernel that reads them); a third source reuses the
    least recently used one. So after two layers' first calls, nothing is allocated."""
    kv = fp8_pool(100_000, 1, 576, seed=15)
    idx = rand_slots(8192, 100_000, seed=16)
    w = FakeWrapper(idx, i32([0, 8192]))
    backend_indptr = i32([0, 8192])
    layer2 = fp8_pool(100_000, 1, 576, seed=16)  # another layer, same shape
    layer3 = fp8_pool(100_000, 1, 576, seed=17)  # a third: reuses a shadow
    rt.kv_for_kernel(kv, w, BF16, kv_indptr=backend_indptr)
    rt.kv_for_kernel(layer2, w, BF16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        rt.kv_for_kernel(kv, w, BF16, kv_indptr=backend_indptr)
        rt.kv_for_kernel(layer2, w, BF16)
        rt.kv_for_kernel(layer3, w, BF16)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert len(rt._shadows) == 2


# --------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("plan_indptr", ["host", "device"])
def test_cuda_graph_replay_follows_the_routed_plan(rt, monkeypatch, plan_indptr):
    """SGLang's replays: indices rewritten in place, then a plan outside the graph.
    host: fast_mla_decode_plan's host kv_indptr (SGLang 0.5.23's DFLASH verify: the
    wrapper's own indptr buffer stays at its capture-time value); device: a stock
    plan() with the backend's kv_indptr rewritten in place."""
    def no_torch(*a, **k):
        raise AssertionError("torch fallback used on CUDA")

    monkeypatch.setattr(rt, "_gather_cast_torch", no_torch)
    slots, cap_buf, bs = 150_000, 65_536, 3
    kv = fp8_pool(slots, 1, 576, seed=17)
    indices = torch.zeros(cap_buf, dtype=torch.int32, device=DEV)  # SGLang's fixed buffer
    capture_n = 20
    wrapper_indptr = i32([0, 5, 10, capture_n])  # the wrapper's copy: never refreshed
    device_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
    w = FakeWrapper(indices, wrapper_indptr)
    gen = torch.Generator(device=DEV).manual_seed(18)

    def plan(n):
        # New valid entries, plus stale junk after them as SGLang leaves it ...
        indices.copy_(torch.randint(0, slots, (cap_buf,), generator=gen, device=DEV,
                                    dtype=torch.int32))
        # ... then the plan call, routed as the rewrite routes it.
        if plan_indptr == "host":
            rt.plan_rows(w, torch.tensor([0, 0, 0, n], dtype=torch.int32))
        else:
            device_indptr.fill_(0)
            device_indptr[bs] = n
            rt.plan_rows(w, device_indptr)

    plan(capture_n)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compile and allocate the shadow before capture
            rt.kv_for_kernel(kv, w, BF16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rt.kv_for_kernel(kv, w, BF16)

    full = kv.to(BF16)  # a fresh full cast: the reference
    for n in [capture_n, 9389, 50, cap_buf, 7, 40_000, 10**8]:
        plan(n)
        rt.poison_shadows()
        graph.replay()
        torch.cuda.synchronize()
        used = min(n, cap_buf)
        read = indices[:used].long()
        assert torch.equal(bits(out[read]), bits(full[read])), "replay with n=%d" % n
        check_rows(out, kv, indices[:used], allowed_units=indices[:used])


# --------------------------------------------------------------------------- real FlashInfer (opt-in)


@pytest.mark.skipif(os.environ.get("KVPATCH_TEST_FLASHINFER") != "1",
                    reason="set KVPATCH_TEST_FLASHINFER=1 to run against a real FlashInfer "
                           "(its JIT build can take minutes)")
@pytest.mark.parametrize("kv_mode", ["gather", "native"])
def test_real_flashinfer_wrapper_matches_full_cast(rt, monkeypatch, kv_mode):
    flashinfer = pytest.importorskip("flashinfer")
    monkeypatch.setenv("KVPATCH_MODE", kv_mode)
    rt.reset()
    bs, kv_len, heads, slots = 4, 300, 16, 20_000
    g = torch.Generator(device=DEV).manual_seed(19)
    kv = (torch.randn(slots, 1, 576, device=DEV, generator=g) * 0.5).to(FP8)  # realistic range
    idx = rand_slots(bs * kv_len, slots, seed=20)
    qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=DEV)
    kv_indptr = qo_indptr * kv_len
    kv_lens = torch.full((bs,), kv_len, dtype=torch.int32, device=DEV)
    q = torch.randn(bs, heads, 576, dtype=BF16, device=DEV, generator=g)
    workspace = torch.empty(128 << 20, dtype=torch.int8, device=DEV)

    def planned(kv_dtype):
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
        w.plan(qo_indptr, kv_indptr, idx, kv_lens, heads, 512, 64, 1, False, 0.1, BF16,
               kv_dtype(w))
        return w

    w = planned(lambda w: rt.plan_kv_dtype(w, BF16, BF16, FP8, False))
    rt.plan_rows(w, kv_indptr)  # what the rewritten plan call does
    k = rt.kv_for_kernel(kv, w, BF16)
    o = w.run(q[..., :512], q[..., 512:], k[:, :, :512], k[:, :, 512:], **rt.run_kwargs(w))
    full = kv.to(BF16)
    ref_w = planned(lambda w: BF16)
    ref = ref_w.run(q[..., :512], q[..., 512:], full[:, :, :512], full[:, :, 512:])
    rel = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
    print("flashinfer", flashinfer.__version__, "mode", rt.mode(), "planned",
          w._kvpatch_kv_dtype, "backend", w._backend, "rel err", rel)
    if w._kvpatch_kv_dtype is BF16:
        assert torch.equal(o, ref)  # same kernel, same bf16 values on every row it reads
    else:
        assert k is kv and rel < 0.05  # native FP8: no cast, close to the bf16 result


def _host_plan(w, qo_cpu, kv_indptr_cpu, kv_len_cpu, heads, causal):
    """A sync-free replay plan of the kind SGLang's fast_mla_decode_plan does: host
    arrays straight to the JIT module's plan, the wrapper's device indptr buffer
    left as the capture left it (FlashInfer's run() reads only the plan info and
    _kv_indices_buf)."""
    w._cached_module.plan(w._float_workspace_buffer, w._int_workspace_buffer,
                          w._pin_memory_int_workspace_buffer, qo_cpu, kv_indptr_cpu, kv_len_cpu,
                          heads, 512, causal)


@pytest.mark.skipif(os.environ.get("KVPATCH_TEST_FLASHINFER") != "1",
                    reason="set KVPATCH_TEST_FLASHINFER=1 to run against a real FlashInfer "
                           "(its JIT build can take minutes)")
@pytest.mark.parametrize("sabotage", [False, True], ids=["routed", "sabotaged"])
def test_real_flashinfer_graph_replay_after_a_host_array_plan(rt, monkeypatch, sabotage):
    """SGLang 0.5.23's DFLASH target-verify replay, on the real kernel: a graph
    captured after a small plan, replayed after a host-array plan of many more rows.
    Routed (plan_rows sees the replay plan's kv_indptr): equal to the full-cast
    reference. Sabotaged (plan_rows does not update): the check must fail."""
    flashinfer = pytest.importorskip("flashinfer")
    bs, heads, slots, cap = 4, 16, 60_000, 40_000
    ndt = 4  # draft tokens per request: a causal verify window
    g = torch.Generator(device=DEV).manual_seed(21)
    kv = (torch.randn(slots, 1, 576, device=DEV, generator=g) * 0.5).to(FP8)
    workspace = torch.empty(128 << 20, dtype=torch.int8, device=DEV)
    qo_buf = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
    kvp_buf = torch.zeros(bs + 1, dtype=torch.int32, device=DEV)
    idx_buf = torch.zeros(cap, dtype=torch.int32, device=DEV)
    len_buf = torch.zeros(bs, dtype=torch.int32, device=DEV)
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        workspace, use_cuda_graph=True, qo_indptr=qo_buf, kv_indptr=kvp_buf, kv_indices=idx_buf,
        kv_len_arr=len_buf)
    q = torch.randn(bs * ndt, heads, 576, dtype=BF16, device=DEV, generator=g)
    qo_cpu = torch.arange(0, (bs + 1) * ndt, ndt, dtype=torch.int32)

    def arrays(lens):
        lens_cpu = torch.tensor(lens, dtype=torch.int32)
        kvp_cpu = torch.zeros(bs + 1, dtype=torch.int32)
        kvp_cpu[1:] = torch.cumsum(lens_cpu, 0)
        n = int(kvp_cpu[-1])
        idx = torch.randperm(slots, generator=g, device=DEV)[:n].to(torch.int32)
        return lens_cpu, kvp_cpu, idx

    # Capture: the stock plan (device arrays, routed), then the graph.
    lens0, kvp0, idx0 = arrays([ndt + 1] * bs)  # 20 rows
    w.plan(qo_cpu.to(DEV), rt.plan_rows(w, kvp0.to(DEV)), idx0, lens0.to(DEV), heads, 512, 64, 1,
           True, 0.1, BF16, BF16)
    out = torch.empty(bs * ndt, heads, 512, dtype=BF16, device=DEV)

    def step():
        k = rt.kv_for_kernel(kv, w, BF16)
        w.run(q[..., :512], q[..., 512:], k[:, :, :512], k[:, :, 512:], out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(), step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    if sabotage:
        monkeypatch.setattr(rt, "plan_rows", lambda wrapper, kv_indptr: kv_indptr)
    lens, kvp_cpu, idx = arrays([2000, 3000, 1389, 3000])  # 9,389 rows
    idx_buf[: idx.numel()].copy_(idx)  # written in place, as SGLang's verify does
    _host_plan(w, qo_cpu, rt.plan_rows(w, kvp_cpu), lens, heads, True)
    rt.poison_shadows()
    graph.replay()
    torch.cuda.synchronize()

    ref_w = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace.new_empty(128 << 20))
    ref_w.plan(qo_cpu.to(DEV), kvp_cpu.to(DEV), idx, lens.to(DEV), heads, 512, 64, 1, True, 0.1, BF16, BF16)
    full = kv.to(BF16)
    ref = ref_w.run(q[..., :512], q[..., 512:], full[:, :, :512], full[:, :, 512:])
    bad = bool(torch.isnan(out).any()) or not torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print("sabotage", sabotage, "nan", bool(torch.isnan(out).any()), "rel err", rel)
    assert bad == sabotage


# --------------------------------------------------------------------------- page tables (issue 7)


def _page_slots(pt, sl, ps, units):
    n = (sl.long() + ps - 1) // ps
    live = torch.arange(pt.shape[1], device=DEV)[None, :] < n[:, None]
    pages = pt.long()[live]
    pages = pages[(pages >= 0) & (pages < units)]
    return (pages[:, None] * ps + torch.arange(ps, device=DEV)[None, :]).reshape(-1)


@pytest.mark.parametrize("ps", [1, 16, 64, 128])
def test_page_cast_triton_is_bit_identical_and_touches_nothing_else(rt, monkeypatch, ps):
    def no_torch(*a, **k):
        raise AssertionError("torch fallback used on CUDA")

    monkeypatch.setattr(rt, "_cast_units_torch", no_torch)
    units = 4096
    kv = fp8_pool(units * ps, 1, 576, seed=30 + ps)
    bs, width = 8, 300
    g = torch.Generator(device=DEV).manual_seed(31)
    pt = torch.randint(-2, units + 5, (bs, width), generator=g, device=DEV, dtype=torch.int32)
    pt[1, :10] = pt[0, :10]  # shared prefix pages
    sl = torch.randint(0, width * ps, (bs,), generator=g, device=DEV, dtype=torch.int32)
    out = rt.kv_pages_for_kernel(kv, BF16, ps, (pt, sl))
    rt.poison_shadows()
    out = rt.kv_pages_for_kernel(kv, BF16, ps, (pt, sl))
    slots = _page_slots(pt, sl, ps, units)
    check_rows(out, kv, slots)


@pytest.mark.parametrize("ps", [1, 64])
def test_page_cast_graph_replay_follows_tables_rewritten_in_place(rt, monkeypatch, ps):
    """FA3 under CUDA graphs: page_table and cache_seqlens are fixed buffers that SGLang
    rewrites before each replay; the captured cast must follow them, with no host sync."""
    def no_torch(*a, **k):
        raise AssertionError("torch fallback used on CUDA")

    monkeypatch.setattr(rt, "_cast_units_torch", no_torch)
    units, bs, width = 8192, 4, 512
    kv = fp8_pool(units * ps, 1, 576, seed=40 + ps)
    pt = torch.zeros(bs, width, dtype=torch.int32, device=DEV)
    sl = torch.ones(bs, dtype=torch.int32, device=DEV)
    cascade_pt = torch.zeros(bs * 2, 4, dtype=torch.int32, device=DEV)
    cascade_sl = torch.ones(bs * 2, dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(41)

    def fill(lens):
        pt.copy_(torch.randint(0, units, (bs, width), generator=g, device=DEV, dtype=torch.int32))
        sl.copy_(torch.tensor(lens, dtype=torch.int32, device=DEV))
        cascade_pt.copy_(torch.randint(0, units, cascade_pt.shape, generator=g, device=DEV, dtype=torch.int32))

    fill([1] * bs)
    step = lambda: rt.kv_pages_for_kernel(kv, BF16, ps, (pt, sl), (cascade_pt, cascade_sl))  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(), step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lens in ([1, 2, 3, 4], [width * ps] * bs, [0, 5 * ps + 1, 17, width * ps - 1]):
        fill(lens)
        rt.poison_shadows()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        slots = torch.cat([_page_slots(pt, sl, ps, units), _page_slots(cascade_pt, cascade_sl, ps, units)])
        check_rows(out, kv, slots)
