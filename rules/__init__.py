"""kvpatch's rules, one per module (installed as ``kvpatch.rules``).

Each module defines one ``kvpatch.rule.Rule`` subclass carrying its metadata,
its ``VALID``/``INVALID`` examples and its decision. ``kvpatch rules`` lists
them; ``tests/test_rule_examples.py`` runs every example of every rule.
"""
