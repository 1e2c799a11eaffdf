"""The rewrite: turn the decisions into new text."""
