"""kvpatch verify for the FA3 family on a CUDA GPU: the reference FA3 kernel and the
runtime's Triton page kernel captured in a CUDA graph, replayed with the page table and
lengths rewritten in place. Skipped, with the reason, where there is no CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the FA3 GPU verify tests need one (the CPU path is "
                "tests/test_verify_fa3.py)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_verify_fa3 import (CASCADE_OMITTED, FA3_SITES, PAGE_SIZE_IGNORED, SHORT, STALE,  # noqa: E402
                             fa3_cases, failures_text, fixture_checkout)

from kvpatch.verify import run_verify  # noqa: E402

pytestmark = pytest.mark.gpu


def verify(root, modes=("gather", "native")):
    return run_verify(root, modes=modes, device="cuda", log=print)


# What `kvpatch verify` checks by default (--mode all): the routed form's fused path too.
WITH_FUSED = ("gather", "native", "fused")
# The replays that read more rows than at capture: decode, and target verify (tq - 1 more).
GROWN = ("kv_lens=[150, 70, 190]", "kv_lens=[152, 72, 192]")


def test_fixture_passes_under_graph_capture(tmp_path):
    r = verify(fixture_checkout(tmp_path))
    print(r.format())
    assert r.ok, r.format()
    cases = fa3_cases(r)
    assert {c.exec for c in cases if c.passed} == {"eager", "graph"}
    assert {c.qualname for c in cases if c.passed} == FA3_SITES


@pytest.mark.parametrize("runtime_text", [SHORT, PAGE_SIZE_IGNORED, CASCADE_OMITTED],
                         ids=["short", "page_size_ignored", "cascade_omitted"])
def test_catches_broken_casts(tmp_path, runtime_text):
    r = verify(fixture_checkout(tmp_path, runtime_text))
    assert not r.ok and r.failures, r.format()
    assert "output differs from the original" in failures_text(r)


def test_catches_stale_lengths_in_a_captured_graph(tmp_path):
    r = verify(fixture_checkout(tmp_path, STALE))
    assert not r.ok
    assert all(c.passed for c in fa3_cases(r) if c.exec == "eager")
    assert r.failures and all(c.exec == "graph" and c.batch.startswith(GROWN, c.batch.index("kv_lens="))
                              for c in r.failures), r.format()
    assert any(c.path == "decode" for c in r.failures), r.format()


# --- the routed form (KVP106): the fused FP8 path, judged within tolerance --------------
from test_verify_fa3 import ROUTED, RUNTIME  # noqa: E402


def _wrap_fused(body: str) -> str:
    return RUNTIME.read_text() + "\n\n_kvverify_fused = fused_mla\n\n" + body


FUSED_WRONG_ROWS = _wrap_fused('''
def fused_mla(q_nope, q_pe, kv_buffer, out, sm_scale, **kw):
    # Sabotage: each request reads the next request's pages.
    kw["page_table"] = kw["page_table"].roll(1, 0)
    kw["cache_seqlens"] = kw["cache_seqlens"].roll(1, 0)
    return _kvverify_fused(q_nope, q_pe, kv_buffer, out, sm_scale, **kw)
''')
FUSED_WRONG_SCALE = _wrap_fused('''
def fused_mla(q_nope, q_pe, kv_buffer, out, sm_scale, **kw):
    # Sabotage: the softmax scale off by 20%.
    return _kvverify_fused(q_nope, q_pe, kv_buffer, out, sm_scale * 1.2, **kw)
''')
FUSED_STALE = _wrap_fused('''
_kvverify_seen = {}


def fused_mla(q_nope, q_pe, kv_buffer, out, sm_scale, **kw):
    # Sabotage: the lengths are a copy taken when a buffer is first seen (a graph replays
    # that copy, not the lengths SGLang rewrites in place).
    sl = kw["cache_seqlens"]
    key = sl.data_ptr()
    if key not in _kvverify_seen:
        _kvverify_seen[key] = (sl, sl.clone())
    kw["cache_seqlens"] = _kvverify_seen[key][1]
    return _kvverify_fused(q_nope, q_pe, kv_buffer, out, sm_scale, **kw)
''')


def test_routed_fixture_verifies_fused_and_gathered(tmp_path):
    r = verify(fixture_checkout(tmp_path, form=ROUTED), WITH_FUSED)
    print(r.format())
    assert r.ok, r.format()
    fused = [c for c in fa3_cases(r) if c.mode == "fused" and c.kv_path == "fused" and c.passed]
    assert {c.exec for c in fused} == {"eager", "graph"}, r.format()
    assert all("worst output vector" in c.tolerance for c in fused)
    gathered = [c for c in fa3_cases(r) if c.mode == "gather" and c.passed]
    assert gathered and all(c.tolerance.startswith("bit-identical") for c in gathered)
    assert not [u for u in r.unverified if "fused" in u], r.unverified


@pytest.mark.parametrize("runtime_text", [FUSED_WRONG_ROWS, FUSED_WRONG_SCALE], ids=["wrong_rows", "wrong_scale"])
def test_fused_sabotage_fails(tmp_path, runtime_text):
    r = verify(fixture_checkout(tmp_path, runtime_text, form=ROUTED), WITH_FUSED)
    assert not r.ok
    assert "fused output off the original" in failures_text(r), r.format()
    assert all(c.mode == "fused" for c in r.failures)  # the gathered path does not call fused_mla


def test_fused_stale_lengths_fail_under_graph_replay(tmp_path):
    r = verify(fixture_checkout(tmp_path, FUSED_STALE, form=ROUTED), WITH_FUSED)
    assert not r.ok
    assert any(c.exec == "graph" and c.mode == "fused" for c in r.failures), r.format()
