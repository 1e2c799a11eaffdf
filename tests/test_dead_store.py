"""Issue 7: a cast whose result is never read as data still casts the whole pool.
Audit reports it hot and says it is a dead store, never "no consumer" and never
an escaping result."""

from __future__ import annotations

import textwrap

import pytest

from kvpatch.engine import analyze_source
from kvpatch.rule import load_rules
from kvpatch.sites import HOT

REL = "python/sglang/srt/layers/attention/foo_backend.py"
HEAD = '''
class FooBackend:
    def forward_decode(self, q, layer, forward_batch):
'''
CAST = "self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"
CASES = {
    "overwritten": (f"kv = {CAST}\nkv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
                    "return kern(q, kv, forward_batch.kv_indices)", "`kv` is overwritten at line 5 before any read"),
    "overwritten-after-view": (f"kv = {CAST}.view(-1, 1, 576)\nif q is None:\n    return None\n"
                               "kv = forward_batch.other\nreturn kern(q, kv)", "`kv` is overwritten at line 7"),
    "never-read": (f"kv = {CAST}\nreturn kern(q, forward_batch.kv_indices)", "`kv` is never read"),
    "discarded": (f"{CAST}\nreturn kern(q, forward_batch.kv_indices)", "its result is discarded"),
    "metadata-only": (f"kv = {CAST}\nreturn kern(q, kv.shape[0])", "read only for metadata"),
}


def _site(body: str):
    code = HEAD + textwrap.indent(body, " " * 8) + "\n"
    fa = analyze_source(REL, code.encode(), load_rules())
    assert not fa.errors, fa.errors
    (site,) = fa.sites
    return site


@pytest.mark.parametrize("name", sorted(CASES))
def test_dead_cast_is_hot_and_named_a_dead_store(name):
    body, detail = CASES[name]
    site = _site(body)
    assert site.status == HOT and not site.fixable
    assert "dead store" in site.reason and detail in site.reason, site.reason
    assert "no consumer" not in site.reason


@pytest.mark.parametrize("body", [
    f"kv = {CAST}\nif q is None:\n    kv = forward_batch.other\nreturn kern(q, kv)",  # read on the other path
    f"k, v = {CAST}.split([512, 64], dim=-1)\nreturn kern(q, k, v)",  # unpacked: not proven dead
])
def test_a_cast_read_on_some_path_is_not_dead(body):
    assert "dead store" not in _site(body).reason


def test_a_cast_reaching_helper_methods_names_them_and_what_a_rewrite_needs():
    """NSA's shape: the cast goes to this class's own helpers (one with page_table=), and to
    a function with no index structure; the reason names each and what a rewrite needs."""
    site = _site(f"kv = {CAST}\nif q is None:\n    return self._forward_fa3(q, kv, page_table=forward_batch.pt)\n"
                 "return dequantize_k_cache_paged(kv)")
    assert site.status == HOT and not site.fixable
    assert "`self._forward_fa3` is a method of this class" in site.reason, site.reason
    assert "`dequantize_k_cache_paged` takes the whole cast pool" in site.reason, site.reason
    assert "no rule rewrites this consumer" not in site.reason
