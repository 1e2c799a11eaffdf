"""kvpatch verify on the CPU reference path: passes the golden patch, catches broken ones."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvpatch.runtime import TEMPLATE  # noqa: E402
from kvpatch.verify import run_verify  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "sglang"
GOLDEN = REPO / "tests" / "golden" / "flashinfer_mla_backend.patched.py"
RUNTIME = TEMPLATE  # the joined runtime source, as apply injects it (before its version stamp)
BACKEND = "python/sglang/srt/layers/attention/flashinfer_mla_backend.py"
RT_REL = str(Path(BACKEND).parent / "_kvpatch_runtime.py")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def make_checkout(tmp: Path, patched_text: str = None, runtime_text: str = None,
                  state: bool = True) -> Path:
    """examples/sglang + the golden rewrite + the injected runtime (+ state.json, originals)."""
    if not RUNTIME.is_file():
        pytest.skip(f"{RUNTIME} not present yet")
    root = tmp / "checkout"
    shutil.copytree(EXAMPLE, root)
    orig = (root / BACKEND).read_bytes()
    (root / BACKEND).write_text(patched_text if patched_text is not None else GOLDEN.read_text())
    (root / RT_REL).write_text(runtime_text if runtime_text is not None else RUNTIME.read_text())
    if state:
        copy = root / ".kvpatch" / "originals" / BACKEND
        copy.parent.mkdir(parents=True)
        copy.write_bytes(orig)
        (root / ".kvpatch" / "state.json").write_text(json.dumps({
            "files": [{"path": BACKEND, "original_copy": f".kvpatch/originals/{BACKEND}"}],
            "runtime_files": [RT_REL],
        }))
    return root


def verify(root, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("quick", True)
    return run_verify(root, **kw)


def failures_text(report):
    return "\n".join(f"{c.site} [{c.label()}]: {c.message}" for c in report.failures)


# --- the harness passes the correct patch --------------------------------------------


def test_golden_patch_passes(tmp_path):
    r = verify(make_checkout(tmp_path), quick=False)
    assert r.ok, r.format()
    assert r.files == [BACKEND] and not r.errors
    assert r.gpu_ran is False and r.kernel == "reference" and r.device == "cpu"
    # The example backend has no speculative-decoding paths: those cases say so, unverified.
    spec = [c for c in r.cases if c.mode == "gather" and c.variant]
    assert {c.path for c in spec} == {"target_verify", "draft_extend"}
    assert all(c.status == "skipped" and "the backend has no" in c.message for c in spec)
    gather = [c for c in r.cases if c.mode == "gather" and not c.variant]
    assert gather and all(c.passed for c in gather), r.format()
    assert all(c.identical_share == 1.0 and c.max_abs_err == 0.0 for c in gather)
    assert all(c.kv_path == "gather" and c.kernel == "reference" for c in gather)
    kinds = {(c.qualname.rsplit(".", 1)[-1], c.exec) for c in gather}
    assert kinds == {("forward_decode", "eager"), ("forward_decode", "replay"),
                     ("forward_extend", "eager")}
    heads = {int(re.search(r"heads=(\d+)", c.batch).group(1)) for c in gather
             if c.path == "prefill"}
    assert heads == {16, 32, 64, 128}
    # Native cannot run here: reported as skipped with the reason, never as passed.
    native = [c for c in r.cases if c.mode == "native"]
    assert native and all(c.status == "skipped" for c in native)
    assert "native FP8 needs real FlashInfer" in native[0].message
    assert "CPU reference path only" in r.reason and "native mode not run" in r.reason
    d = r.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["ok"] and d["counts"]["failed"] == 0 and d["cases"][0]["passed"]


def test_replay_covers_longer_and_shorter_batches(tmp_path):
    # The longer replay is what exercises the stale wrapper _kv_indptr_buf.
    r = verify(make_checkout(tmp_path), modes=("gather",))
    replays = [c for c in r.cases if c.exec == "replay" and c.path == "decode"]
    assert {c.batch.split("replay ")[1].split()[0] for c in replays} == {"longer", "shorter"}
    for c in replays:
        total, cap = map(int, re.findall(r"total=(\d+)", c.batch))
        assert (total > cap) == ("longer" in c.batch)
    assert all(c.passed and "replay via FlashInferMLAAttnBackend." in c.message for c in replays)


def test_git_fallback_without_state(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    root = make_checkout(tmp_path, state=False)
    patched = (root / BACKEND).read_text()
    (root / BACKEND).write_text((EXAMPLE / BACKEND).read_text())
    (root / RT_REL).unlink()
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "base"], check=True)
    (root / BACKEND).write_text(patched)
    (root / RT_REL).write_text(RUNTIME.read_text())
    # Uncommitted patch: the original is HEAD.
    r = verify(root, modes=("gather",), graph=False)
    assert r.ok, r.format()
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "kvpatch: apply"], check=True)
    # kvpatch's own commit: the original is HEAD~1.
    r = verify(root, modes=("gather",), graph=False)
    assert r.ok, r.format()
    assert any("originals from git" in n for n in r.notes)


def test_nothing_to_verify(tmp_path):
    root = tmp_path / "plain"
    shutil.copytree(EXAMPLE, root)
    r = verify(root)
    assert not r.ok and not r.cases and "no patched file found" in r.reason


def test_cuda_asked_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = verify(make_checkout(tmp_path), device="cuda")
    assert not r.ok and not r.gpu_ran and "no CUDA device" in r.reason


def test_missing_original_is_an_error(tmp_path):
    root = make_checkout(tmp_path)
    (root / ".kvpatch" / "originals" / BACKEND).unlink()
    r = verify(root)
    assert not r.ok and "original copy" in r.errors[0]


# --- and catches broken ones ------------------------------------------------------


def _wrap_runtime(body: str) -> str:
    """The injected runtime with kv_for_kernel wrapped (contract-level, so it works on
    any runtime implementation and on the Triton path too)."""
    return RUNTIME.read_text() + "\n\n_kvverify_real = kv_for_kernel\n\n" + body


SHIFTED = _wrap_runtime('''
def kv_for_kernel(kv_buffer, wrapper, q_dtype, kv_indptr=None):
    # Sabotage: the gather reads the neighbouring slots; the kernel then reads the right ones.
    idx = wrapper._kv_indices_buf
    saved = idx.clone()
    idx.add_(1)
    try:
        return _kvverify_real(kv_buffer, wrapper, q_dtype, kv_indptr)
    finally:
        idx.copy_(saved)
''')

SHORT = _wrap_runtime('''
def kv_for_kernel(kv_buffer, wrapper, q_dtype, kv_indptr=None):
    # Sabotage: the gather casts one row fewer than the kernel reads.
    full = wrapper._kv_indices_buf
    n = int(wrapper.__dict__[_COUNT_ATTR])
    wrapper._kv_indices_buf = full[: max(0, min(n, full.numel()) - 1)]
    try:
        return _kvverify_real(kv_buffer, wrapper, q_dtype, None)
    finally:
        wrapper._kv_indices_buf = full
''')


STALE = RUNTIME.read_text() + '''

_kvverify_plan_rows = plan_rows


def plan_rows(wrapper, kv_indptr):
    # Sabotage: a graph wrapper's count is noted by its first plan (at capture) and
    # never refreshed, as when it is read from a buffer that replay does not rewrite.
    if not getattr(wrapper, "_use_cuda_graph", False) or wrapper.__dict__.get(_COUNT_ATTR) is None:
        return _kvverify_plan_rows(wrapper, kv_indptr)
    return kv_indptr
'''


def test_catches_stale_indptr_under_replay(tmp_path):
    r = verify(make_checkout(tmp_path, runtime_text=STALE), modes=("gather",))
    assert not r.ok
    assert all(c.passed for c in r.cases if c.exec == "eager" and not c.variant)
    assert r.failures and all(c.exec == "replay" and "replay longer" in c.batch
                              for c in r.failures)
    assert "NaN: a row the kernel reads was not gathered" in failures_text(r)


@pytest.mark.parametrize("runtime_text", [SHIFTED, SHORT], ids=["shifted", "short"])
def test_catches_wrong_rows(tmp_path, runtime_text):
    r = verify(make_checkout(tmp_path, runtime_text=runtime_text), modes=("gather",))
    assert not r.ok
    text = failures_text(r)
    assert {c.qualname for c in r.failures} == {
        "FlashInferMLAAttnBackend.forward_decode", "FlashInferMLAAttnBackend.forward_extend"}
    assert {c.exec for c in r.failures} == {"eager", "replay"}
    assert "output differs from the original" in text
    assert "NaN: a row the kernel reads was not gathered" in text  # poisoned shadow rows
    assert BACKEND in text


def golden_with_site_unpatched(method: str) -> str:
    """The golden patched file with the routed cast of METHOD cast whole again (.to(q.dtype))."""
    return _sub_first(
        r"_kvpatch_rt\.kv_for_mla_run\(\s*(self\.token_to_kv_pool\.get_key_buffer\("
        r"layer\.layer_id\)),[^)]*\)", r"\1.to(q.dtype)",
        GOLDEN.read_text(), within=f"def {method}(")


def _sub_first(pattern, repl, text, within=None):
    start = text.index(within) if within else 0
    m = re.compile(pattern, re.S).search(text, start)
    assert m, f"pattern {pattern!r} not in the golden file"
    return text[: m.start()] + (m.expand(repl) if "\\" in repl else repl) + text[m.end():]


def test_catches_plan_dtype_mismatch(tmp_path):
    # Gather mode, but the decode plan says FP8: FlashInfer (and the reference) reject the
    # bf16 buffer the gather hands to run().
    text = _sub_first(r"_kvpatch_rt\.plan_kv_dtype\([^)]*\)", "torch.float8_e4m3fn",
                      GOLDEN.read_text(), within="class FlashInferMLAIndicesUpdaterDecode")
    root = make_checkout(tmp_path, patched_text=text)
    r = verify(root, modes=("gather",))
    assert not r.ok
    assert {c.qualname for c in r.failures} == {"FlashInferMLAAttnBackend.forward_decode"}
    assert all(c.passed for c in r.cases if c.path == "prefill")
    c = next(c for c in r.failures if c.exec == "eager")
    assert "raised ValueError: ckv_cache.dtype=torch.bfloat16 does not match the planned " \
           "kv_data_type=torch.float8_e4m3fn" in c.message
    assert "(FlashInferMLAAttnBackend.forward_decode)" in c.message
    assert "planned with kv_data_type=torch.float8_e4m3fn at " + BACKEND in c.message
    assert "(FlashInferMLAIndicesUpdaterDecode.call_begin_forward)" in c.message
    # The command line (python -m kvpatch.verify is kvpatch verify) exits non-zero and prints the site.
    p = subprocess.run([sys.executable, "-m", "kvpatch.verify", str(root), "--cpu",
                        "--quick", "--mode", "gather", "--no-graph"],
                       capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"FAIL {BACKEND} FlashInferMLAAttnBackend.forward_decode" in p.stdout
    assert "does not match the planned kv_data_type" in p.stdout


def test_catches_prefill_site_left_unpatched(tmp_path):
    # Outputs stay equal: only the full-pool cast detector can see this.
    text = golden_with_site_unpatched("forward_extend")
    r = verify(make_checkout(tmp_path, patched_text=text), modes=("gather",))
    assert not r.ok
    assert {c.qualname for c in r.failures} == {"FlashInferMLAAttnBackend.forward_extend"}
    assert all(c.passed for c in r.cases if c.path == "decode")
    for c in r.failures:
        assert c.identical_share == 1.0 and c.kv_path == "cast"
        assert "full-pool cast not removed: aten._to_copy.default made a [4096, 1, 576] " \
               "torch.bfloat16 copy of the whole KV pool at " + BACKEND in c.message
        assert "(FlashInferMLAAttnBackend.forward_extend)" in c.message


def test_catches_decode_site_left_unpatched(tmp_path):
    text = golden_with_site_unpatched("forward_decode")
    r = verify(make_checkout(tmp_path, patched_text=text), modes=("gather",), graph=False)
    assert {c.qualname for c in r.failures} == {"FlashInferMLAAttnBackend.forward_decode"}
    assert all("full-pool cast not removed" in c.message for c in r.failures)


# --- pieces ---------------------------------------------------------------------


def test_import_does_not_load_torch():
    code = ("import sys, kvpatch, kvpatch.verify, kvpatch.verify.report, "
            "kvpatch.verify.targets; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def _naive(q_nope, q_pe, ckv, kpe, qo, kvl, rows, causal, scale):
    out = []
    for b in range(len(kvl)):
        r = rows[b]
        c, k = ckv[r].float(), kpe[r].float()
        qn, qp = q_nope[qo[b]:qo[b + 1]].float(), q_pe[qo[b]:qo[b + 1]].float()
        for i in range(qn.shape[0]):
            s = (qn[i] @ c.T + qp[i] @ k.T) * scale  # [H, kv]
            if causal:
                s[:, kvl[b] - qn.shape[0] + i + 1:] = -math.inf
            out.append(torch.softmax(s, -1) @ c)
    return torch.stack(out)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_kernel_math(causal):
    from kvpatch.verify.reference import BatchMLAPagedAttentionWrapper as W
    g = torch.Generator().manual_seed(1)
    slots, heads = 512, 4
    pool = torch.randn((slots, 1, 576), generator=g).to(torch.bfloat16)
    kvl = [7, 30, 1] if not causal else [12, 30, 5]
    qlen = [1, 1, 1] if not causal else [4, 30, 5]
    perm = torch.randperm(slots, generator=g)[: sum(kvl)].to(torch.int32)
    kv_indptr = torch.tensor([0, 7, 37, 38] if not causal else [0, 12, 42, 47], dtype=torch.int32)
    qo = torch.tensor([0] + list(torch.tensor(qlen).cumsum(0)), dtype=torch.int32)
    w = W(torch.empty(8, dtype=torch.uint8))
    w.plan(qo, kv_indptr, perm, torch.tensor(kvl, dtype=torch.int32), heads, 512, 64, 1, causal,
           0.1, torch.bfloat16, torch.bfloat16)
    qn = torch.randn((int(qo[-1]), heads, 512), generator=g).to(torch.bfloat16)
    qp = torch.randn((int(qo[-1]), heads, 64), generator=g).to(torch.bfloat16)
    o = w.run(qn, qp, pool[:, :, :512], pool[:, :, 512:])
    rows = [perm[kv_indptr[b]:kv_indptr[b + 1]].long() for b in range(3)]
    ref = _naive(qn, qp, pool[:, 0, :512], pool[:, 0, 512:], qo.tolist(), kvl, rows, causal, 0.1)
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)


def test_reference_dtype_checks_match_flashinfer():
    from kvpatch.verify.reference import BatchMLAPagedAttentionWrapper as W
    w = W(torch.empty(8, dtype=torch.uint8))
    i = torch.tensor([0, 1], dtype=torch.int32)
    args = (i, i, torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            2, 512, 64, 1, False, 0.1, torch.bfloat16)
    with pytest.raises(ValueError, match="MLA kv_data_type torch.uint8 is not supported"):
        w.plan(*args, torch.uint8)
    w.plan(*args, torch.float8_e4m3fn)
    q, qp = torch.zeros((1, 2, 512), dtype=torch.bfloat16), torch.zeros((1, 2, 64), dtype=torch.bfloat16)
    kv = torch.zeros((4, 1, 576), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ckv_cache.dtype=torch.bfloat16 does not match the "
                                         r"planned kv_data_type=torch.float8_e4m3fn\."):
        w.run(q, qp, kv[:, :, :512], kv[:, :, 512:])
    f8 = kv.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="Exactly one of ckv_scale or ckv_scale_arr"):
        w.run(q, qp, f8[:, :, :512], f8[:, :, 512:])
    w.run(q, qp, f8[:, :, :512], f8[:, :, 512:], ckv_scale=1.0, kpe_scale=1.0)
    w.plan(*args, torch.bfloat16)
    with pytest.raises(ValueError, match="only valid when kv_data_type is FP8"):
        w.run(q, qp, kv[:, :, :512], kv[:, :, 512:], ckv_scale=1.0, kpe_scale=1.0)


def test_null_stub_and_kv_indices_kernel():
    from kvpatch.verify.fakes import KvIndicesKernel
    from kvpatch.verify.stubs import Null
    n = Null("x")
    assert not n and not n.a.b() and not n["k"] and list(n) == [] and not n()
    with n as m:
        assert m is n

    class Sub(Null("sglang.AttentionBackend")):  # a stubbed base class
        pass
    assert Sub.__name__ == "Sub" and Sub.__mro__[1].__name__ == "AttentionBackend"

    r2t = torch.arange(40, dtype=torch.int32).view(4, 10) + 100
    out = torch.full((9,), -1, dtype=torch.int32)
    KvIndicesKernel()[(2,)](r2t, torch.tensor([2, 0]), torch.tensor([3, 5]),
                            torch.tensor([0, 3, 8], dtype=torch.int32), None, out, 10)
    assert out.tolist() == [120, 121, 122, 100, 101, 102, 103, 104, -1]


def test_speculative_fakes_read_the_request_rows():
    """The fakes both sides plan through: verify reads prefix + draft tokens, written in
    place into a graph's buffer when given one; draft extend reads the whole sequence."""
    from kvpatch.verify.fakes import EagleDraftInput, EagleVerifyInput, KVLocPlan, Translator
    r2t = torch.arange(40, dtype=torch.int32).view(4, 10) + 100
    rows, prefix = torch.tensor([2, 0]), torch.tensor([3, 1])
    spec = EagleVerifyInput(r2t, 2, dflash=True)
    buf = torch.full((9,), -1, dtype=torch.int32)
    idx, indptr, qo, mask = spec.generate_attn_arg_prefill(
        req_pool_indices=rows, paged_kernel_lens=prefix, paged_kernel_lens_sum=4,
        translator=Translator(r2t), plan=KVLocPlan(), kv_indices_buf=buf)
    assert idx is buf and buf.tolist() == [120, 121, 122, 123, 124, 100, 101, 102, -1]
    assert indptr.tolist() == [0, 5, 8] and qo.tolist() == [0, 2, 4] and mask is None
    assert spec.calls == ["generate_attn_arg_prefill(kv_indices_buf=)"]
    draft = EagleDraftInput(r2t, 2, 2, "cpu")
    idx, indptr, qo, _ = draft.generate_attn_arg_prefill(rows, torch.tensor([4, 2]), 6, r2t)
    assert idx.tolist() == [120, 121, 122, 123, 100, 101] and qo.tolist() == [0, 2, 4]
    out = torch.zeros(3, dtype=torch.int32)
    assert Translator(r2t).pack_read_stream(
        KVLocPlan(), req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([3]),
        indptr=torch.tensor([0, 3], dtype=torch.int32), out=out) is False
    assert out.tolist() == [110, 111, 112]


def test_originals_from_git_after_a_real_apply(tmp_path):
    """A git apply keeps no copies: verify reads the original from the recorded base, hash-checked."""
    from click.testing import CliRunner

    from kvpatch.cli.commands import main

    root = tmp_path / "checkout"
    shutil.copytree(EXAMPLE, root)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "base"], check=True)
    base = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    r = CliRunner().invoke(main, ["apply", "--no-commit", str(root)])
    assert r.exit_code == 0, r.output
    assert not (root / ".kvpatch" / "originals").exists()
    r = verify(root, modes=("gather",), graph=False)
    assert r.ok, r.format()
    # git answers other bytes for the base blob now: refused, not verified against them
    blob = subprocess.run(git + ["rev-parse", f"{base}:{BACKEND}"], check=True, capture_output=True,
                          text=True).stdout.strip()
    (root / "other.txt").write_text("x = 1\n")
    other = subprocess.run(git + ["hash-object", "-w", "other.txt"], check=True, capture_output=True,
                           text=True).stdout.strip()
    subprocess.run(git + ["replace", blob, other], check=True)
    r = verify(root, modes=("gather",), graph=False)
    assert not r.ok and "not the recorded original" in " ".join(r.errors), r.format()


def test_a_patched_file_no_driver_covers_is_named_not_verified(tmp_path):
    """A rewrite verify cannot prove is never folded into an OK: the verdict is PARTLY
    VERIFIED, the file is named, and the CLI exits 3. Here, aiter's decode example: verify
    drives it, but its original cannot run in the harness (the example leaves names such as
    fp8_dtype and o unbound), so every case skips and nothing proves the rewrite."""
    from click.testing import CliRunner

    from kvpatch.cli.commands import main
    from kvpatch.engine import analyze_source
    from kvpatch.output.exitcodes import EXIT_UNVERIFIED
    from kvpatch.rewrite.transform import plan_rewrite
    from kvpatch.rule import load_rules
    from rules._page_table_examples import AITER_DECODE

    aiter = "python/sglang/srt/layers/attention/aiter_backend.py"
    root = make_checkout(tmp_path)
    original = "from sglang.srt.layers.attention.base_attn_backend import AttentionBackend\n" + AITER_DECODE
    rules = load_rules()
    rw = plan_rewrite(analyze_source(aiter, original.encode(), rules), rules)
    assert rw is not None and rw.sites, "the aiter example is a site apply rewrites"
    (root / aiter).write_bytes(rw.new_bytes)
    (root / ".kvpatch" / "originals" / aiter).write_text(original)
    state = json.loads((root / ".kvpatch" / "state.json").read_text())
    state["files"].append({"path": aiter, "original_copy": f".kvpatch/originals/{aiter}"})
    (root / ".kvpatch" / "state.json").write_text(json.dumps(state))

    r = verify(root, modes=("gather",))
    assert r.ok and BACKEND in r.files, r.format()  # what ran passed ...
    assert len(r.unverified) == 1 and r.unverified[0].startswith(aiter)  # ... and this did not run
    text = r.format()
    assert text.splitlines()[0].endswith("PARTLY VERIFIED (device=cpu, kernel=reference, gpu_ran=False)")
    assert f"NOT VERIFIED: {aiter}" in text
    assert r.to_dict()["unverified"] == r.unverified
    res = CliRunner().invoke(main, ["verify", str(root), "--cpu", "--quick", "--mode", "gather", "--no-graph"])
    assert res.exit_code == EXIT_UNVERIFIED, res.output
    assert "not verified: 1 patched file(s)" in res.output


def test_fused_counted_counts_launches_and_which_split_kernel_each_plan_took():
    """verify says which path served a case (fused launches) and, for a run, how many fused
    plans took the 16-row Gluon split kernel, the 64-row one and the Triton one (a runtime
    without the 64-row kernel too); the runtime is restored."""
    import types

    from kvpatch.verify import judge

    def plan(rt):  # the runtime's order: the 16-row Gluon kernel, then the 64-row one
        picked = rt._fused_gluon_choice()
        if picked is None and hasattr(rt, "_fused_wgmma_choice"):
            picked = rt._fused_wgmma_choice()
        return picked

    g_picks, w_picks = iter([("gluon kernel",), None, None, None]), iter([("wgmma kernel",), None, None])
    rt = types.SimpleNamespace(fused_mla=lambda *a: plan(rt), _fused_gluon_choice=lambda: next(g_picks),
                               _fused_wgmma_choice=lambda: next(w_picks))
    real_mla, real_choice, real_wgmma = rt.fused_mla, rt._fused_gluon_choice, rt._fused_wgmma_choice
    calls, before = [0], dict(judge.FUSED_KERNELS)
    with judge.fused_counted(rt, calls):
        for _ in range(4):
            rt.fused_mla()
    assert calls == [4]
    got = {k: judge.FUSED_KERNELS[k] - before.get(k, 0) for k in ("gluon", "wgmma", "triton")}
    assert got == {"gluon": 1, "wgmma": 1, "triton": 2}
    assert rt.fused_mla is real_mla and rt._fused_gluon_choice is real_choice
    assert rt._fused_wgmma_choice is real_wgmma
    old_rt = types.SimpleNamespace(fused_mla=lambda *a: plan(old_rt), _fused_gluon_choice=lambda: None)
    before = dict(judge.FUSED_KERNELS)
    with judge.fused_counted(old_rt, calls):
        old_rt.fused_mla()
    assert judge.FUSED_KERNELS["triton"] - before.get("triton", 0) == 1
