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


def verify(root):
    return run_verify(root, device="cuda", log=print)


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
    assert r.failures and all(c.exec == "graph" and "kv_lens=[150, 70, 190]" in c.batch for c in r.failures)
