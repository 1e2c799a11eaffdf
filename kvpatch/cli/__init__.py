"""The command line: commands (the click group and commands), out (shared options and
terminal output), info (rules, config, verify), ask (`apply -i`), testing (`kvpatch test`).
Thin: it parses options, calls the flow, renders and exits."""
