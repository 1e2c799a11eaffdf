"""Shared pieces of kvpatch's command line: the group class, output (Out), options,
path checks, apply's counts."""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import click

from kvpatch.checkout import envfail
from kvpatch.output.exitcodes import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_USER_INTERRUPT, WHAT

CLEAR_LINE = "\r\x1b[K"  # carriage return, erase to the end of the line
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Out:
    """Where output goes, and whether it is coloured."""

    def __init__(self, color: str, quiet: bool, verbose: int) -> None:
        self.quiet, self.verbose = quiet, verbose
        if color == "always":
            self.color_out = self.color_err = True
        elif color == "never" or os.environ.get("NO_COLOR"):
            self.color_out = self.color_err = False
        else:
            self.color_out = sys.stdout.isatty()
            self.color_err = sys.stderr.isatty()

    def style(self, text: str, **kw) -> str:
        if not self.color_out:
            return text
        # Line by line: a colour never stays open across a newline (`--color always | head`).
        return "\n".join(click.style(ln, **kw) if ln else ln for ln in text.split("\n"))

    def echo(self, text: str = "", nl: bool = True) -> None:
        click.echo(text, nl=nl, color=self.color_out)

    def info(self, text: str) -> None:
        """Progress and notices: stderr, silenced by -q."""
        if not self.quiet:
            click.echo(text, err=True, color=self.color_err)

    def error(self, text: str) -> None:
        click.echo(click.style("error: ", fg="red", bold=True) + text if self.color_err else "error: " + text,
                   err=True, color=self.color_err)

    def debug(self, text: str) -> None:
        """-vv's diagnostics (config, rules loaded, files scanned, phase times): stderr,
        each line starting `debug: `; silenced by -q."""
        if self.verbose >= 2 and not self.quiet:
            click.echo(f"debug: {text}", err=True, color=self.color_err)

    def scanned(self, scan) -> None:
        """-vv: each candidate file the scan read, with what it found there."""
        if self.verbose < 2:
            return
        self.debug(f"scan of {scan.root}: {scan.files_scanned} file(s) scanned, {scan.candidates} candidate(s)")
        for f in scan.files:
            self.debug(f"  {f.rel}: {len(f.sites)} site(s), {len(f.plans)} plan call(s)")

    def times(self, *phases) -> None:
        """-vv: each phase's time, given as (name, seconds) in order."""
        self.debug("time: " + ", ".join(f"{name} {sec:.2f}s" for name, sec in phases))

    def progress(self):
        if self.quiet or not sys.stderr.isatty():
            return None
        last = [0.0]

        def cb(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] > 0.1 or done == total:
                last[0] = now
                # The last call clears the line: the progress does not stay on screen.
                sys.stderr.write(CLEAR_LINE if done == total else f"\rscanning {done}/{total} files")
                sys.stderr.flush()

        return cb


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
            env = envfail.describe(exc, ctx.invoked_subcommand)  # the machine's fault, not a crash (issue 18)
            if env is not None:
                if verbose:
                    click.echo(traceback.format_exc(), err=True, nl=False)
                click.echo(f"error: {env}", err=True)
                ctx.exit(EXIT_ERROR)
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


def _root(path: str, out: Out) -> Path:
    from kvpatch.analysis.discover import looks_like_sglang

    p = Path(path)
    if not p.exists():
        out.error(f"{path}: no such file or directory")
        sys.exit(EXIT_ERROR)
    if p.is_file() and p.suffix != ".py":
        out.error(f"{path}: not a directory or a .py file")
        sys.exit(EXIT_ERROR)
    why = looks_like_sglang(p)
    if why:
        out.error(f"{path}: {why}")
        sys.exit(EXIT_ERROR)
    return p


def _rules_opt(f):
    return click.option("--rules", "rules", metavar="IDS", default=None,
                        help="Comma-separated rule IDs or names to run (default: all; see `kvpatch rules`).")(f)


def _split(rules: Optional[str]):
    return [r for r in rules.split(",") if r.strip()] if rules else None


def _check_rules(rules, out: Out):
    from kvpatch.rule import load_rules

    try:
        return load_rules(rules)
    except KeyError as exc:
        out.error(exc.args[0])
        sys.exit(EXIT_ERROR)


def _settings(path: str, out: Out, *, rules: Optional[str] = None, jobs: Optional[int] = None,
              no_commit: Optional[bool] = None, before_rules: Optional[Callable[[object], None]] = None):
    """The command's settings: its options over pyproject.toml's [tool.kvpatch]
    (kvpatch/config.py) over the defaults. Loads the config's rules-path for this
    command only; a bad config or rule selection is one error line, exit 2.
    `before_rules(cfg)` runs once the config is read, before the rules (and libcst)
    load: audit starts its prefetch helper there (kvpatch/analysis/prefetch.py)."""
    from kvpatch import config
    from kvpatch.names import RULES_PATH_ENV

    try:
        cfg = config.load(Path(path), rules=_split(rules), jobs=jobs,
                          commit=None if no_commit is None else not no_commit)
    except config.ConfigError as exc:
        out.error(str(exc))
        sys.exit(EXIT_ERROR)
    if cfg.rules_path:
        before = os.environ.get(RULES_PATH_ENV)
        os.environ[RULES_PATH_ENV] = cfg.rules_path_env()

        def restore() -> None:
            if before is None:
                os.environ.pop(RULES_PATH_ENV, None)
            else:
                os.environ[RULES_PATH_ENV] = before

        click.get_current_context().call_on_close(restore)
    if before_rules is not None:
        before_rules(cfg)
    from kvpatch.rule import load_rules

    try:
        loaded = load_rules(cfg.rules.value)
    except KeyError as exc:  # an unknown rule: say whether the option or the config named it
        out.error(exc.args[0] if cfg.rules.source == "--rules" else f"{cfg.rules.source}: {exc.args[0]}")
        sys.exit(EXIT_ERROR)
    if out.verbose >= 2:
        _debug_settings(out, cfg, loaded)
    return cfg


class _Prefetcher:
    """_settings' `before_rules` for audit: the exclude test, and the helper that lists
    and byte-filters the tree while the rules load (~0.2 s of imports; see
    kvpatch/analysis/prefetch.py). Only for a plain scan (`scan_only`), and only where
    more than one process may work (-j 1 asks for one)."""

    def __init__(self, path: str, scan_only: bool) -> None:
        self.path, self.scan_only = Path(path), scan_only
        self.excluded, self.helper = None, None

    def __call__(self, cfg) -> None:
        from kvpatch.analysis import workers

        self.excluded = cfg.excluder(self.path)
        if self.scan_only and workers.effective_jobs(cfg.jobs.value) > 1:
            from kvpatch.analysis import prefetch

            self.helper = prefetch.start(self.path, self.excluded)
            if self.helper is not None:  # unread (an error exit): killed with the command
                click.get_current_context().call_on_close(self.helper.close)


def _debug_settings(out: Out, cfg, loaded) -> None:
    """-vv: the config file used and the rules loaded, each with where it came from."""
    out.debug(f"config: {cfg.file}" if cfg.file else
              "config: none (no pyproject.toml with [tool.kvpatch] walking up from PATH)")
    for r in loaded:
        where = rule_source(r)
        sel = "" if r.enabled else f"; not selected by {cfg.rules.source}"
        out.debug(f"rule {r.ID} ({r.NAME}): {'built-in' if where is None else where}{sel}")


def rule_source(rule) -> Optional[str]:
    """The file a local rule (rules-path, $KVPATCH_RULES_PATH) was loaded from; None: built-in."""
    from kvpatch.rule import BUILTIN_RULES

    mod = type(rule).__module__
    if mod.startswith(BUILTIN_RULES + "."):
        return None
    return getattr(sys.modules.get(mod), "__file__", None) or mod


def apply_counts(out: Out, built, written: bool, answered: str = "") -> None:
    """apply's (and --dry-run's) counts, the sites it leaves, and with -v each site
    and plan call it rewrites; `answered`: apply -i's answers (kvpatch/cli/ask.py)."""
    verb = "rewritten" if written else "would be rewritten"
    if answered:
        out.echo(answered)
    out.echo(f"files changed: {len(built.rewrites)}; sites {verb}: {built.sites_rewritten}; "
             f"plan calls retargeted: {built.plans_rewritten}; runtime files: {len(built.runtimes)}")
    if out.verbose:
        for r in built.rewrites:
            for s in r.sites:
                out.echo(f"  {verb} {s.file}:{s.line} {s.qualname} [{s.rule}, {s.path}, {s.backend}]: "
                         f"{s.buffer}.to({s.dtype}) -> {s.kernel}")
            for p in r.plans:
                out.echo(f"  {verb} {p.file}:{p.line} {p.qualname} [{p.rule}]: plan kv dtype {p.kv_dtype}")
    skipped = built.skipped()
    if skipped:
        out.echo(f"sites skipped: {len(skipped)}")
        for s in skipped:
            out.echo(f"  {s.file}:{s.line} {s.qualname} [{s.status}]: {s.reason}")
    for e in built.refused:
        out.echo(f"  refused {e.file}: {e.message}")
