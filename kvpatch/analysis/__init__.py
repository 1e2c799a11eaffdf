"""Source analysis: find the sites and judge them, before any rule decides.

discover (which files) -> locate (which functions, Python's ast) -> units (libcst parse
of just those) -> match, dataflow, tensorops, pagedcall, stable, classify (what a cast
reads, where it goes, whether it is a no-op) -> candidates (what the engine hands the
rules); suppress reads `# kvpatch: ignore[ID]`. workers: the processes a tree scan uses;
prefetch: audit's discover, run in a helper while the rules load. A new check of the
source goes here (or, when it belongs to one family of sites, in a rule under rules/).
"""
