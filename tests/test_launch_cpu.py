"""Eager host time (issue 17): the runtime's cached launches and fused_mla's plans, on the CPU.

A Triton launch through kernel[grid](...) binds every argument in Python on every call;
the runtime calls the compiled kernel's own launcher after the first launch of a
specialisation (runtime part _launch), and fused_mla keeps its checks and launch
constants per call geometry (its plan). Both are caches, so what is tested here is that
they never serve a call something made for another: a kernel and launch constants built
for other alignments, dtypes, strides, tuning or scales. Fakes stand in for Triton's
kernels (no GPU here); tests/gpu/test_fused_gpu.py runs the real ones."""

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch")

from kvpatch.runtime import load_template  # noqa: E402

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@pytest.fixture
def rt():
    return load_template("_kvpatch_launch_cpu")


class Hooks:
    launch_enter_hook = None
    launch_exit_hook = None


class Compiled:
    """What kernel[grid](...) returns: a compiled kernel with its own launcher."""

    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *a):
        self.log.append(("run",) + a)


class Kernel:
    arg_names = ["x", "y", "n", "A", "B"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("bind", grid, args, kw))
            return Compiled(self.log)
        return launch


@pytest.fixture
def fake_triton(rt, monkeypatch):
    hooks = Hooks()
    monkeypatch.setattr(rt, "_launch_triton", (hooks, lambda: 0, lambda dev: 77))
    rt._launch_compiled.clear()
    return hooks


def test_the_launch_key_tells_apart_what_triton_specialises_on(rt):
    x = torch.zeros(64, dtype=BF16)
    spec = rt._launch_spec
    assert spec(x) != spec(x[1:])  # 2 bytes off: another alignment class
    assert spec(x) != spec(x.to(torch.float32))
    assert spec(x) == spec(torch.zeros(64, dtype=BF16))
    assert len({spec(1), spec(16), spec(17), spec(32)}) == 3 and spec(16) == spec(32)
    assert spec(2**31 - 16) != spec(2**31)  # i32 against i64
    assert spec(0.5) == spec(0.25)  # floats are not specialised
    assert spec(True) != spec(1) and spec(None) != spec(0)


def test_second_launch_calls_the_compiled_launcher_with_the_constexprs_in_order(rt, fake_triton):
    k = Kernel()
    x, y = torch.zeros(8), torch.zeros(8)
    consts = (("B", 2), ("A", 1), ("num_warps", 4))
    rt._launch(k, (3, 2), (x, y, 5), consts)
    assert [e[0] for e in k.log] == ["bind"] and k.log[0][3] == {"B": 2, "A": 1, "num_warps": 4}
    rt._launch(k, (3, 2), (x, y, 5), consts)
    run = k.log[-1]
    assert run[0] == "run" and run[1:5] == (3, 2, 1, 77)  # grid padded to 3-D, the stream
    assert run[-5:] == (x, y, 5, 1, 2)  # A then B: the kernel's order, not consts'


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int class", "consts"])
def test_another_specialisation_binds_anew(rt, fake_triton, change):
    k = Kernel()
    x, y = torch.zeros(16), torch.zeros(16)
    consts = (("A", 1), ("B", 2))
    rt._launch(k, (1,), (x, y, 16), consts)
    rt._launch(k, (1,), (x, y, 16), consts)
    assert [e[0] for e in k.log] == ["bind", "run"]
    args = {"misaligned": (x[1:], y, 16), "dtype": (x.double(), y, 16), "int class": (x, y, 17),
            "consts": (x, y, 16)}[change]
    rt._launch(k, (1,), args, (("A", 1), ("B", 3)) if change == "consts" else consts)
    assert k.log[-1][0] == "bind"


def test_a_listening_profiler_gets_tritons_own_launch(rt, fake_triton):
    k = Kernel()
    x = torch.zeros(8)
    rt._launch(k, (1,), (x, x, 1), (("A", 1), ("B", 2)))
    fake_triton.launch_enter_hook = lambda *a: None
    rt._launch(k, (1,), (x, x, 1), (("A", 1), ("B", 2)))
    assert [e[0] for e in k.log] == ["bind", "bind"]


class Chain:
    """Triton 3.6's knob: a HookChain that is always there, listening once calls is non-empty."""

    def __init__(self):
        self.calls = []


def _chains():
    chains = [Chain]
    try:
        from triton.knobs import HookChain  # the real one, where Triton is installed
        chains.append(HookChain)
    except ImportError:
        pass
    return chains


@pytest.mark.parametrize("chain", _chains(), ids=lambda c: c.__module__ + "." + c.__name__)
def test_an_empty_hook_chain_keeps_the_cached_launch_and_a_filled_one_does_not(rt, fake_triton, chain):
    # GPU run 17: with Triton 3.6's always-present chains read as "a profiler listens",
    # every launch took Triton's binder (52 µs of host time per fused call, not 2 launches).
    fake_triton.launch_enter_hook, fake_triton.launch_exit_hook = chain(), chain()
    k = Kernel()
    x = torch.zeros(8)
    for _ in range(2):
        rt._launch(k, (1,), (x, x, 1), (("A", 1), ("B", 2)))
    assert [e[0] for e in k.log] == ["bind", "run"]
    fake_triton.launch_exit_hook.calls.append(lambda *a: None)
    rt._launch(k, (1,), (x, x, 1), (("A", 1), ("B", 2)))
    assert k.log[-1][0] == "bind"


def test_pointer_ints_serve_cached_launches_under_a_callers_key_only(rt, fake_triton):
    k = Kernel()
    x, y = torch.zeros(8), torch.zeros(8)
    consts = (("A", 1), ("B", 2))
    ints = (x.data_ptr(), y.data_ptr(), 5)
    rt._launch(k, (1,), (x, y, 5), consts, "key", ints)
    assert k.log[-1][0] == "bind" and k.log[-1][2] == (x, y, 5)  # Triton binds the tensors
    rt._launch(k, (1,), (x, y, 5), consts, "key", ints)
    assert k.log[-1][0] == "run" and k.log[-1][-5:] == ints + (1, 2)
    rt._launch(k, (1,), (x, y, 5), consts, None, ints)  # no caller key: no ints either
    rt._launch(k, (1,), (x, y, 5), consts, None, ints)
    assert k.log[-1][0] == "run" and k.log[-1][-5:] == (x, y, 5, 1, 2)


class CudaLauncher:
    """Triton 3.6's launcher object (what a compiled kernel's run property returns)."""

    def __init__(self, log, scratch=0):
        self.log, self.global_scratch_size, self.profile_scratch_size = log, scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, *a):
        self.log.append(("run",) + a)

    def launch(self, *a):
        self.log.append(("c launch",) + a)


class LauncherKernel(Kernel):
    def __init__(self, scratch=0):
        super().__init__()
        self.launcher = CudaLauncher(self.log, scratch)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("bind", grid, args, kw))
            c = Compiled(self.log)
            c.run = self.launcher
            return c
        return launch


def _triton_release(monkeypatch, version):
    """`import triton` inside the runtime gets a module of this version (no real one needed)."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))


@pytest.mark.parametrize("version,scratch,want", [("3.6.0", 0, "c launch"), ("3.6.0", 256, "run"),
                                                   ("3.5.1", 0, "run")])
def test_the_c_launch_is_called_directly_only_where_the_launcher_adds_nothing(
        rt, fake_triton, monkeypatch, version, scratch, want):
    _triton_release(monkeypatch, version)
    k = LauncherKernel(scratch)
    x = torch.zeros(8)
    for _ in range(2):
        rt._launch(k, (3, 2), (x, x, 5), (("B", 2), ("A", 1)))
    assert k.log[-1][0] == want
    if want == "c launch":  # the argument order of Triton 3.6's CudaLauncher.__call__
        assert k.log[-1][1:] == (3, 2, 1, 77, "fn", False, True, None, None, "meta", None, None, None,
                                 x, x, 5, 1, 2)


def test_a_c_launch_that_refuses_its_arguments_falls_back_to_the_launcher(rt, fake_triton, monkeypatch):
    _triton_release(monkeypatch, "3.6.0")
    k = LauncherKernel()
    refused = []

    def launch(*a):
        refused.append(a)
        raise TypeError("function takes exactly 14 arguments")

    k.launcher.launch = launch
    x = torch.zeros(8)
    for _ in range(3):
        rt._launch(k, (1,), (x, x, 5), (("B", 2), ("A", 1)))
    assert len(refused) == 1  # tried once, then never again
    assert [e[0] for e in k.log] == ["bind", "run", "run"]


def test_no_gpu_driver_means_tritons_own_launch(rt, monkeypatch):
    monkeypatch.setattr(rt, "_launch_triton", False)
    k = Kernel()
    x = torch.zeros(8)
    for _ in range(2):
        rt._launch(k, (1,), (x, x, 1), (("A", 1), ("B", 2)))
    assert [e[0] for e in k.log] == ["bind", "bind"]


# fused_mla's plans ---------------------------------------------------------------


class FusedFakes:
    """fused_mla with its launches recorded instead of run."""

    def __init__(self, rt, monkeypatch):
        self.calls = []
        monkeypatch.setattr(rt, "_fused_build", lambda: ("split", "combine"))
        monkeypatch.setattr(rt, "_fused_sm_count", lambda dev: 132)
        monkeypatch.setattr(rt, "_launch", lambda k, grid, args, consts, spec=None, ptr_args=None:
                            self.calls.append((k, grid, args, dict(consts), spec, ptr_args)))
        rt._fused_plans.clear()
        rt._fused_scratch.clear()

    def split(self):
        return [c for c in self.calls if c[0] == "split"]


def _inputs(batch=2, heads=16, slots=256, base=None):
    qn = torch.zeros(batch, heads, 512, dtype=BF16) if base is None else base[..., :512]
    qp = torch.zeros(batch, heads, 64, dtype=BF16) if base is None else base[..., 512:]
    pool = torch.zeros(slots, 1, 576, dtype=torch.uint8).view(FP8)
    out = torch.empty(batch, heads, 512, dtype=BF16)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * 4
    indices = torch.arange(batch * 4, dtype=torch.int32)
    return qn, qp, pool, out, indptr, indices


def test_a_plan_serves_its_geometry_only(rt, monkeypatch):
    f = FusedFakes(rt, monkeypatch)
    qn, qp, pool, out, indptr, indices = _inputs()
    for _ in range(2):
        rt.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=indices)
    assert len(rt._fused_plans) == 1 and f.split()[0][4] == f.split()[1][4] is not None
    qn3, qp3, _, out3, indptr3, indices3 = _inputs(batch=3)
    rt.fused_mla(qn3, qp3, pool, out3, 0.1, kv_indptr=indptr3, kv_indices=indices3)
    assert len(rt._fused_plans) == 2 and f.split()[-1][4] != f.split()[0][4]
    assert f.split()[-1][1][0] == 3  # the grid follows the batch
    # Queries cut from one [B, H, 576] tensor: other strides, another plan.
    both = torch.zeros(2, 16, 576, dtype=BF16)
    rt.fused_mla(both[..., :512], both[..., 512:], pool, out, 0.1, kv_indptr=indptr, kv_indices=indices)
    args = f.split()[-1][2]
    assert len(rt._fused_plans) == 3 and args[12] == 16 * 576 and args[13] == 576  # q_nope's strides
    # Only q_nope's strides differ from the first plan's: a plan of its own all the same.
    rt.fused_mla(both[..., :512], qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=indices)
    assert len(rt._fused_plans) == 4 and f.split()[-1][2][12] == 16 * 576 and f.split()[-1][2][14] == 16 * 64


def test_a_misaligned_query_takes_the_per_argument_key(rt, monkeypatch):
    f = FusedFakes(rt, monkeypatch)
    qn, qp, pool, out, indptr, indices = _inputs()
    rt.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=indices)
    flat = torch.zeros(2 * 16 * 576 + 1, dtype=BF16)
    mis = flat[1:].view(2, 16, 576)
    rt.fused_mla(mis[..., :512], mis[..., 512:], pool, out, 0.1, kv_indptr=indptr, kv_indices=indices)
    assert f.split()[0][4] is not None and f.split()[-1][4] is None


def test_replacing_a_tuning_bucket_rebuilds_the_plan(rt, monkeypatch):
    f = FusedFakes(rt, monkeypatch)
    qn, qp, pool, out, indptr, indices = _inputs()
    rt.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=indices)
    other = 32 if rt.FUSED_TUNING["small"]["block_n"] != 32 else 64
    monkeypatch.setitem(rt.FUSED_TUNING, "small", dict(rt.FUSED_TUNING["small"], block_n=other))
    rt.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=indices)
    assert f.split()[0][3]["BLOCK_N"] != other and f.split()[-1][3]["BLOCK_N"] == other
    assert f.split()[-1][4] != f.split()[0][4]  # and another binary


@pytest.mark.parametrize("scale,has", [(None, False), (1.0, False), (0.5, True), ("tensor", True)])
def test_scales_reach_the_kernel_as_the_plan_says(rt, monkeypatch, scale, has):
    f = FusedFakes(rt, monkeypatch)
    qn, qp, pool, out, indptr, indices = _inputs()
    sc = torch.full((1,), 0.25) if scale == "tensor" else scale
    rt.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=indices, ckv_scale=sc)
    _, _, args, consts, _, _ = f.split()[-1]
    assert consts["HAS_CKV_SCALE"] is has
    if scale == "tensor":
        assert args[7] is sc  # the call's own tensor, read per call
        sc2 = torch.full((1,), 2.0)
        rt.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=indices, ckv_scale=sc2)
        assert f.split()[-1][2][7] is sc2
    elif has:
        assert float(args[7]) == scale


def test_scratch_grows_and_an_older_plan_keeps_its_buffers(rt, monkeypatch):
    """A graph captured with a plan's scratch must keep pointing at live memory."""
    f = FusedFakes(rt, monkeypatch)
    small = _inputs(batch=1)
    rt.fused_mla(*small[:4], 0.1, kv_indptr=small[4], kv_indices=small[5])
    first = f.split()[-1][2][5]
    big = _inputs(batch=100)  # 2 splits a request (264 programs' worth): 3,200 rows
    rt.fused_mla(*big[:4], 0.1, kv_indptr=big[4], kv_indices=big[5])
    grown = f.split()[-1][2][5]
    assert grown.shape[0] > first.shape[0]
    rt.fused_mla(*small[:4], 0.1, kv_indptr=small[4], kv_indices=small[5])
    assert f.split()[-1][2][5] is first
    # Rows a split writes: batch x heads x splits, within the plan's buffer.
    b, splits = 100, f.split()[1][1][1]
    assert grown.shape[0] >= b * 16 * splits


def test_one_split_writes_the_output_and_launches_no_combine(rt, monkeypatch):
    """Eager batches above the graph sizes fill the GPU with one split a request: the split
    kernel then writes the output itself, one launch (host time) instead of two."""
    f = FusedFakes(rt, monkeypatch)
    big = _inputs(batch=400)
    rt.fused_mla(*big[:4], 0.1, kv_indptr=big[4], kv_indices=big[5])
    assert [c[0] for c in f.calls] == ["split"]
    _, grid, args, consts, _, ptr_args = f.calls[-1]
    assert ptr_args is None  # CPU tensors: never as ints (Triton's launcher reports them)
    assert grid[1] == 1 and consts["DIRECT"] is True and args[5] is big[3]  # out, not scratch
    assert args[10:12] == big[3].stride()[:2]  # the output's strides follow sm_scale
    # The same geometry told not to: split + combine, into the scratch.
    del f.calls[:]
    cfg = dict(rt.FUSED_TUNING["small"], direct=False)
    rt.fused_mla(*big[:4], 0.1, kv_indptr=big[4], kv_indices=big[5], config=cfg)
    assert [c[0] for c in f.calls] == ["split", "combine"] and f.calls[0][3]["DIRECT"] is False
    assert f.calls[0][2][5] is not big[3]
    # A small batch: many splits, always the combine.
    del f.calls[:]
    small = _inputs(batch=2)
    rt.fused_mla(*small[:4], 0.1, kv_indptr=small[4], kv_indices=small[5])
    assert [c[0] for c in f.calls] == ["split", "combine"] and f.calls[0][1][1] > 1


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.bfloat16])
def test_fused_mla_refuses_a_pool_that_is_not_e4m3_before_anything_runs(rt, dtype):
    """The fused kernels convert FP8 with e4m3's instructions (the Triton kernel's inline
    cvt, the Gluon kernel's staged tiles): an e5m2 pool would be read wrong, so fused_mla
    refuses it (the routed calls only ever hand it e4m3 pools, and gather otherwise)."""
    pool = torch.zeros((64, 1, 576), dtype=dtype)
    q = torch.zeros((1, 16, 576), dtype=torch.bfloat16)
    out = torch.empty((1, 16, 512), dtype=torch.bfloat16)
    indptr, idx = torch.tensor([0, 4], dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        rt.fused_mla(q[..., :512], q[..., 512:], pool, out, 0.1, kv_indptr=indptr, kv_indices=idx)


def test_host_proxy_drives_every_routed_call_down_the_fused_path(tmp_path):
    """tools/host_proxy.py (the runtime's per-call Python on the CPU, between device sessions)
    stays in step with the runtime: its CUDA checks are found to point at the CPU, and every
    routed call it times takes the fused path (a call that fell back would hit its kernel,
    which raises) and launches through the cached C launch, the no-op stand-in."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "host_proxy.py"
    spec = importlib.util.spec_from_file_location("host_proxy", path)
    hp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hp)
    proxy = hp.load_proxy(tmp_path)
    calls = hp.calls(proxy)
    assert len(calls) == 6
    for name, fn in calls.items():
        fn()
        fn()  # the second call: the plan and the launch are cached
    # A plan per fused geometry: fused_mla's two, the routed FA3 call's, mla_run's; the XPU
    # decode's page table, pool view and output are the FA3 call's geometry.
    assert len(proxy._fused_plans) == 4
    assert proxy._launch_compiled and all(hit[2] is not None for hit in proxy._launch_compiled.values())
