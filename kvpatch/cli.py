"""kvpatch's command line: parse options, call the flow, render, exit.

Exit codes (every command): 0 ok, 1 action needed (hot sites remain, or the
checkout is not / partly patched, or verification failed), 2 error (bad
input, unreadable or unparseable file, refused write), 3 drift (status) or
GPU check not run (verify), 4 interrupted apply (status).
"""

from __future__ import annotations

import os
import shutil
import traceback
import sys
import time
from pathlib import Path

import click

from kvpatch import __version__
from kvpatch.cli_out import CONTEXT, Out, _check_rules, _root, _rules_opt
from kvpatch.cli_out import _settings  # pyproject.toml's [tool.kvpatch] (kvpatch/config.py)
from kvpatch.exitcodes import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_OK, EXIT_PARTIAL, EXIT_USER_INTERRUPT, WHAT


class _Main(click.Group):
    """The command group: an unexpected exception is a one-line error with exit 2
    (CI must not read a crash as a finding, exit 1); -v shows the traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, SystemExit):
            raise
        except BrokenPipeError:  # `kvpatch ... | head`: the reader is gone; say nothing more
            # Point stdout at /dev/null so the interpreter's flush at exit cannot raise again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_BROKEN_PIPE)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM raised as one by the writer
            click.echo("Error: interrupted", err=True)
            ctx.exit(EXIT_USER_INTERRUPT)
        except Exception as exc:  # noqa: BLE001 - the one place a crash becomes an exit code
            verbose = getattr(ctx.obj, "verbose", 0)
            if verbose:
                click.echo(traceback.format_exc(), err=True, nl=False)
            where = f" in `kvpatch {ctx.invoked_subcommand}`" if ctx.invoked_subcommand else ""
            click.echo(f"Error: kvpatch crashed{where}: {type(exc).__name__}: {exc}"
                       + ("" if verbose else " (run with -v for the traceback)"), err=True)
            ctx.exit(EXIT_ERROR)


def _exit_help(cmd: click.Command) -> None:
    """Append the command's exit codes, from exitcodes.WHAT, to its --help."""
    codes = WHAT.get(cmd.name)
    if codes:
        # Indented like the docstrings, so click's dedent keeps both aligned.
        lines = "\n".join(f"      {code:<3} {what}" for code, what in sorted(codes.items()))
        cmd.help = (cmd.help or "").rstrip() + "\n\n    \b\n    Exit codes:\n" + lines


@click.group(cls=_Main, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="kvpatch")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
              help="Colour output; auto colours only a terminal and honours NO_COLOR.")
@click.option("-q", "--quiet", is_flag=True, help="Only results and errors; no progress or notices.")
@click.option("-v", "--verbose", count=True, help="More detail (repeatable).")
@click.pass_context
def main(ctx, color, quiet, verbose):
    """Find, rewrite and verify full-pool FP8 KV-cache casts in an SGLang checkout.

    \b
    kvpatch audit ~/sglang             what is there (nothing is written)
    kvpatch apply --dry-run ~/sglang   the exact diff (nothing is written)
    kvpatch apply ~/sglang             rewrite, on a new git branch, one commit
    kvpatch verify ~/sglang            attention equivalence of the patch (GPU)
    kvpatch revert ~/sglang            back to the original bytes

    Shell completion: eval "$(_KVPATCH_COMPLETE=bash_source kvpatch)" (zsh_source, fish_source).
    """
    ctx.obj = Out(color, quiet, verbose)


# -- audit -------------------------------------------------------------------
@main.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.argument("new_path", required=False, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="JSON output (schema kvpatch.audit/1, see README).")
@click.option("--sarif", "as_sarif", is_flag=True, help="SARIF 2.1.0 output, for code scanning.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write the JSON/SARIF/table to this file instead of stdout.")
@click.option("--against", metavar="REF", help="Upgrade audit: compare with git REF of the same checkout.")
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=None, help="Worker processes (default: 2).")
@click.option("-q", "--quiet", "quiet", is_flag=True, help="Only results and errors (as `kvpatch -q audit`).")
@click.option("-v", "--verbose", "verbose", count=True, help="Each site's statement too (as `kvpatch -v audit`).")
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
    cfg = _settings(path, out, rules=rules, jobs=jobs)  # options over pyproject.toml's [tool.kvpatch]
    select, jobs, excluded = cfg.rules.value, cfg.jobs.value, cfg.excluder(Path(path))
    rule_objs = _check_rules(select, out)
    root = _root(path, out)
    if new_path or against:
        from kvpatch import upgrade

        sys.exit(upgrade.cli_audit(out, root, new_path, against, as_json, as_sarif, output, select, jobs))
    from kvpatch import report
    from kvpatch.engine import scan_tree

    if as_sarif and root.is_dir():  # SARIF carries apply's rewrite as each rewritable site's fix
        from kvpatch.patch import build
        from kvpatch.sarif_fixes import fixes_by_site

        built = build(root, select, jobs, out.progress(), excluded)
        scan, fixes = built.scan, fixes_by_site(built)
    else:
        scan, fixes = scan_tree(root, select, jobs, out.progress(), excluded), {}
    if as_json:
        text = report.to_json(scan)
    elif as_sarif:
        text = report.to_sarif(scan, rule_objs, fixes)
    else:
        plain = lambda t, **k: t  # noqa: E731 - no colour in files
        width = shutil.get_terminal_size().columns if not output and sys.stdout.isatty() else 0
        text = report.render_table(scan, plain if output else out.style, out.verbose, width)
    if output:
        Path(output).write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
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
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=None, help="Worker processes (default: 2).")
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
    from kvpatch import report

    cfg = _settings(path, out, rules=rules, jobs=jobs, no_commit=no_commit)  # options over [tool.kvpatch]
    select, jobs, no_commit = cfg.rules.value, cfg.jobs.value, not cfg.commit.value
    _check_rules(select, out)
    root = _root(path, out)
    if root.is_file():
        out.error(f"{path}: apply works on a checkout directory (audit also takes a single file)")
        sys.exit(EXIT_ERROR)
    if interactive:
        from kvpatch import cli_ask
    ask = cli_ask.asker(out, root, dry_run, allow_dirty) if interactive else None
    t0 = time.perf_counter()
    try:
        built = P.build(root, select, jobs, out.progress(), cfg.excluder(root), ask=ask)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        out.error(f"{exc}")
        sys.exit(EXIT_ERROR)
    errors = built.scan.all_errors + built.refused
    if ask is not None and built.changes and not built.rewrites:  # none accepted: nothing is written
        out.echo(cli_ask.answered(built) + "; nothing written")
        for e in errors:
            out.error(f"{e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
        sys.exit(EXIT_ERROR if errors else EXIT_OK)
    if dry_run:  # the counts first, then the diff; a runtime file is one line unless --runtime-diff
        _apply_counts(out, built, written=False)
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
        out.error(f"apply failed, nothing was changed: {exc}")
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        out.error("interrupted: every file was rolled back")
        sys.exit(EXIT_USER_INTERRUPT)
    if res.notice and res.written:  # with nothing written, the line below says it (once)
        out.info(res.notice)
    if not res.written:
        out.echo("nothing to do: every fixable site is already patched")
    else:
        _apply_counts(out, built, written=True)
        if res.branch:
            out.echo(f"branch {res.branch}, commit {res.commit[:12]}")
    for e in errors:
        out.error(f"{e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
    built.scan.seconds = time.perf_counter() - t0
    out.info(report.summary_line("apply", built.scan, f"; {len(res.written)} file(s) written"))
    if errors:  # the safe files were written; the named ones were skipped
        sys.exit(EXIT_PARTIAL if res.written else EXIT_ERROR)
    sys.exit(EXIT_OK)


def _apply_counts(out: Out, built, written: bool) -> None:
    verb = "rewritten" if written else "would be rewritten"
    if built.answers is not None:
        from kvpatch.cli_ask import answered

        out.echo(answered(built))
    out.echo(f"files changed: {len(built.rewrites)}; sites {verb}: {built.sites_rewritten}; "
             f"plan calls retargeted: {built.plans_rewritten}; runtime files: {len(built.runtimes)}")
    skipped = built.skipped()
    if skipped:
        out.echo(f"sites skipped: {len(skipped)}")
        for s in skipped:
            out.echo(f"  {s.file}:{s.line} {s.qualname} [{s.status}]: {s.reason}")
    for e in built.refused:
        out.echo(f"  refused {e.file}: {e.message}")


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
    from kvpatch import lock, write
    from kvpatch.gittxn import GitUndoError
    from kvpatch.safepath import UnsafePath

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
        restored = write.rollback(root)
    except (*refusals, OSError) as exc:
        out.error(f"refusing to recover, nothing was touched: {exc}")
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


from kvpatch.cli_info import config_cmd, rules_cmd, verify  # noqa: E402 - registered after main exists
from kvpatch.cli_test import test_cmd  # noqa: E402

for _sub in (rules_cmd, verify, test_cmd, config_cmd):
    main.add_command(_sub)
for _cmd in main.commands.values():
    _exit_help(_cmd)
