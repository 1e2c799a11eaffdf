"""kvpatch's command line: parse options, call the flow, render, exit.

Exit codes (every command): 0 ok, 1 action needed (hot sites remain, or the
checkout is not / partly patched, or verification failed), 2 error (bad
input, unreadable or unparseable file, refused write), 3 drift (status) or
GPU check not run (verify), 4 interrupted apply (status).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import click

from kvpatch import __version__
from kvpatch.checkout import envfail
from kvpatch.cli.out import CONTEXT, Out, _check_rules, _root, _rules_opt
from kvpatch.cli.out import _settings  # pyproject.toml's [tool.kvpatch] (kvpatch/config.py)
from kvpatch.cli.out import _Main, _Prefetcher, _exit_help, apply_counts
from kvpatch.output.exitcodes import EXIT_ERROR, EXIT_OK, EXIT_PARTIAL, EXIT_USER_INTERRUPT


JOBS_HELP = "Worker processes (default: [tool.kvpatch] jobs in pyproject.toml, else up to 2)."


@click.group(cls=_Main, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="kvpatch")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
              help="Colour output; auto colours only a terminal and honours NO_COLOR.")
@click.option("-q", "--quiet", is_flag=True, help="Only results and errors; no progress or notices.")
@click.option("-v", "--verbose", count=True,
              help="-v: each item's detail, and a crash's traceback; -vv: also diagnostics on stderr (see above).")
@click.pass_context
def main(ctx, color, quiet, verbose):
    """Find, rewrite and verify full-pool FP8 KV-cache casts in an SGLang checkout.

    \b
    kvpatch audit ~/sglang             what is there (nothing is written)
    kvpatch apply --dry-run ~/sglang   the exact diff (nothing is written)
    kvpatch apply ~/sglang             rewrite, on a new git branch, one commit
    kvpatch verify ~/sglang            attention equivalence of the patch (GPU)
    kvpatch revert ~/sglang            back to the original bytes

    \b
    -v   each item's detail: audit, each site's statement (the upgrade audit:
         the unchanged entries and whole reasons); apply, each site and plan
         call rewritten with its rule; revert, each file restored or removed;
         rules, the file a local rule came from; test, each passing example;
         and the traceback of a crash (every command).
    -vv  -v, plus diagnostics on stderr, each line `debug: ...`: the config
         file and the rules loaded, where from and whether selected (audit,
         apply, status, rules, test, config); for audit and apply each
         candidate file scanned (both trees in the upgrade audit) and each
         phase's time (scan, plan+rewrite, write); status's and revert's time.

    Shell completion: eval "$(_KVPATCH_COMPLETE=bash_source kvpatch)" (zsh_source, fish_source).
    """
    ctx.obj = Out(color, quiet, verbose)


# -- audit -------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.argument("new_path", required=False, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="JSON output (schema kvpatch.audit/1, see README).")
@click.option("--sarif", "as_sarif", is_flag=True, help="SARIF 2.1.0 output, for code scanning.")
@click.option("-o", "--output", type=click.Path(dir_okay=False),  # an unwritable path: envfail, one line
              help="Write the JSON/SARIF/table to this file instead of stdout.")
@click.option("--against", metavar="REF", help="Upgrade audit: compare with git REF of the same checkout.")
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=None, help=JOBS_HELP)
@click.option("-q", "--quiet", "quiet", is_flag=True, help="Only results and errors (as `kvpatch -q audit`).")
@click.option("-v", "--verbose", "verbose", count=True,
              help="Each site's statement too; -vv: also the config, rules, files scanned and times "
                   "(as `kvpatch -v audit`).")
@_rules_opt
@click.pass_obj
def audit(out: Out, path, new_path, as_json, as_sarif, output, against, jobs, rules, quiet=False, verbose=0):
    """Report every KV-cache cast and FlashInfer MLA plan() call under PATH.

    Each site gets file:line, Class.method, prefill/decode path, backend, the
    consuming kernel, a status (hot, no-op, patched, unsupported, gathered,
    fixed-upstream) and the reason. Writes nothing.

    With NEW_PATH or --against REF: the upgrade audit (old -> new).

    \b
    Example:  kvpatch audit ~/sglang --sarif -o kvpatch.sarif
    """
    if as_json and as_sarif:
        raise click.UsageError("--json and --sarif exclude each other")
    if quiet:
        out.quiet = True
    out.verbose += verbose
    early = _Prefetcher(path, scan_only=not (new_path or against or as_sarif))  # started before the rules load
    cfg = _settings(path, out, rules=rules, jobs=jobs, before_rules=early)  # options over [tool.kvpatch]
    select, jobs, excluded = cfg.rules.value, cfg.jobs.value, early.excluded
    rule_objs = _check_rules(select, out)
    root = _root(path, out)
    if new_path or against:
        from kvpatch import upgrade

        # The config found from PATH (OLD) and its exclude hold for both trees.
        sys.exit(upgrade.cli_audit(out, root, new_path, against, as_json, as_sarif, output, select, jobs, excluded))
    from kvpatch.output import report
    from kvpatch.engine import scan_tree

    if as_sarif and root.is_dir():  # SARIF carries apply's rewrite as each rewritable site's fix
        from kvpatch.patch import build
        from kvpatch.output.sarif_fixes import fixes_by_site

        t0 = time.perf_counter()
        built = build(root, select, jobs, out.progress(), excluded)
        scan, fixes = built.scan, fixes_by_site(built)
        out.scanned(scan)
        out.times(("scan", scan.seconds), ("plan+rewrite", time.perf_counter() - t0 - scan.seconds))
    else:
        scan, fixes = scan_tree(root, select, jobs, out.progress(), excluded, prefetched=early.helper), {}
        out.scanned(scan)
        out.times(("scan", scan.seconds))
    if as_json:
        text = report.to_json(scan)
    elif as_sarif:
        text = report.to_sarif(scan, rule_objs, fixes)
    else:
        plain = lambda t, **k: t  # noqa: E731 - no colour in files
        width = shutil.get_terminal_size().columns if not output and sys.stdout.isatty() else 0
        text = report.render_table(scan, plain if output else out.style, out.verbose, width)
    if output:
        envfail.write_output(Path(output), text)
    elif text:
        out.echo(text.rstrip("\n"))
    for e in scan.all_errors:
        out.error(f"{e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
    out.info(report.summary_line("audit", scan))
    sys.exit(report.audit_exit_code(scan))


# -- apply -------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.option("-n", "--dry-run", is_flag=True, help="Print the exact diff and counts; write nothing.")
@click.option("--runtime-diff", is_flag=True, help="With --dry-run: also the runtime module's diff (one line by default).")
@click.option("--allow-dirty", is_flag=True, help="Patch a git tree that has uncommitted changes.")
@click.option("--no-commit/--commit", "no_commit", default=None,
              help="Write the files only: no kvpatch/<...> branch, no commit (--commit: override the config's).")
@click.option("--no-verify", is_flag=True, help="Commit without running git's pre-commit and commit-msg hooks.")
@click.option("-i", "--interactive", is_flag=True,
              help="Show each change's hunk and ask: [y]es / [n]o / [a]ll remaining / [q]uit.")
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=None, help=JOBS_HELP)
@_rules_opt
@click.pass_obj
def apply(out: Out, path, dry_run, runtime_diff, allow_dirty, no_commit, no_verify, jobs, rules, interactive=False):
    """Rewrite every fixable site under PATH (all files or none).

    In a git checkout: refuses a dirty tree, then makes a branch
    kvpatch/v<version>-<sha> with one commit listing the sites. Injects the
    runtime module (_kvpatch_runtime.py) next to each patched backend and
    records .kvpatch/state.json. A second apply changes nothing.

    With -i, only the changes you accept are written (paired edits are asked
    as one); the declined ones are recorded, and a later plain apply rewrites them.

    \b
    Example:  kvpatch apply --dry-run ~/sglang | less -R
              kvpatch apply -i ~/sglang
    """
    from kvpatch import patch as P
    from kvpatch.output import report

    cfg = _settings(path, out, rules=rules, jobs=jobs, no_commit=no_commit)  # options over [tool.kvpatch]
    select, jobs, no_commit = cfg.rules.value, cfg.jobs.value, not cfg.commit.value
    _check_rules(select, out)
    root = _root(path, out)
    if root.is_file():
        out.error(f"{path}: apply works on a checkout directory (audit also takes a single file)")
        sys.exit(EXIT_ERROR)
    if interactive:
        from kvpatch.cli import ask as cli_ask
    ask = cli_ask.asker(out, root, dry_run, allow_dirty) if interactive else None
    t0 = time.perf_counter()
    try:
        built = P.build(root, select, jobs, out.progress(), cfg.excluder(root), ask=ask)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        out.error(envfail.line(exc, "apply", f"{exc}"))
        sys.exit(EXIT_ERROR)
    t_built, t_scan = time.perf_counter(), built.scan.seconds
    out.scanned(built.scan)
    errors = built.scan.all_errors + built.refused
    if ask is not None and built.changes and not built.rewrites:  # none accepted: nothing is written
        out.echo(cli_ask.answered(built) + "; nothing written")
        for e in errors:
            out.error(f"{e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
        sys.exit(EXIT_ERROR if errors else EXIT_OK)
    if dry_run:  # the counts first, then the diff; a runtime file is one line unless --runtime-diff
        out.times(("scan", t_scan), ("plan+rewrite", t_built - t0 - t_scan))
        apply_counts(out, built, written=False, answered=_answered(built))
        diff = built.diff(color=out.color_out, runtimes=runtime_diff)
        for line in diff.rstrip("\n").split("\n") if diff else ():
            out.echo(line)  # line by line: a reader that stops early (`| head`) is noticed at once
        if not runtime_diff:
            for rt in built.runtimes:
                what, n_lines = ("added" if rt.old is None else "updated"), len(rt.data.splitlines())
                out.echo(f"{what} {rt.rel} (the runtime module, {n_lines} lines; --runtime-diff shows its diff)")
        for e in errors:
            out.error(f"{e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
        built.scan.seconds = time.perf_counter() - t0
        out.info(report.summary_line("apply --dry-run", built.scan,
                                     f"; {len(built.rewrites)} file(s) and {len(built.runtimes)} runtime "
                                     f"file(s) would be written; nothing written"))
        sys.exit(EXIT_ERROR if errors else EXIT_OK)
    try:
        res = P.apply(root, allow_dirty=allow_dirty, no_commit=no_commit, no_verify=no_verify, patch=built)
    except P.PatchError as exc:
        out.error(str(exc))
        sys.exit(EXIT_ERROR)
    except Exception as exc:  # noqa: BLE001
        out.error(envfail.line(exc, "apply", f"apply failed, nothing was changed: {exc}"))
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        out.error("interrupted: every file was rolled back")
        sys.exit(EXIT_USER_INTERRUPT)
    out.times(("scan", t_scan), ("plan+rewrite", t_built - t0 - t_scan),
              ("write", time.perf_counter() - t_built))
    if res.notice and res.written:  # with nothing written, the line below says it (once)
        out.info(res.notice)
    if not res.written:
        out.echo("nothing to do: every fixable site is already patched")
    else:
        apply_counts(out, built, written=True, answered=_answered(built))
        if res.branch:
            out.echo(f"branch {res.branch}, commit {res.commit[:12]}")
    for e in errors:
        out.error(f"{e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
    built.scan.seconds = time.perf_counter() - t0
    out.info(report.apply_summary_line(built, f"; {len(res.written)} file(s) written"))
    if errors:  # the safe files were written; the named ones were skipped
        sys.exit(EXIT_PARTIAL if res.written else EXIT_ERROR)
    sys.exit(EXIT_OK)


def _answered(built) -> str:
    from kvpatch.cli.ask import answered

    return answered(built) if built.answers is not None else ""


# -- revert / recover ----------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.option("--force", is_flag=True, help="Restore even files edited since apply (edits kept in *.kvpatch-drifted).")
@click.option("--no-commit", is_flag=True, help="Restore the files only; no git commit.")
@click.option("--allow-dirty", is_flag=True, help="Revert in a git tree with other uncommitted changes.")
@click.option("--no-verify", is_flag=True, help="Commit without running git's pre-commit and commit-msg hooks.")
@click.pass_obj
def revert(out: Out, path, force, no_commit, allow_dirty, no_verify):
    """Restore the original bytes of every file kvpatch apply changed.

    Removes the injected runtime and .kvpatch/, and (in git) commits the
    revert. Also rolls back an interrupted apply.

    \b
    Example:  kvpatch revert ~/sglang
    """
    from kvpatch import patch as P
    from kvpatch.revert import revert as revert_tree

    root = _root(path, out)
    t0 = time.perf_counter()
    try:
        res = revert_tree(root, force=force, no_commit=no_commit, allow_dirty=allow_dirty, no_verify=no_verify)
    except (P.PatchError, ValueError) as exc:  # ValueError: an unreadable state record
        out.error(str(exc))
        sys.exit(EXIT_ERROR)
    if res.notice:
        out.info(res.notice)
    for rel in res.kept_edits:
        out.echo(f"{rel}: edited since apply; kvpatch's rewrite taken back, your edits kept")
    if out.verbose:
        for rel in res.restored:
            out.echo(f"  restored {rel}")
        for rel in res.removed:
            out.echo(f"  removed {rel}")
    out.times(("revert", time.perf_counter() - t0))
    out.echo(f"restored {len(res.restored)} file(s), removed {len(res.removed)} runtime file(s)"
             + (f"; commit {res.commit[:12]}" if res.commit else ""))
    out.info(f"kvpatch revert: {len(res.restored)} restored, {len(res.removed)} removed; "
             f"{time.perf_counter() - t0:.2f}s")
    sys.exit(EXIT_OK)


@main.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.option("--dry-run", is_flag=True, help="Show what recovering would do; change nothing.")
@click.pass_obj
def recover(out: Out, path, dry_run):
    """Roll back an apply or revert that was killed half-way.

    It first lists what it will do, and refuses a journal that names a path
    outside PATH or through a symbolic link (a cloned fork may ship one).

    \b
    Example:  kvpatch recover --dry-run ~/sglang
    """
    from kvpatch.checkout import lock
    from kvpatch.checkout import write
    from kvpatch.checkout.gittxn import GitUndoError
    from kvpatch.checkout.safepath import UnsafePath

    root = _root(path, out).resolve()
    try:
        with lock.exclusive(root):
            _recover(out, root, dry_run, write, (UnsafePath, GitUndoError))
    except lock.Busy as exc:
        out.error(str(exc))
        sys.exit(EXIT_ERROR)


def _recover(out: Out, root: Path, dry_run: bool, write, refusals) -> None:
    j = write.pending(root)
    if j is None:
        stale = write.stale_scratch(root)
        if stale:
            if not dry_run:
                write.clear_stale(root)
            out.echo(("would remove" if dry_run else "removed") + " the scratch of a killed write: " + ", ".join(stale))
        out.echo("nothing to recover")
        out.info("kvpatch recover: nothing to do")
        sys.exit(EXIT_OK)
    try:
        steps = write.plan_rollback(root, j)
    except (*refusals, OSError) as exc:
        out.error(f"refusing to recover, nothing was touched: {exc}")
        sys.exit(EXIT_ERROR)
    for s in steps:  # outside the try: a closed output pipe is not a refusal
        out.echo(("would " if dry_run else "") + s)
    if dry_run:
        out.info(f"kvpatch recover --dry-run: {len(steps)} step(s); nothing changed")
        sys.exit(EXIT_OK)
    try:
        envfail.check_rollback(root, j)  # a read-only or immutable target: refused before touching any
        restored = write.rollback(root)
    except (*refusals, OSError, envfail.EnvFailure) as exc:
        out.error(envfail.line(exc, "recover", f"refusing to recover, nothing was touched: {exc}"))
        sys.exit(EXIT_ERROR)
    out.echo(f"rolled back {len(restored)} file(s): " + ", ".join(restored))
    out.info(f"kvpatch recover: rolled back the interrupted `kvpatch {j.get('op', '?')}`")
    sys.exit(EXIT_OK)


# -- status --------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="JSON output (schema kvpatch.status/1).")
@click.pass_obj
def status(out: Out, path, as_json):
    """Say whether PATH is not patched, patched, partly patched or drifted.

    \b
    Example:  kvpatch status ~/sglang
    """
    import json

    from kvpatch import status as S

    excluded = _settings(path, out).excluder(Path(path))  # [tool.kvpatch]'s exclude, as audit and apply
    root = _root(path, out)
    t0 = time.perf_counter()
    try:
        st = S.status(root, excluded=excluded)
    except ValueError as exc:
        out.error(str(exc))
        sys.exit(EXIT_ERROR)
    out.times(("status", time.perf_counter() - t0))
    if as_json:
        out.echo(json.dumps(st.to_dict(), indent=2))
    else:
        out.echo(f"{out.style(st.state, bold=True)}: {st.detail}" if st.detail else st.state)
        for p in st.places:
            out.echo(f"  {p.file}{':' + str(p.line) if p.line else ''}: {p.what}")
        for p in st.errors:
            out.error(f"{p.file}{':' + str(p.line) if p.line else ''}: {p.what}")
    out.info(f"kvpatch status: {st.state}, {len(st.places)} place(s), {len(st.errors)} unreadable file(s); {time.perf_counter() - t0:.2f}s")
    sys.exit(st.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()


from kvpatch.cli.info import config_cmd, rules_cmd, verify  # noqa: E402 - registered after main exists
from kvpatch.cli.testing import test_cmd  # noqa: E402

for _sub in (rules_cmd, verify, test_cmd, config_cmd):
    main.add_command(_sub)
for _cmd in main.commands.values():
    _exit_help(_cmd)
