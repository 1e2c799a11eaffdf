"""Verify for KVP104's deleted dead casts: symbolic runs of each shortened function.

The rule's own examples must compare equal; sabotaged deletions (a cast some path reads,
a live statement deleted along with the dead one) must fail, in the function and through
`kvpatch verify` on an applied checkout.
"""

from __future__ import annotations

import textwrap

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")  # kvpatch verify needs it; the symbolic check itself does not

from kvpatch.cli.commands import main  # noqa: E402
from kvpatch.rule import load_rules  # noqa: E402
from kvpatch.verify import run_verify  # noqa: E402
from kvpatch.verify.deadstore import changed_functions, compare_function, only_deletions  # noqa: E402
from test_dead_store import DEAD_FILE, REL  # noqa: E402

RULE = next(r for r in load_rules() if r.ID == "KVP104")
LIVE = """
class FooBackend:
    def forward_decode(self, q, layer, forward_batch):
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        if forward_batch.draft:
            kv = forward_batch.other
        return self.kernel(q, kv)
"""


@pytest.mark.parametrize("ex", [e for e in RULE.INVALID if e.expected is not None], ids=lambda e: e.why[:30])
def test_the_rules_deletions_compute_the_same(ex):
    before, after = textwrap.dedent(ex.code), textwrap.dedent(ex.expected)
    changed = changed_functions(before, after)
    assert changed
    for q in changed:
        assert compare_function(before, after, q) is None


def test_deleting_a_cast_one_path_reads_is_caught():
    broken = LIVE.replace("        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n", "")
    assert only_deletions(LIVE, broken)
    why = compare_function(LIVE, broken, "FooBackend.forward_decode")
    assert why is not None and "every condition False" in why and "UnboundLocalError" in why, why


def test_deleting_the_overwrite_too_is_caught():
    before = textwrap.dedent(RULE.INVALID[0].code)
    broken = "".join(ln for ln in before.splitlines(True) if "get_key_buffer" not in ln)
    why = compare_function(before, broken, "AiterAttnBackend.forward_decode")
    assert why is not None, why


def _checkout(tmp_path):
    path = tmp_path / REL
    path.parent.mkdir(parents=True)
    path.write_text(DEAD_FILE)
    r = CliRunner().invoke(main, ["apply", str(tmp_path)])
    assert r.exit_code == 0, r.output
    return path


def test_verify_checks_an_applied_deletion_and_catches_a_sabotaged_one(tmp_path):
    path = _checkout(tmp_path)
    r = run_verify(tmp_path, device="cpu")
    cases = [c for c in r.cases if c.exec == "symbolic"]
    assert r.ok and len(cases) == 2 and all(c.passed for c in cases), r.format()
    path.write_text(path.read_text().replace(
        "        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)\n", ""))
    r = run_verify(tmp_path, device="cpu")
    assert not r.ok and [c.qualname for c in r.failures] == ["FooBackend.forward_decode"], r.format()
