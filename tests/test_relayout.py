"""tools/relayout.py: rewrites flat-layout kvpatch imports to the stage folders (issue 19)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("relayout", REPO / "tools" / "relayout.py")
relayout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(relayout)


def test_every_move_lands_on_a_module_and_leaves_nothing_behind():
    for old, new in relayout.MOVES.items():
        assert (REPO / "kvpatch" / (new.replace(".", "/") + ".py")).is_file(), new
        assert not (REPO / "kvpatch" / f"{old}.py").exists(), old


def test_old_imports_become_new_and_twice_is_once():
    old = ("from kvpatch import RULESET_VERSION, checkout, write\n"
           "from kvpatch.codegen import parse_expr\n"
           "from kvpatch.rewrite import RewriteError\n"
           "from kvpatch.rule import Rule\n"
           "def f(root):\n"
           "    info = checkout.git_info(root)  # see kvpatch/guarded.py\n"
           '    mp.setattr("kvpatch.write.os.replace", None)\n'
           '    return "kvpatch.state/1", info\n')
    new = relayout.relayout(old)
    assert new == ("from kvpatch import RULESET_VERSION\n"
                   "from kvpatch.checkout import repo\n"
                   "from kvpatch.checkout import write\n"
                   "from kvpatch.rewrite.codegen import parse_expr\n"
                   "from kvpatch.rewrite.transform import RewriteError\n"
                   "from kvpatch.rule import Rule\n"
                   "def f(root):\n"
                   "    info = repo.git_info(root)  # see kvpatch/checkout/guarded.py\n"
                   '    mp.setattr("kvpatch.checkout.write.os.replace", None)\n'
                   '    return "kvpatch.state/1", info\n')
    assert relayout.relayout(new) == new
