"""The plugin property: a new rule family is one file in a rules folder, with
no edit under kvpatch/. A rule written here into a scratch folder (emitting a
runtime call no shipped rule knows) is loaded, finds its site, rewrites it,
re-audits it as patched and is listed by `kvpatch rules`."""

from __future__ import annotations

import json
import textwrap

from click.testing import CliRunner

from kvpatch.cli.commands import main
from kvpatch.rule import RULES_PATH_ENV

RULE = '''
import libcst as cst

from kvpatch.rewrite.codegen import RUNTIME_ALIAS
from kvpatch.rule import Decision, Invalid, NeedRuntime, Patched, ReplaceNode, Rule, Valid
from kvpatch.sites import HOT


class ScratchKernelCast(Rule):
    ID = "KVP901"
    NAME = "scratch-kernel-cast"
    SUMMARY = "Gather before scratch_kernel reads the pool"
    KIND = "cast"
    PRIORITY = 20
    CHECKED_ON = ("2026-08-06",)
    EMITS = ("kv_for_scratch_kernel",)
    VALID = (Valid("def f(self, q, layer, fb):\\n    return scratch_kernel(q, q)\\n"),)
    INVALID = (Invalid("def f(self, q, layer, fb):\\n"
                       "    k = fb.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\\n"
                       "    return scratch_kernel(q, k)\\n"),)

    def patched(self, call, ctx):
        f = call.func
        if isinstance(f, cst.Attribute) and f.attr.value == self.EMITS[0] and len(call.args) == 2:
            return Patched(call, call.args[0].value, call.args[1].value, "scratch gather in place")
        return None

    def decide(self, cand, ctx):
        if not any(c.call is not None and isinstance(c.call.func, cst.Name)
                   and c.call.func.value == "scratch_kernel" for c in cand.consumers):
            return None
        if cand.form.kind != "to" or cand.form.dtype is None:
            return None

        def build(updated):
            return cst.Call(func=cst.Attribute(cst.Name(RUNTIME_ALIAS), cst.Name(self.EMITS[0])),
                            args=[cst.Arg(updated.func.value), cst.Arg(cand.form.dtype)])

        return Decision(HOT, "full-pool cast read by scratch_kernel",
                        [ReplaceNode(ctx.unit.qualname, cand.call, build), NeedRuntime()])
'''

BACKEND = textwrap.dedent("""\
    class ScratchBackend:
        def forward_decode(self, q, layer, forward_batch):
            # the pool cast scratch_kernel reads
            k = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
            return scratch_kernel(q, k)
""")
REL = "python/sglang/srt/layers/attention/scratch_backend.py"


def _audit(root, env):
    r = CliRunner().invoke(main, ["audit", "--json", str(root)], env=env)
    doc = json.loads(r.stdout)
    return [s for s in doc["sites"] if s["file"] == REL]


def test_a_rule_in_a_scratch_folder_is_loaded_found_applied_and_listed(example_git, tmp_path):
    folder = tmp_path / "rules"
    folder.mkdir()
    (folder / "scratch_kernel_cast.py").write_text(RULE)
    (example_git / REL).write_text(BACKEND)
    from conftest import git
    git(example_git, "add", "-A")
    git(example_git, "commit", "-qm", "scratch backend")
    env = {RULES_PATH_ENV: str(folder)}

    # Without the folder the site is the fallback's; with it, the new rule's.
    assert [s["rule"] for s in _audit(example_git, {})] == ["KVP201"]
    found = _audit(example_git, env)
    assert [(s["rule"], s["status"], s["fixable"]) for s in found] == [("KVP901", "hot", True)]

    listed = CliRunner().invoke(main, ["rules"], env=env)
    assert listed.exit_code == 0 and "KVP901" in listed.output and "scratch-kernel-cast" in listed.output

    r = CliRunner().invoke(main, ["apply", str(example_git)], env=env)
    assert r.exit_code == 0, r.output
    text = (example_git / REL).read_text()
    assert "_kvpatch_rt.kv_for_scratch_kernel(forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id), " \
           "q.dtype)" in text
    assert "# the pool cast scratch_kernel reads" in text
    assert [(s["rule"], s["status"]) for s in _audit(example_git, env)] == [("KVP901", "patched")]
    again = CliRunner().invoke(main, ["apply", str(example_git)], env=env)
    assert (example_git / REL).read_text() == text, again.output
