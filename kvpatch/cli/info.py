"""`kvpatch rules`, `kvpatch config` and `kvpatch verify`: the commands that read
no checkout state to change it (registered on the group in kvpatch/cli/commands.py)."""

from __future__ import annotations

import importlib
import sys
import time

import click

from kvpatch.cli.out import CONTEXT, Out, _root, _settings, rule_source
from kvpatch.names import MODE_FUSED, MODE_GATHER, MODE_NATIVE
from kvpatch.output.exitcodes import EXIT_ACTION, EXIT_ERROR, EXIT_OK, EXIT_UNVERIFIED

# -- rules -------------------------------------------------------------------
@click.command(name="rules", context_settings=CONTEXT)
@click.argument("path", default=".", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_obj
def rules_cmd(out: Out, path, as_json):
    """List the rules, what each finds or rewrites, and where it was checked.

    Reads the [tool.kvpatch] config found walking up from PATH (default: the
    current folder), as audit does: its rules-path folders' rules are listed
    with the built-in ones, and a rule its `rules` does not select is marked
    `not selected` (it still decides, but apply does not rewrite its sites).

    \b
    Example:  kvpatch rules ~/sglang
    """
    import json

    from kvpatch.rule import load_rules

    cfg = _settings(path, out)  # loads the config's rules-path for this command
    rs = load_rules(cfg.rules.value)
    if as_json:
        out.echo(json.dumps([{"id": r.ID, "name": r.NAME, "kind": r.KIND, "summary": r.SUMMARY,
                              "fixes": r.fixes, "checked_on": list(r.CHECKED_ON), "selected": r.enabled,
                              "examples": {"valid": len(r.VALID), "invalid": len(r.INVALID)}} for r in rs],
                            indent=2))
        sys.exit(EXIT_OK)
    for r in rs:
        kind = "rewrites" if r.fixes else "reports"
        off = "" if r.enabled else f"  [not selected by {cfg.rules.source}]"
        out.echo(f"{out.style(r.ID, bold=True)}  {r.NAME}  ({r.KIND}, {kind}){off}")
        out.echo(f"        {r.SUMMARY}")
        out.echo(f"        examples: {len(r.VALID)} valid, {len(r.INVALID)} invalid; "
                 f"checked on {len(r.CHECKED_ON)} SGLang commits")
        if out.verbose:  # where the rule came from
            out.echo(f"        from: {rule_source(r) or 'built-in (kvpatch.rules)'}")
    n_fix = sum(1 for r in rs if r.fixes)
    n_off = sum(1 for r in rs if not r.enabled)
    out.info(f"kvpatch rules: {len(rs)} rule(s), {n_fix} rewrite, {len(rs) - n_fix} report only"
             + (f"; {n_off} not selected by the config" if n_off else ""))
    sys.exit(EXIT_OK)


# -- config ------------------------------------------------------------------
@click.command(name="config", context_settings=CONTEXT)
@click.argument("path", default=".", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="JSON output: [{setting, value, source}].")
@click.pass_obj
def config_cmd(out: Out, path, as_json):
    """Show the settings kvpatch uses on PATH, and where each comes from.

    The config is the [tool.kvpatch] table of the first pyproject.toml found
    walking up from PATH (default: the current folder); command-line options
    override it. audit (the upgrade audit too), apply and status read it
    (status: exclude only); `kvpatch rules PATH` and `kvpatch test --path PATH`
    read its rules and rules-path. Each setting's source is that file and key, an environment
    variable, or `default`.

    \b
    Example:  kvpatch config ~/sglang
    """
    import json

    from kvpatch.config import rows

    found = rows(_settings(path, out))
    if as_json:
        out.echo(json.dumps([{"setting": k, "value": v, "source": s} for k, v, s in found], indent=2))
        sys.exit(EXIT_OK)
    width = max(len(k) for k, _, _ in found) + 2
    vwidth = min(max(len(v) for _, v, _ in found), 40)
    for key, value, source in found:
        out.echo(f"{out.style(key.ljust(width), bold=True)}{value.ljust(vwidth)}  {source}")
    sys.exit(EXIT_OK)


# -- verify ------------------------------------------------------------------
@click.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.option("--mode", type=click.Choice(["all", "both", "gather", "native", "fused"]), default="all",
              show_default=True, help="Which runtime modes to check: all = gather, native and fused; both = gather "
                                      "and native.")
@click.option("--cpu", is_flag=True, help="Run the CPU reference check only (no GPU needed); exit 0 if it passes.")
@click.option("--no-graph", is_flag=True, help="Skip the CUDA-graph decode cases.")
@click.option("--quick", is_flag=True, help="Fewer, smaller cases.")
@click.option("--json", "as_json", is_flag=True, help="JSON report.")
@click.pass_obj
def verify(out: Out, path, mode, cpu, no_graph, quick, as_json):
    """Check that the patched checkout computes the same attention.

    Loads every patched backend of PATH (FlashInfer MLA; FA3/FA4, MUSA and
    XPU; aiter's MHA extend and decode) and its original (from .kvpatch/originals or git), runs their
    forward_decode and forward_extend on the same random FP8 pool, eager and
    under a CUDA graph, and compares: bit-identical for the gathered cast,
    within tolerance for native FP8 and for the fused FP8 attention of routed
    calls (CUDA with Triton only; on the CPU it is named as not run). FlashInfer runs its own kernels; the
    FA3-family and flash_mla kernels, which need sgl-kernel, and aiter's
    mha_batch_prefill_func and paged_attention_ragged, which need a ROCm GPU, run as a torch reference
    with their semantics on both sides. A path that cannot run is
    reported as skipped with the reason, never as passed; a patched file of a
    backend verify has no driver for (aiter's MLA, say) is named NOT VERIFIED, and
    the verdict is PARTLY VERIFIED (exit 3). Needs torch (pip install torch;
    see the README's Installing).

    \b
    Example:  kvpatch verify ~/sglang --mode gather
    """
    import json

    root = _root(path, out).resolve()
    t0 = time.perf_counter()
    from kvpatch.checkout.safepath import UnsafePath
    from kvpatch.verify.targets import has_state, state_entries

    try:  # an unsafe state is refused first, with torch or without
        if has_state(root):
            state_entries(root)
    except UnsafePath as exc:
        out.error(f"unsafe kvpatch state, nothing was read: {exc}")
        sys.exit(EXIT_ERROR)
    except (OSError, ValueError, AttributeError):
        pass  # unreadable: verify reports it as the target's problem
    try:
        importlib.import_module("torch")
    except ImportError:
        out.error("verify needs torch: pip install torch (a CPU build does for --cpu; see the README's Installing)")
        sys.exit(EXIT_ERROR)
    from kvpatch.verify import run_verify

    modes = {"all": (MODE_GATHER, MODE_NATIVE, MODE_FUSED), "both": (MODE_GATHER, MODE_NATIVE)}.get(mode, (mode,))
    try:
        rep = run_verify(root, modes=modes, device="cpu" if cpu else "auto", graph=not no_graph, quick=quick,
                         log=None if out.quiet else out.info)
    except Exception as exc:  # noqa: BLE001
        out.error(f"verify could not run: {exc}")
        sys.exit(EXIT_ERROR)
    if as_json:
        out.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        out.echo(rep.render())
    if not rep.cases:  # nothing could be checked: bad input, not a mismatch
        out.error(rep.reason or "nothing to verify")
        sys.exit(EXIT_ERROR)
    if not rep.ok:
        sys.exit(EXIT_ACTION)
    n = {k: sum(1 for c in rep.cases if c.status == k) for k in ("passed", "failed", "skipped")}
    out.info(f"kvpatch verify: {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped "
             f"(device {rep.device or '-'}, kernel {rep.kernel or '-'}); {time.perf_counter() - t0:.2f}s")
    if rep.unverified:
        out.info(f"not verified: {len(rep.unverified)} patched file(s) no verify driver covers")
        sys.exit(EXIT_UNVERIFIED)
    if not cpu and not rep.gpu_ran:
        out.info(f"no GPU check: {rep.reason}")
        sys.exit(EXIT_UNVERIFIED)
    sys.exit(EXIT_OK)
