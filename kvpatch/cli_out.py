"""Shared pieces of kvpatch's command line: output (Out), options, path checks."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import click

from kvpatch.exitcodes import EXIT_ERROR

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


def _root(path: str, out: Out) -> Path:
    from kvpatch.discover import looks_like_sglang

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
              no_commit: Optional[bool] = None):
    """The command's settings: its options over pyproject.toml's [tool.kvpatch]
    (kvpatch/config.py) over the defaults. Loads the config's rules-path for this
    command only; a bad config or rule selection is one error line, exit 2."""
    from kvpatch import config
    from kvpatch.rule import RULES_PATH_ENV, load_rules

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
    try:
        load_rules(cfg.rules.value)
    except KeyError as exc:  # an unknown rule: say whether the option or the config named it
        out.error(exc.args[0] if cfg.rules.source == "--rules" else f"{cfg.rules.source}: {exc.args[0]}")
        sys.exit(EXIT_ERROR)
    return cfg
