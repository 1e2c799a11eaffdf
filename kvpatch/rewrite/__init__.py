"""The rewrite: turn the rules' decisions into new text.

transform (a file's edits applied, re-parsed, or refused), codegen (the layout of every
inserted call), initattr (what a method needs kept by __init__), choose (the changes
`apply -i` asks about), reverse (undo a rewrite in a file edited since). A new kind of
edit goes here.
"""
