"""config: kvpatch's settings from the ``[tool.kvpatch]`` table of pyproject.toml.

Found as Fixit and ruff find theirs: walking up from the target PATH, the first
pyproject.toml that has a ``[tool.kvpatch]`` table is the config (one without the
table is skipped); the walk stops at the filesystem root. Command-line options
override it, and it overrides the built-in defaults. Every value keeps where it
came from, which `kvpatch config PATH` prints.

    [tool.kvpatch]
    rules = ["KVP101", "KVP102"]     # as --rules (IDs or names; a "A,B" string too)
    exclude = ["python/sglang/srt/layers/attention/experimental"]
    rules-path = ["tools/kvpatch_rules"]
    jobs = 4                         # as -j of audit and apply

    [tool.kvpatch.apply]
    commit = false                   # as apply --no-commit
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, List, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the tomli backport (a dependency there)
    import tomli as tomllib

from kvpatch.names import RULES_PATH_ENV

PYPROJECT = "pyproject.toml"
TABLE = "tool.kvpatch"
DEFAULT = "default"
JOBS_MAX = 64  # audit's and apply's -j range
KEYS = ("rules", "exclude", "rules-path", "jobs", "apply")
APPLY_KEYS = ("commit",)


class ConfigError(Exception):
    """A config kvpatch cannot use: one line naming the file and the key."""


@dataclass
class Setting:
    """One effective value and where it came from: ``FILE: tool.kvpatch.KEY``,
    ``$VAR``, ``--option`` or ``default``."""

    value: Any
    source: str = DEFAULT


@dataclass
class Config:
    file: Optional[Path] = None  # the pyproject.toml read; None when no file has the table
    rules: Setting = field(default_factory=lambda: Setting(None))  # rule IDs/names; None: all
    exclude: Setting = field(default_factory=lambda: Setting([]))  # patterns, relative to file's folder
    rules_path: List[Setting] = field(default_factory=list)  # one absolute folder each
    jobs: Setting = field(default_factory=lambda: Setting(None))  # None: the engine's own choice
    commit: Setting = field(default_factory=lambda: Setting(True))  # apply: branch + commit in git

    def excluder(self, root: Path) -> Optional[Callable[[str], bool]]:
        """A test on paths relative to `root` (posix): True for an excluded one.
        None when nothing is excluded, or root is a single file (a file named on
        the command line is scanned, as ruff scans one)."""
        if not self.exclude.value or self.file is None or root.is_file():
            return None
        try:
            prefix = root.resolve().relative_to(self.file.parent.resolve()).as_posix()
        except ValueError:  # root outside the config's folder: nothing of it is named
            return None
        prefix = "" if prefix == "." else prefix + "/"
        patterns = list(self.exclude.value)

        def excluded(rel: str) -> bool:
            parts = (prefix + rel).split("/")
            # The path itself or any folder above it: a folder excludes what it holds.
            return any(fnmatch.fnmatchcase("/".join(parts[:i]), pat)
                       for i in range(1, len(parts) + 1) for pat in patterns)

        return excluded

    def rules_path_env(self) -> str:
        """$KVPATCH_RULES_PATH's value that loads every folder (env first, then config's)."""
        return os.pathsep.join(str(s.value) for s in self.rules_path)


def find(start: Path) -> Tuple[Optional[Path], Dict[str, Any]]:
    """The first pyproject.toml with a [tool.kvpatch] table at or above `start`,
    and that table; (None, {}) when there is none up to the filesystem root."""
    here = start.resolve()
    while not here.exists() and here != here.parent:  # a missing PATH: its nearest folder
        here = here.parent
    folder = here if here.is_dir() else here.parent
    for d in (folder, *folder.parents):
        f = d / PYPROJECT
        if not f.is_file():
            continue
        try:
            doc = tomllib.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{f}: cannot read: {getattr(exc, 'strerror', None) or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{f}: not valid TOML: {exc}") from exc
        tool = doc.get("tool")
        if isinstance(tool, dict) and "kvpatch" in tool:
            table = tool["kvpatch"]
            if not isinstance(table, dict):
                raise ConfigError(f"{f}: {TABLE}: expected a table, got {_kind(table)}")
            return f, table
    return None, {}


def load(start: Path, *, rules: Optional[List[str]] = None, jobs: Optional[int] = None,
         commit: Optional[bool] = None, env: Optional[Dict[str, str]] = None) -> Config:
    """The effective settings for a command on `start`: its command-line values
    (None: not given) over the config file over the defaults."""
    env = os.environ if env is None else env
    file, table = find(start)
    cfg = Config(file)
    if file is not None:
        _read(cfg, file, table)
    seen = set()
    env_folders = [Setting(Path(p).resolve(), f"${RULES_PATH_ENV}")
                   for p in filter(None, env.get(RULES_PATH_ENV, "").split(os.pathsep))]
    cfg.rules_path = [s for s in env_folders + cfg.rules_path
                      if not (str(s.value) in seen or seen.add(str(s.value)))]
    if rules:
        cfg.rules = Setting(list(rules), "--rules")
    if jobs is not None:
        cfg.jobs = Setting(jobs, "--jobs")
    if commit is not None:
        cfg.commit = Setting(commit, "--commit" if commit else "--no-commit")
    return cfg


def _read(cfg: Config, file: Path, table: Dict[str, Any]) -> None:
    def where(key: str) -> str:
        return f"{file}: {TABLE}.{key}"

    _known(table, KEYS, file, TABLE)
    if "rules" in table:
        value = table["rules"]
        if isinstance(value, str):
            value = value.split(",")
        cfg.rules = Setting(_strings(value, file, "rules", "a list of rule IDs or names") or None, where("rules"))
    if "exclude" in table:
        cfg.exclude = Setting([_relative(p, file, "exclude") for p in
                               _strings(table["exclude"], file, "exclude", "a list of paths or globs")],
                              where("exclude"))
    if "rules-path" in table:
        value = table["rules-path"]
        for folder in _strings([value] if isinstance(value, str) else value, file, "rules-path",
                               "a list of folders"):
            path = (file.parent / folder).resolve()
            if not path.is_dir():
                raise ConfigError(f"{where('rules-path')}: {folder!r} is not a folder (relative to {file.parent})")
            cfg.rules_path.append(Setting(path, where("rules-path")))
    if "jobs" in table:
        value = table["jobs"]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= JOBS_MAX:
            raise ConfigError(f"{where('jobs')}: expected an integer from 1 to {JOBS_MAX}, got {value!r}")
        cfg.jobs = Setting(value, where("jobs"))
    if "apply" in table:
        sub = table["apply"]
        if not isinstance(sub, dict):
            raise ConfigError(f"{where('apply')}: expected a table ([{TABLE}.apply]), got {_kind(sub)}")
        _known(sub, APPLY_KEYS, file, f"{TABLE}.apply")
        if "commit" in sub:
            if not isinstance(sub["commit"], bool):
                raise ConfigError(f"{where('apply.commit')}: expected true or false, got {sub['commit']!r}")
            cfg.commit = Setting(sub["commit"], where("apply.commit"))


def _known(table: Dict[str, Any], keys, file: Path, name: str) -> None:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise ConfigError(f"{file}: {name}.{unknown[0]}: unknown key (known: {', '.join(keys)})")


def _strings(value: Any, file: Path, key: str, what: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{file}: {TABLE}.{key}: expected {what} (strings), got {_kind(value)}")
    return [v.strip() for v in value if v.strip()]


def _relative(pattern: str, file: Path, key: str) -> str:
    p = PurePosixPath(pattern.replace(os.sep, "/"))
    if p.is_absolute() or ".." in p.parts:
        raise ConfigError(f"{file}: {TABLE}.{key}: {pattern!r} must be relative to {file.parent}, "
                          f"inside it")
    return p.as_posix()


def _kind(value: Any) -> str:
    if isinstance(value, list):
        bad = next((v for v in value if not isinstance(v, str)), None)
        return f"a list holding {bad!r}" if bad is not None else "a list"
    return f"{type(value).__name__} {value!r}"


def rows(cfg: Config) -> List[Tuple[str, str, str]]:
    """(setting, value, source) for each effective setting: `kvpatch config`'s table."""
    out = [("config", str(cfg.file) if cfg.file else "(none: no pyproject.toml with [tool.kvpatch] above PATH)",
            "found walking up from PATH")]
    out.append(("rules", ",".join(cfg.rules.value) if cfg.rules.value else "all", cfg.rules.source))
    out.append(("exclude", ", ".join(cfg.exclude.value) or "(nothing)", cfg.exclude.source))
    for s in cfg.rules_path or [Setting("(none)")]:
        out.append(("rules-path", str(s.value), s.source))
    out.append(("jobs", str(cfg.jobs.value) if cfg.jobs.value else "auto (up to 2; 1 under 200 files)",
                cfg.jobs.source))
    out.append(("apply.commit", "true" if cfg.commit.value else "false (as --no-commit)", cfg.commit.source))
    return out
