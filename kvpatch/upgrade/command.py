"""`kvpatch audit OLD NEW` / `--against REF`: the command's body."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional
from kvpatch.checkout import envfail
from kvpatch.upgrade.flow import run_upgrade, upgrade_against
from kvpatch.upgrade.model import EXIT_ERROR, UpgradeError
from kvpatch.upgrade.render import render, summary_line, to_sarif

# -- the command -------------------------------------------------------------------------
def _check_tree(path: str, what: str) -> Path:
    from kvpatch.analysis.discover import looks_like_sglang

    p = Path(path)
    if not p.exists():
        raise UpgradeError(f"{path}: no such file or directory")
    if not p.is_dir():
        raise UpgradeError(f"{path}: the upgrade audit compares checkout directories ({what} is not a directory)")
    why = looks_like_sglang(p)
    if why:
        raise UpgradeError(f"{path}: {why}")
    return p


def cli_audit(out, root: Path, new_path: Optional[str], against: Optional[str], as_json: bool, as_sarif: bool,
              output: Optional[str], select, jobs, excluded=None) -> int:
    """`kvpatch audit OLD NEW` / `kvpatch audit PATH --against REF`; returns the exit code.
    `excluded`: the config's exclude (found from PATH, or OLD), applied to both trees."""
    try:
        if new_path and against:
            raise UpgradeError("give either NEW_PATH or --against REF, not both")
        if against:
            if not root.is_dir():
                raise UpgradeError(f"{root}: --against compares a checkout directory with a git revision")
            up = upgrade_against(root, against, select, jobs, out.progress(), excluded)
        else:
            old = _check_tree(str(root), "OLD")
            new = _check_tree(new_path, "NEW")
            up = run_upgrade(old, new, select, jobs, out.progress(), excluded=excluded)
    except UpgradeError as exc:
        out.error(str(exc))
        return EXIT_ERROR
    except KeyError as exc:  # an unknown rule, from load_rules
        out.error(exc.args[0] if exc.args else str(exc))
        return EXIT_ERROR
    except OSError as exc:
        out.error(f"upgrade audit failed: {exc}")
        return EXIT_ERROR
    if out.verbose >= 2:  # -vv: each tree's candidate files, and the phases' times
        out.scanned(up.old.scan)
        out.scanned(up.new.scan)
        out.times(("old-tree scan", up.old.scan.seconds), ("new-tree scan", up.new.scan.seconds),
                  ("plan+rewrite+compare", up.seconds - up.old.scan.seconds - up.new.scan.seconds))
    if as_json:
        text = json.dumps(up.to_dict(), indent=2) + "\n"
    elif as_sarif:
        text = to_sarif(up)
    else:
        plain = lambda t, **k: t  # noqa: E731 - no colour in files
        text = render(up, plain if output else out.style, out.verbose)
    if output:
        envfail.write_output(Path(output), text)
    elif text:
        out.echo(text.rstrip("\n"))
    for t, e in up.errors:
        out.error(f"({t} tree) {e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
    out.info(summary_line(up))
    return up.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `kvpatch audit OLD NEW` or `kvpatch audit PATH --against REF`")
