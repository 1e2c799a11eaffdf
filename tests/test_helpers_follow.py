"""Issue 20, kind 2: a pool cast handed to `self.<helper>(...)` is followed into the helper
(kvpatch/analysis/helpers.py), and the reason names the kernel each helper reaches with its
index argument, or why the helper was not followed. Fixtures are small, shaped like SGLang's
NSA backend (nsa_backend.py, 2025-10 to 2026-01)."""

from __future__ import annotations

import textwrap

import pytest

from kvpatch.engine import analyze_source
from kvpatch.rule import load_rules

HEAD = '''
class NativeSparseAttnBackend:
    def forward_extend(self, q, k, v, layer, forward_batch, topk_indices=None):
        kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        kv_cache = kv_cache.to(q.dtype)
        page_table_1 = topk_indices
        return self._forward_sparse(q_all=q, kv_cache=kv_cache, page_table_1=page_table_1)

'''

SPARSE = '''
    def _forward_sparse(self, q_all, kv_cache, page_table_1):
        n = kv_cache.shape[0]
        o, _, _ = flash_mla_sparse_fwd(q=q_all, kv=kv_cache, indices=page_table_1.unsqueeze(1), sm_scale=1.0)
        return o
'''


def _site(src: str, rules):
    fa = analyze_source("python/sglang/srt/layers/attention/nsa_backend.py", textwrap.dedent(src).encode(), rules)
    (site,) = [s for s in fa.sites if s.qualname.endswith("forward_extend")]
    return site


def _reason(src: str) -> str:
    """The report's reason (KVP201, KVP105 left out: it would rewrite the followed cases),
    after checking what KVP105 makes of the same code: a rewrite exactly when every helper
    is followed to a kernel with its index."""
    site = _site(src, [r for r in load_rules(None) if r.ID != "KVP105"])
    assert site.status == "hot" and not site.fixable
    full = _site(src, load_rules(None))
    assert full.fixable == ("every one reaches" in site.reason), full.reason
    return site.reason


def test_followed_to_a_known_sparse_kernel():
    r = _reason(HEAD + SPARSE)
    assert "`self._forward_sparse` -> `flash_mla_sparse_fwd` (rows from `page_table_1.unsqueeze(1)`" in r
    assert "every one reaches a kernel whose rows kvpatch knows" in r
    assert "not followed" not in r


def test_positional_argument_is_bound_to_its_parameter():
    src = HEAD.replace("self._forward_sparse(q_all=q, kv_cache=kv_cache, page_table_1=page_table_1)",
                       "self._forward_sparse(q, kv_cache, page_table_1)") + SPARSE
    assert "-> `flash_mla_sparse_fwd` (rows from `page_table_1.unsqueeze(1)`" in _reason(src)


def test_views_and_row_wise_calls_carry_the_value():
    helper = '''
    def _forward_sparse(self, q_all, kv_cache, page_table_1):
        kv_cache = kv_cache.view(-1, 64, 1, 576)
        kv_cache = quantize_k_cache(kv_cache)
        o, _ = flash_mla_with_kvcache(q=q_all, k_cache=kv_cache, indices=page_table_1.unsqueeze(1))
        return o
'''
    assert "-> `flash_mla_with_kvcache` (rows from `page_table_1.unsqueeze(1)`" in _reason(HEAD + helper)


@pytest.mark.parametrize("extra, why", [
    ("class Sub(NativeSparseAttnBackend):\n    def _forward_sparse(self, q_all, kv_cache, page_table_1):\n"
     "        return kv_cache\n", "`Sub` in this file overrides `_forward_sparse`"),
    ("    def other(self):\n        self._forward_sparse = None\n", "`self._forward_sparse` is assigned"),
    ("    def other(self, name):\n        return getattr(self, name)\n", "the class calls `getattr`"),
    ("    def _forward_sparse(self, q_all, kv_cache, page_table_1):\n        return None\n",
     "`_forward_sparse` is defined 2 times in the class"),
    ("    _forward_sparse = staticmethod(print)\n", "binds names other than by `def`"),
])
def test_not_followed_when_the_call_may_land_elsewhere(extra, why):
    r = _reason(HEAD + SPARSE + extra)
    assert "`self._forward_sparse` not followed" in r and why in r
    assert "every one reaches" not in r


def test_a_value_that_escapes_the_kernel_is_named():
    helper = SPARSE.replace("        return o\n", "        log_rows(kv_cache)\n        return o\n")
    r = _reason(HEAD + helper)
    assert "the value also reaches line" in r and "every one reaches" not in r


def test_a_value_stored_in_the_helper_is_not_followed():
    helper = SPARSE.replace("        return o\n", "        self.last = kv_cache\n        return o\n")
    r = _reason(HEAD + helper)
    assert "not followed (the value is stored into `self.last`" in r and "every one reaches" not in r


def test_starred_arguments_are_not_followed():
    src = HEAD.replace("self._forward_sparse(q_all=q, kv_cache=kv_cache, page_table_1=page_table_1)",
                       "self._forward_sparse(*[q, kv_cache, page_table_1])") + SPARSE
    r = _reason(src)
    assert "every one reaches" not in r


def test_a_kernel_without_its_index_argument_is_a_dense_read():
    helper = SPARSE.replace(", indices=page_table_1.unsqueeze(1)", "")
    r = _reason(HEAD + helper)
    assert "no index argument: a dense read" in r and "every one reaches" not in r


def test_kvp105_apply_then_revert_is_byte_exact_and_idempotent(tmp_path):
    """KVP105's rewrite through the CLI on a git checkout: apply, a second apply that finds
    nothing to do, revert to the original bytes."""
    import subprocess
    import sys

    from kvpatch.rules._helper_examples import NSA, NSA_PATCHED

    rel = tmp_path / "python/sglang/srt/layers/attention/nsa_backend.py"
    rel.parent.mkdir(parents=True)
    original = textwrap.dedent(NSA).encode()
    rel.write_bytes(original)

    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True,
                       env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                            "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "original")

    def kvpatch(*a):
        return subprocess.run([sys.executable, "-m", "kvpatch", *a, str(tmp_path)], capture_output=True, text=True)

    r = kvpatch("apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert rel.read_text() == textwrap.dedent(NSA_PATCHED)
    again = kvpatch("apply", "--dry-run")
    assert "+++" not in again.stdout and "kv_rows" not in again.stdout, again.stdout  # no diff: nothing left
    assert rel.read_text() == textwrap.dedent(NSA_PATCHED)
    r = kvpatch("revert")
    assert r.returncode == 0, r.stdout + r.stderr
    assert rel.read_bytes() == original
