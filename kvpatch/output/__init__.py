"""What kvpatch prints: report (table, JSON, SARIF), sarif_fixes (SARIF `fixes`), and
exitcodes (every exit code, spelled once). A new output format goes here."""
