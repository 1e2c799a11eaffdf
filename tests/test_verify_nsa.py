"""kvpatch verify driving a patched NSA backend (KVP105's deferred cast), CPU path.

The cases run on tests/data/nsa (a small backend written for these tests, shaped like
SGLang's nsa_backend.py of 2025-11 to 2026-01) through kvpatch/verify/sparse.py, with the
torch references of sparse_reference.py standing in for FlashMLA, tilelang and FA3. Each
sabotage (a broken rewrite or a broken runtime) must make verify fail, naming why. The
real nsa_backend.py is taken from the SGLang mirror where this machine has it (the test
skips, saying so, elsewhere).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from kvpatch.cli.commands import main  # noqa: E402
from kvpatch.runtime import TEMPLATE  # noqa: E402
from kvpatch.verify import run_verify  # noqa: E402
from kvpatch.verify.targets import SPARSE, backend_family  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "nsa"
REL = "python/sglang/srt/layers/attention/nsa_backend.py"
EXTEND, DECODE = "NativeSparseAttnBackend.forward_extend", "NativeSparseAttnBackend.forward_decode"
MIRROR = Path("/work/.mirror/sshleifer+sglang/repo")
# The first and the last commit of nsa_backend.py with the cast KVP105 rewrites: upstream
# removed it on 2026-01-07 (7d757d6f1), and the file became dsa_backend.py in 2026-05.
MIRROR_REVS = ("efbc687c2", "0d244116d")
RELEASES = Path("/work/cache/releases")
NSA_FILES = ("srt/layers/attention/nsa_backend.py", "srt/layers/attention/dsa_backend.py")
# The FP8-compute path's wrapped row-wise step, as the patched fixture spells it.
QUANTIZE_CALL = "quantize_k_cache(_kvpatch_rt.kv_rows_at_kernel(kv_cache, page_table_1.unsqueeze(1), 2))"
FP8 = "+compute_fp8"


def _runtime(body: str) -> str:
    """The runtime apply injects, with definitions appended that replace its own."""
    return TEMPLATE.read_text() + "\n\n" + body


def checkout(tmp_path: Path, runtime_text: str = None, src: Path = FIXTURE) -> Path:
    root = tmp_path / "nsa"
    shutil.copytree(src, root)
    r = CliRunner().invoke(main, ["apply", str(root)])
    assert r.exit_code in (0, 1), r.output
    assert "kv_rows_deferred(" in (root / REL).read_text(), r.output
    if runtime_text is not None:
        (root / REL).with_name("_kvpatch_runtime.py").write_text(runtime_text)
    return root


def edit(root: Path, old: str, new: str, count: int = 1) -> None:
    f = root / REL
    text = f.read_text()
    assert text.count(old) == count, (old, text)
    f.write_text(text.replace(old, new))


def failures(report) -> str:
    return "\n".join(f"{c.site} [{c.label()}]: {c.message}" for c in report.failures)


def test_fixture_patch_passes_every_helper_path(tmp_path):
    r = run_verify(checkout(tmp_path), device="cpu")
    assert r.ok and not r.errors, r.format()
    assert all(c.passed for c in r.cases), r.format()
    # Every kernel path, BF16 and FP8 store, plus the FP8-compute path where the BF16 path
    # reached flash_mla_with_kvcache (flashmla_kv only).
    assert {c.route for c in r.cases if c.qualname == EXTEND} == {
        f"prefill:{i}{s}" for i in ("tilelang", "flashmla_sparse", "flashmla_kv", "fa3") for s in ("", "+store_fp8")
    } | {"prefill:flashmla_kv" + FP8}
    assert {c.route for c in r.cases if c.qualname == DECODE} == {
        "decode:flashmla_sparse", "decode:flashmla_kv", "decode:flashmla_kv" + FP8, "decode:fa3"}
    assert all(c.tolerance.startswith("bit-identical") and c.kv_path == "gather" for c in r.cases)
    # The RAGGED prefix path ran its inline dequantize.
    assert any("dequantize_k_cache_paged" in c.message for c in r.cases if c.variant.endswith("+store_fp8"))
    # The FP8-compute cases quantized and ran the FP8 kernel; nothing is left unverified.
    fp8 = [c for c in r.cases if c.variant.endswith(FP8)]
    assert len(fp8) == 5 and all("flash_mla_with_kvcache, quantize_k_cache" in c.message for c in fp8), r.format()
    assert not r.unverified, r.unverified
    assert any("sgl-kernel's FlashMLA, tilelang and FA3 did not run" in n for n in r.notes), r.notes


def test_sabotage_quantize_wrapper_leaves_rows_uncast(tmp_path):
    """The row-wise quantize handed the deferred buffer unwrapped: its rows were never cast."""
    root = checkout(tmp_path)
    edit(root, QUANTIZE_CALL, "quantize_k_cache(kv_cache)")
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok, r.format()
    assert {c.variant for c in r.failures} == {"flashmla_kv" + FP8}, failures(r)
    assert all(c.qualname == EXTEND for c in r.failures)  # decode hands the store itself: nothing deferred
    assert "NaN: a page the kernel reads was not cast" in failures(r)


def test_sabotage_a_wrong_tile_scale_in_the_packed_rows(tmp_path):
    """The patched side's packed cache with tile 0's scale doubled: the FP8 kernel reads it."""
    root = checkout(tmp_path)
    edit(root, "            kv_cache = " + QUANTIZE_CALL + "\n",
         "            kv_cache = " + QUANTIZE_CALL + "\n"
         "            kv_cache.view(torch.uint8)[..., 512:516].view(torch.float32).mul_(2.0)  # sabotage\n")
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok, r.format()
    assert {(c.qualname, c.variant) for c in r.failures} == {
        (EXTEND, "flashmla_kv" + FP8), (DECODE, "flashmla_kv" + FP8)}, failures(r)
    assert "output differs from the original" in failures(r)
    assert all(c.passed for c in r.cases if not c.variant.endswith(FP8)), failures(r)


def test_sabotage_the_fp8_kernel_handed_an_unquantized_cache(tmp_path):
    root = checkout(tmp_path)
    edit(root, "kv_cache = " + QUANTIZE_CALL, "kv_cache = _kvpatch_rt.kv_rows_at_kernel(kv_cache, "
                                              "page_table_1.unsqueeze(1), 2)  # sabotage: no quantize")
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok and {c.variant for c in r.failures} == {"flashmla_kv" + FP8}, failures(r)
    assert "patched run raised TypeError" in failures(r) and "packed" in failures(r), failures(r)


def test_family_is_recognised_by_structure_not_by_name():
    text = (FIXTURE / REL).read_text()
    assert backend_family(text) == (SPARSE, "NativeSparseAttnBackend")
    renamed = text.replace("NativeSparseAttnBackend", "SomeOtherSparseBackend")
    assert backend_family(renamed) == (SPARSE, "SomeOtherSparseBackend")
    # Helpers that call no sparse kernel: not this family.
    plain = renamed.replace("flash_mla_sparse_fwd", "some_fn").replace("flash_mla_with_kvcache", "some_fn") \
                   .replace("tilelang_sparse_fwd", "some_fn").replace("dequantize_k_cache_paged", "some_fn")
    assert backend_family(plain)[0] != SPARSE


def test_sabotage_a_narrower_index_than_the_kernel_reads(tmp_path):
    root = checkout(tmp_path)
    edit(root, "kv_rows_at_kernel(kv_cache, page_table_1.unsqueeze(1), 1), indices=indices_input",
         "kv_rows_at_kernel(kv_cache, page_table_1[:, :8].unsqueeze(1), 1), indices=indices_input")
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok, r.format()
    assert {c.variant for c in r.failures} >= {"flashmla_sparse"}, failures(r)
    assert all(c.variant.startswith("flashmla_sparse") for c in r.failures), failures(r)
    assert "NaN: a page the kernel reads was not cast" in failures(r)


def test_sabotage_a_wrapper_that_casts_nothing(tmp_path):
    rt = _runtime("def kv_rows_at_kernel(kv, indices, lead=1):\n    return kv  # sabotage: no row cast\n")
    r = run_verify(checkout(tmp_path, rt), device="cpu", quick=True)
    assert not r.ok, r.format()
    assert {c.variant for c in r.failures} >= {"tilelang", "flashmla_sparse", "flashmla_kv", "fa3"}, failures(r)
    assert all(c.qualname == EXTEND for c in r.failures)  # decode casts nothing: it cannot differ
    assert "NaN: a page the kernel reads was not cast" in failures(r)


def test_sabotage_a_wrapper_that_leaves_half_the_rows_uncast(tmp_path):
    rt = _runtime("_kvverify_at = kv_rows_at_kernel\n\n\n"
                  "def kv_rows_at_kernel(kv, indices, lead=1):\n"
                  "    # sabotage: only the first half of each index row is cast\n"
                  "    if isinstance(indices, torch.Tensor) and indices.dim() and indices.shape[-1] > 1:\n"
                  "        indices = indices[..., : indices.shape[-1] // 2]\n"
                  "    return _kvverify_at(kv, indices, lead)\n")
    r = run_verify(checkout(tmp_path, rt), device="cpu", quick=True)
    assert not r.ok, r.format()
    assert {c.variant for c in r.failures} >= {"tilelang", "flashmla_sparse", "flashmla_kv", "fa3"}, failures(r)
    assert "NaN: a page the kernel reads was not cast" in failures(r)


def test_sabotage_a_rewrite_that_casts_the_pool_whole(tmp_path):
    root = checkout(tmp_path)
    edit(root, "_kvpatch_rt.kv_rows_deferred(kv_cache, q.dtype)", "kv_cache.to(q.dtype)")
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok, r.format()
    assert {c.qualname for c in r.failures} == {EXTEND}
    assert all("full-pool cast not removed" in c.message for c in r.failures), failures(r)
    assert all(c.kv_path == "cast" and c.identical_share == 1.0 for c in r.failures)  # outputs alone pass


def test_sabotage_a_deferred_buffer_filled_from_the_whole_pool(tmp_path):
    rt = _runtime("_kvverify_deferred = kv_rows_deferred\n\n\n"
                  "def kv_rows_deferred(kv_buffer, q_dtype):\n"
                  "    buf = _kvverify_deferred(kv_buffer, q_dtype)\n"
                  "    buf.copy_(kv_buffer)  # sabotage: the whole pool cast into the buffer\n"
                  "    return buf\n")
    r = run_verify(checkout(tmp_path, rt), device="cpu", quick=True)
    assert not r.ok, r.format()
    assert all("full-pool cast not removed" in c.message for c in r.failures) and r.failures, failures(r)


def test_sabotage_rows_cast_to_the_wrong_dtype(tmp_path):
    rt = _runtime("_kvverify_deferred = kv_rows_deferred\n\n\n"
                  "def kv_rows_deferred(kv_buffer, q_dtype):\n"
                  "    return _kvverify_deferred(kv_buffer, torch.float16)  # sabotage: not the query's dtype\n")
    r = run_verify(checkout(tmp_path, rt), device="cpu", quick=True)
    assert not r.ok, r.format()
    assert {c.variant for c in r.failures} >= {"tilelang", "flashmla_sparse", "flashmla_kv", "fa3"}, failures(r)
    assert "patched run raised TypeError" in failures(r) and "torch.float16" in failures(r), failures(r)


def test_sabotage_rows_cast_with_a_scale(tmp_path):
    rt = _runtime("_kvverify_at = kv_rows_at_kernel\n\n\n"
                  "def kv_rows_at_kernel(kv, indices, lead=1):\n"
                  "    out = _kvverify_at(kv, indices, lead)\n"
                  "    if out.dtype != torch.float8_e4m3fn and any(\n"
                  "            out.untyped_storage().data_ptr() == b.data_ptr() for b in _deferred_shadows.values()):\n"
                  "        out.mul_(1.5)  # sabotage: a scale the original cast never applied\n"
                  "    return out\n")
    r = run_verify(checkout(tmp_path, rt), device="cpu", quick=True)
    assert not r.ok, r.format()
    assert {c.variant for c in r.failures} >= {"tilelang", "flashmla_sparse", "flashmla_kv", "fa3"}, failures(r)
    assert "output differs from the original" in failures(r)
    assert all(c.qualname == EXTEND for c in r.failures)


def _mirror_file(rev: str, tmp_path: Path) -> Path:
    if not MIRROR.is_dir():
        pytest.skip(f"no SGLang mirror at {MIRROR}: the real nsa_backend.py is not on this machine")
    out = subprocess.run(["git", "--git-dir", str(MIRROR), "show", f"{rev}:{REL}"], capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"the mirror has no {rev}:{REL}: {out.stderr.strip()}")
    src = tmp_path / "src"
    (src / REL).parent.mkdir(parents=True)
    (src / REL).write_text(out.stdout)
    return src


@pytest.mark.real_sglang
@pytest.mark.parametrize("rev", MIRROR_REVS)
def test_real_nsa_backend_verifies(tmp_path, rev):
    r = run_verify(checkout(tmp_path, src=_mirror_file(rev, tmp_path)), device="cpu", quick=True)
    assert r.ok and not r.errors and not r.failures, r.format()
    extend = {c.variant for c in r.cases if c.qualname == EXTEND and c.passed}
    assert {"tilelang", "fa3", "tilelang+store_fp8"} <= extend and len(extend) == 9, r.format()
    assert all(c.passed for c in r.cases if c.qualname == EXTEND), r.format()
    # The FP8-compute path (2025-10: flashmla_decode; later flashmla_kv) ran in extend, where
    # quantize_k_cache gets the deferred buffer, and in decode, where it gets the store.
    kv = "flashmla_decode" if rev == "efbc687c2" else "flashmla_kv"
    fp8 = [c for c in r.cases if c.variant == kv + FP8]
    assert {c.qualname for c in fp8} == {EXTEND, DECODE} and all(c.passed for c in fp8), r.format()
    assert all("quantize_k_cache" in c.message for c in fp8), r.format()
    # ROCm's aiter decode has no reference: skipped, never passed. Nothing else is left unverified.
    assert {c.variant for c in r.cases if not c.passed} == {"aiter"}, r.format()
    assert not r.unverified, r.unverified


@pytest.mark.real_sglang
@pytest.mark.parametrize("version", sorted(p.name for p in RELEASES.glob("0.*")) or ["none"])
def test_release_nsa_backend_verifies_where_kvpatch_rewrites_it(tmp_path, version):
    files = [RELEASES / version / "sglang" / f for f in NSA_FILES if (RELEASES / version / "sglang" / f).is_file()]
    if not files:
        pytest.skip(f"no unpacked SGLang release {version} with an NSA/DSA backend under {RELEASES}")
    src = tmp_path / "rel"
    for f in files:
        dst = src / "sglang" / f.relative_to(RELEASES / version / "sglang")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dst)
    r = CliRunner().invoke(main, ["apply", str(src)])
    assert r.exit_code in (0, 1), r.output
    if "kv_rows_deferred(" not in "".join(f.read_text() for f in src.rglob("*_backend.py")):
        pytest.skip(f"{version}: no KVP105 site in {', '.join(f.name for f in files)} (upstream dropped the "
                    f"pool cast on 2026-01-07): nothing to verify")
    rep = run_verify(src, device="cpu", quick=True)
    assert rep.ok and not rep.failures, rep.format()
