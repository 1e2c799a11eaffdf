"""kvpatch verify (CPU reference path) on the real SGLang releases 0.5.16-0.5.23.

The releases' source is never committed: the trees come from KVPATCH_SGLANG_RELEASES
(unpacked wheels or the wheels, see tests/test_releases.py), else from
/work/cache/releases where this project's machines keep them; otherwise every test
here skips and says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from kvpatch.cli.commands import main  # noqa: E402
from kvpatch.verify import run_verify  # noqa: E402
from kvpatch.verify.world import QUICK_SHAPES  # noqa: E402
from test_releases import FI_MLA_IN_PACKAGE, RELEASES, RELEASES_ENV, _release_root  # noqa: E402
from test_verify_cpu import SHIFTED, STALE, _wrap_runtime  # noqa: E402

LOCAL_RELEASES = Path("/work/cache/releases")
XPU_IN_PACKAGE = "srt/layers/attention/xpu_backend.py"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def patched_release(version, tmp_path_factory, monkeypatch, runtime_text=None) -> Path:
    """A patched copy of the release (`kvpatch apply`), its runtime optionally replaced."""
    if not os.environ.get(RELEASES_ENV) and LOCAL_RELEASES.is_dir():
        monkeypatch.setenv(RELEASES_ENV, str(LOCAL_RELEASES))
    src = _release_root(version, tmp_path_factory.mktemp(f"whl-{version}"))
    root = tmp_path_factory.mktemp(f"rel-{version}")
    shutil.copytree(src / "sglang", root / "sglang")
    r = CliRunner().invoke(main, ["apply", str(root)])
    assert r.exit_code in (0, 1), r.output
    if runtime_text is not None:
        rt = (root / "sglang" / FI_MLA_IN_PACKAGE).parent / "_kvpatch_runtime.py"
        rt.write_text(runtime_text)
    return root


def _backend_digest(version):
    """Releases with a byte-identical backend file verify the same: run one of each."""
    base = Path(os.environ.get(RELEASES_ENV) or LOCAL_RELEASES)
    f = base / version / "sglang" / FI_MLA_IN_PACKAGE
    return hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else version


def distinct_releases():
    seen, out = set(), []
    for v in RELEASES:
        d = _backend_digest(v)
        if d not in seen:
            seen.add(d)
            out.append(v)
    return out


@pytest.mark.real_sglang
@pytest.mark.parametrize("version", distinct_releases())
def test_release_verifies(tmp_path_factory, monkeypatch, version):
    r = run_verify(patched_release(version, tmp_path_factory, monkeypatch), modes=("gather",),
                   device="cpu", quick=True)
    assert r.ok, r.format()
    ran = {(c.route, c.exec) for c in r.cases if c.passed}
    expect = {("decode", "eager"), ("decode", "replay"), ("prefill", "eager"),
              ("target_verify:eagle", "eager"), ("target_verify:eagle", "replay")}
    source = (Path(r.root) / "sglang" / FI_MLA_IN_PACKAGE).read_text()
    if "_build_fast_verify_plan_kwargs" in source:   # 0.5.19+: DFLASH's own replay plan
        expect.add(("target_verify:dflash", "replay"))
    if "is_draft_extend" in source:                   # 0.5.18+: the draft-extend fast plan
        expect.add(("draft_extend:eagle", "eager"))
    assert expect <= ran, r.format()
    assert not r.failures and not r.errors
    # XPU's sgl-kernel paged MLA sites (decode from 0.5.16, routed by KVP108 through
    # paged_mla; extend's flash_mla_prefill from 0.5.20, KVP103's page cast) are rewritten
    # through the kernels' signatures and verified like FA3's.
    xpu = (Path(r.root) / "sglang" / XPU_IN_PACKAGE).read_text()
    routed = "_kvpatch_rt.paged_mla(\n                flash_mla_decode,"  # the patched decode call
    for kernel, method in ((routed, "forward_decode"), ("flash_mla_prefill(", "forward_extend")):
        if kernel in xpu:
            assert f"XPUAttentionBackend.{method}" in {c.qualname for c in r.cases if c.passed}, r.format()
    assert "flash_mla_decode(" not in xpu and (routed in xpu) == ("flash_mla_decode" in xpu)
    # What did not run says why, and is never counted as passed.
    assert all(c.message for c in r.skipped)


# --- sabotage on 0.5.23, the release with every speculative path ------------------------


SPEC_RELEASE = "0.5.23"

INDPTR_BUF = _wrap_runtime('''
def kv_for_kernel(kv_buffer, wrapper, q_dtype, kv_indptr=None):
    # Sabotage (the count kvpatch used before plan_rows): rows counted from the wrapper's
    # own indptr buffer, which the DFLASH verify replay (fast_mla_decode_plan) never refreshes.
    wrapper.__dict__[_COUNT_ATTR] = wrapper._kv_indptr_buf[-1:].to(torch.int64)
    return _kvverify_real(kv_buffer, wrapper, q_dtype, kv_indptr)
''')

# The DFLASH replay's plan call, as kvpatch routes it and as a rewrite that missed it.
DFLASH_ROUTED = '_kvpatch_rt.plan_rows(wrapper_paged, fast_verify_plan_kwargs["kv_indptr_cpu"])'
DFLASH_MISSED = 'fast_verify_plan_kwargs["kv_indptr_cpu"]'


def sabotaged(tmp_path_factory, monkeypatch, runtime_text=None, backend_edit=None):
    root = patched_release(SPEC_RELEASE, tmp_path_factory, monkeypatch, runtime_text)
    if backend_edit is not None:
        f = root / "sglang" / FI_MLA_IN_PACKAGE
        old, new = backend_edit
        text = f.read_text()
        assert text.count(old) == 1, f"{old!r} not once in the patched {SPEC_RELEASE}"
        f.write_text(text.replace(old, new))
    r = run_verify(root, modes=("gather",), device="cpu", quick=True)
    assert not r.ok and not r.errors, r.format()
    return r


def failed_routes(r):
    return {(c.route, c.exec, c.batch.split("replay ")[-1].split()[0] if "replay " in c.batch
             else "") for c in r.failures}


@pytest.mark.real_sglang
def test_catches_count_from_the_wrapper_indptr_buffer(tmp_path_factory, monkeypatch):
    """Issue 8's bug: on 0.5.23's DFLASH verify replay the wrapper's indptr buffer
    keeps the capture-time count, so a longer batch reads rows nobody gathered."""
    r = sabotaged(tmp_path_factory, monkeypatch, runtime_text=INDPTR_BUF)
    assert ("target_verify:dflash", "replay", "longer") in failed_routes(r), r.format()
    # fast_mla_prefill_plan (EAGLE/MTP) refreshes that buffer: those replays stay right.
    assert all(c.passed for c in r.cases if c.route == "target_verify:eagle")
    assert all("NaN: a row the kernel reads was not gathered" in c.message
               for c in r.failures if c.route == "target_verify:dflash")


@pytest.mark.real_sglang
def test_catches_a_missed_dflash_plan_call(tmp_path_factory, monkeypatch):
    r = sabotaged(tmp_path_factory, monkeypatch, backend_edit=(DFLASH_ROUTED, DFLASH_MISSED))
    assert failed_routes(r) == {("target_verify:dflash", "replay", "longer")}, r.format()


@pytest.mark.real_sglang
def test_catches_stale_count_on_every_graph_path(tmp_path_factory, monkeypatch):
    r = sabotaged(tmp_path_factory, monkeypatch, runtime_text=STALE)
    assert failed_routes(r) == {("decode", "replay", "longer"),
                                ("target_verify:eagle", "replay", "longer"),
                                ("target_verify:dflash", "replay", "longer")}, r.format()


@pytest.mark.real_sglang
def test_catches_wrong_rows_on_the_speculative_paths(tmp_path_factory, monkeypatch):
    r = sabotaged(tmp_path_factory, monkeypatch, runtime_text=SHIFTED)
    routes = {(route, exec_) for route, exec_, _ in failed_routes(r)}
    assert {("target_verify:eagle", "eager"), ("target_verify:eagle", "replay"),
            ("target_verify:dflash", "replay"), ("draft_extend:eagle", "eager")} <= routes


# --- unified memory: the request table holds virtual ids, the kernel reads translated rows ---

UNIFIED = dataclasses.replace(QUICK_SHAPES, unified=True)


@pytest.mark.real_sglang
@pytest.mark.parametrize("version", ["0.5.19", SPEC_RELEASE])
def test_release_verifies_under_unified_memory(tmp_path_factory, monkeypatch, version):
    """Issue 8: correct under unified memory. The rows come from the plan call's
    (translated) indices, never from req_to_token, so the patched side reads the
    same pool rows as the original."""
    r = run_verify(patched_release(version, tmp_path_factory, monkeypatch), modes=("gather",),
                   device="cpu", quick=True, shapes=UNIFIED)
    assert r.ok and not r.errors, r.format()
    assert any("unified memory: the kernels read translated pool rows" in n for n in r.notes), r.notes
    assert {("decode", "replay"), ("prefill", "eager"), ("target_verify:eagle", "replay")} <= \
        {(c.route, c.exec) for c in r.cases if c.passed}, r.format()


@pytest.mark.real_sglang
def test_catches_wrong_rows_under_unified_memory(tmp_path_factory, monkeypatch):
    root = patched_release(SPEC_RELEASE, tmp_path_factory, monkeypatch, SHIFTED)
    r = run_verify(root, modes=("gather",), device="cpu", quick=True, shapes=UNIFIED)
    assert not r.ok and not r.errors, r.format()
    assert {"decode", "prefill", "target_verify:eagle"} <= {c.route for c in r.failures}, r.format()


@pytest.mark.real_sglang
def test_unified_memory_on_a_release_without_a_translator_is_not_called_verified(
        tmp_path_factory, monkeypatch):
    r = run_verify(patched_release(RELEASES[0], tmp_path_factory, monkeypatch), modes=("gather",),
                   device="cpu", quick=True, shapes=UNIFIED)
    assert "unified memory not exercised" in r.format(), r.format()


# --- decode context parallelism: one rank's shard of every request ---------------------------


def dcp_shapes(rank):
    return dataclasses.replace(QUICK_SHAPES, dcp=2, dcp_rank=rank)


@pytest.mark.real_sglang
@pytest.mark.parametrize("version,rank", [(RELEASES[0], 1), (SPEC_RELEASE, 0), (SPEC_RELEASE, 1)])
def test_release_verifies_under_dcp(tmp_path_factory, monkeypatch, version, rank):
    """Issue 8: correct under DCP. SGLang's DCP planner shards kv_indices and
    rewrites kv_indptr in place before the plan call; the runtime takes its rows
    from that plan call, so it gathers exactly this rank's shard (pool rows from
    the planner itself before 0.5.19, from the translator after)."""
    r = run_verify(patched_release(version, tmp_path_factory, monkeypatch), modes=("gather",),
                   device="cpu", quick=True, shapes=dcp_shapes(rank))
    assert r.ok and not r.errors, r.format()
    assert any(f"DCP rank {rank} of 2" in n for n in r.notes), r.notes
    assert {("decode", "eager"), ("decode", "replay")} <= {(c.route, c.exec) for c in r.cases if c.passed}
    # What DCP does not run is skipped with the reason, never passed (DCP shards the FlashInfer
    # MLA backend's rows; the page-table family's paths the original cannot run skip for that).
    assert all("not run under DCP" in c.message for c in r.skipped
               if c.route != "decode" and c.file.endswith(FI_MLA_IN_PACKAGE))
    from kvpatch.verify import fakes, stubs
    assert fakes.DCP.size == 1 and not stubs.PARALLEL.dcp_enabled, "DCP left on after the run"


@pytest.mark.real_sglang
def test_catches_stale_count_under_dcp(tmp_path_factory, monkeypatch):
    root = patched_release(SPEC_RELEASE, tmp_path_factory, monkeypatch, STALE)
    r = run_verify(root, modes=("gather",), device="cpu", quick=True, shapes=dcp_shapes(1))
    assert not r.ok and not r.errors, r.format()
    assert ("decode", "replay", "longer") in failed_routes(r), r.format()

