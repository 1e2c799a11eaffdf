"""`kvpatch test [RULE...]`: run rules' own VALID / INVALID examples from the
command line, as `fixit test` and `ast-grep test` do (kvpatch/ruletest.py)."""

from __future__ import annotations

import os
import sys

import click

from kvpatch.cli.out import CONTEXT
from kvpatch.output.exitcodes import EXIT_ACTION, EXIT_ERROR, EXIT_OK
from kvpatch.names import RULES_PATH_ENV


@click.command(name="test", context_settings=CONTEXT)
@click.argument("rule_ids", nargs=-1, metavar="[RULE]...")
@click.option("--rules-path", "rules_path", multiple=True, type=click.Path(exists=True, file_okay=False),
              help=f"Also load the rules in this folder (repeatable; as ${RULES_PATH_ENV}).")
@click.option("--path", "config_from", default=".", show_default=True, type=click.Path(exists=True),
              help="Read the [tool.kvpatch] config found walking up from here (its rules-path and rules).")
@click.pass_obj
def test_cmd(out, rule_ids, rules_path, config_from="."):
    """Check rules against their own VALID and INVALID examples.

    Every example runs with all rules loaded and with the rule alone; an
    INVALID example with expected code must rewrite to exactly that code,
    re-audit as patched and not change on a second apply. RULE is an ID or a
    NAME (default: the config's `rules`, else every rule, local ones included).
    The config's rules-path folders load too, as for audit.

    \b
    Example:  kvpatch test --rules-path ./my_rules KVP901
    """
    from kvpatch import ruletest
    from kvpatch.cli.out import _settings
    from kvpatch.rule import load_rules

    cfg = _settings(config_from, out)  # loads the config's rules-path for this command
    rule_ids = tuple(rule_ids) or tuple(cfg.rules.value or ())
    before = os.environ.get(RULES_PATH_ENV)
    if rules_path:
        os.environ[RULES_PATH_ENV] = os.pathsep.join([*rules_path, *filter(None, (before or "").split(os.pathsep))])
    try:
        rules = load_rules(list(rule_ids) or None)
    except KeyError as exc:
        out.error(exc.args[0])
        sys.exit(EXIT_ERROR)
    finally:  # the folders count for this command only
        if before is None:
            os.environ.pop(RULES_PATH_ENV, None)
        else:
            os.environ[RULES_PATH_ENV] = before
    chosen = [r for r in rules if r.enabled] if rule_ids else None
    for r in rules:  # the examples run with every rule reporting
        r.enabled = True
    failed = passed = 0
    for rule in chosen if chosen is not None else rules:
        why = ruletest.missing_metadata(rule)
        if why:
            failed += 1
            out.echo(f"{out.style('FAIL', fg='red', bold=True)} {rule.ID}: {why}")
    for case in ruletest.cases(rules, chosen):
        why = ruletest.check(case, rules)
        if why is None:
            passed += 1
            if out.verbose:
                out.echo(f"{out.style('ok', fg='green')}   {case.name}")
            continue
        failed += 1
        out.echo(f"{out.style('FAIL', fg='red', bold=True)} {case.name}: {why}")
    n = len(chosen if chosen is not None else rules)
    out.echo(f"kvpatch test: {n} rule(s), {passed} example check(s) passed, {failed} failed")
    sys.exit(EXIT_ACTION if failed else EXIT_OK)
