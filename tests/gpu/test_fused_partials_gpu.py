"""GPU tests of the f16 partials (FUSED_F16_PARTIALS, a config's "f16_partials"), on a GPU:

    python3 -m pytest tests/gpu/test_fused_partials_gpu.py

With them the split kernels write each split's partial output in f16 and leave the latent's
FP8 scale to the combine. Each split kernel (Triton's, the 16-row Gluon one, the 64-row one
and its loader form) is checked against the fp32 reference with both FP8 scales applied,
bit-identical twice, the same output within f16's rounding as with fp32 partials, a
one-split launch writing the bits split + combine would, and a wrong latent scale failing
the check. They pass (GPU runs 50 and 52) but stay off: the combine slowed more than the
split kernels gained (run 50).
"""

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch and a CUDA device")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the fused attention's GPU tests need an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton not importable: the fused kernel cannot run")

from test_fused_gpu import (  # noqa: E402
    DEV,
    RT,
    _split_kernel_name,
    fp8_pool,
    ok,
    queries,
    rel_err,
    rows_table,
    run,
    table_batch,
)

from kvpatch.verify.fused_reference import fused_reference  # noqa: E402

pytestmark = pytest.mark.gpu

# (kernel, heads, draft tokens, the config that selects it)
KERNELS = [
    ("_fused_split_kernel", 8, 2, dict(RT.FUSED_TUNING["small"], gluon=False, wgmma=False)),
    ("_fused_gluon_split_kernel", 16, 1, dict(RT.FUSED_TUNING["small"], gluon=True)),
    ("_fused_wgmma_split_kernel", 128, 1, dict(RT.FUSED_TUNING["large"], gluon=False, wgmma=True, wg_ws=False)),
    ("_fused_wgmma_ws_split_kernel", 128, 1, dict(RT.FUSED_TUNING["large"], gluon=False, wgmma=True, wg_ws=True)),
]


def _serves(name):
    if name == "_fused_split_kernel":
        return True
    if "gluon" in name:
        built = RT._fused_gluon_build()
    else:
        built = RT._fused_wgmma_ws_build() if "_ws_" in name else RT._fused_wgmma_build()
    return bool(built) and torch.cuda.get_device_capability() in RT.FUSED_GLUON_CAPABILITY


@pytest.mark.parametrize("name,heads,tq,cfg", KERNELS, ids=[k[0] for k in KERNELS])
def test_f16_partials_match_the_reference_and_the_fp32_partials(name, heads, tq, cfg):
    if not _serves(name):
        pytest.skip(f"{name} does not serve here (no Gluon, or not SM 9.0)")
    lens = [tq, 33, 4096, 513, 2000]
    ps, slots = 16, 65_536
    pool = fp8_pool(slots, page_size=ps)
    pt, sl = table_batch(lens, slots // ps, ps, width=4096 // ps + 3)
    qn, qp = queries(len(lens) * tq, heads)
    kpe = torch.full((1,), 2.0, device=DEV)
    kw = dict(page_table=pt, cache_seqlens=sl, page_size=ps, q_per_request=tq, causal=tq > 1,
              ckv_scale=torch.full((1,), 0.5, device=DEV), kpe_scale=kpe, n_splits=7)
    f16 = dict(cfg, f16_partials=True)
    out = run(qn, qp, pool, **kw, config=f16)
    assert _split_kernel_name().startswith(name)
    assert RT._fused_scratch[(pool.device, True)][0].dtype == torch.float16
    ref = fused_reference(qn, qp, pool, 0.1, rows_table(pt, sl, ps), tq, tq > 1, ckv_scale=0.5, kpe_scale=2.0)
    assert ok(out, ref), rel_err(out, ref)
    assert torch.equal(out, run(qn, qp, pool, **kw, config=f16))
    fp32 = run(qn, qp, pool, **kw, config=dict(cfg, f16_partials=False))
    assert rel_err(out, fp32.float()) < 4e-3  # f16's 2^-11 under the bf16 output's 2^-9
    # the latent's scale is the combine's now: a wrong one must fail the check
    wrong = run(qn, qp, pool, **dict(kw, ckv_scale=torch.full((1,), 0.25, device=DEV)), config=f16)
    assert not ok(wrong, ref)


ONE_SPLIT = [k for k in KERNELS if k[0] != "_fused_gluon_split_kernel"]


@pytest.mark.parametrize("name,heads,tq,cfg", ONE_SPLIT, ids=[k[0] for k in ONE_SPLIT])
def test_one_split_writes_the_bits_split_and_combine_would(name, heads, tq, cfg):
    """A one-split launch writes the output itself: with f16 partials it rounds through f16
    before the latent's scale, as the combine would. (The 16-row Gluon kernel always splits.)"""
    if not _serves(name):
        pytest.skip(f"{name} does not serve here (no Gluon, or not SM 9.0)")
    lens = [tq, 300, 1000]
    ps, slots = 16, 65_536
    pool = fp8_pool(slots, page_size=ps)
    pt, sl = table_batch(lens, slots // ps, ps, width=1000 // ps + 3)
    qn, qp = queries(len(lens) * tq, heads)
    kw = dict(page_table=pt, cache_seqlens=sl, page_size=ps, q_per_request=tq, causal=tq > 1,
              ckv_scale=torch.full((1,), 0.5, device=DEV), n_splits=1)
    launches, real = [], RT._launch
    RT._launch = lambda k, *a, **k2: launches.append(k) or real(k, *a, **k2)
    try:
        direct = run(qn, qp, pool, **kw, config=dict(cfg, f16_partials=True))
    finally:
        RT._launch = real
    assert len(launches) == 1 and _split_kernel_name().startswith(name)
    both = run(qn, qp, pool, **kw, config=dict(cfg, f16_partials=True, direct=False))
    assert torch.equal(direct, both)
    ref = fused_reference(qn, qp, pool, 0.1, rows_table(pt, sl, ps), tq, tq > 1, ckv_scale=0.5)
    assert ok(direct, ref), rel_err(direct, ref)
