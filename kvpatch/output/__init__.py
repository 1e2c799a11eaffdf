"""What kvpatch prints: table, JSON, SARIF, exit codes."""
