"""KVP105 on a CUDA GPU (issue 20, kind 2): the deferred cast and kv_rows_at_kernel on CUDA
tensors, against the torch references of the sparse kernels, and under CUDA graph replay.

    python3 -m pytest tests/gpu/test_sparse_gpu.py

The real FlashMLA/tilelang kernels are not called (the references have their row
semantics: kvpatch/verify/sparse_reference.py); what runs for real is the runtime.
"""

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch and a CUDA device")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: KVP105's GPU tests need a CUDA GPU", allow_module_level=True)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from kvpatch.runtime import load_template  # noqa: E402
from kvpatch.rules import _helper_examples as EX  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the CPU test's driver
from test_verify_sparse import failures  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture()
def rt():
    m = load_template()
    m.reset()
    return m


def test_bit_identical_on_cuda(rt):
    assert failures(EX.NSA_PATCHED, rt, device="cuda") == []
    assert rt._deferred_src


def test_sabotage_is_caught_on_cuda(rt, monkeypatch):
    monkeypatch.setitem(rt.__dict__, "kv_rows_at_kernel", lambda kv, indices, lead=1: kv)
    assert failures(EX.NSA_PATCHED, rt, device="cuda") != []


def test_graph_replay_casts_the_new_rows(rt):
    """Captured once, replayed with a new pool content and new indices: the deferred
    buffer's rows read are those of this replay (no host sync, no stale rows)."""
    dev = "cuda"
    pool = (torch.randn(512, 1, 576, device=dev)).to(torch.float8_e4m3fn)
    idx = torch.randint(0, 512, (8, 1, 32), device=dev, dtype=torch.int32)
    out = torch.empty(8 * 32, 576, device=dev, dtype=torch.bfloat16)

    def step():
        buf = rt.kv_rows_deferred(pool, torch.bfloat16)
        kv = rt.kv_rows_at_kernel(buf, idx, 1)
        out.copy_(kv[:, 0].index_select(0, idx.reshape(-1).long()))

    step()  # warm up (allocates the persistent buffer)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    pool.copy_((torch.randn(512, 1, 576, device=dev)).to(torch.float8_e4m3fn))
    idx.copy_(torch.randint(0, 512, (8, 1, 32), device=dev, dtype=torch.int32))
    rt.poison_shadows()
    g.replay()
    torch.cuda.synchronize()
    want = pool[:, 0].to(torch.bfloat16).index_select(0, idx.reshape(-1).long())
    assert torch.equal(out, want)
