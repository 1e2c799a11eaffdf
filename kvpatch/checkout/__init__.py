"""The checkout: git, the transaction that writes it, and its record.

repo (the checkout as git sees it: branch, commit), git (every git command), gittxn (the
git side of a write), write (all files or none), guarded (the steps apply and revert
share), lock, safepath (nothing outside the checkout), state (.kvpatch/state.json),
originals (the original bytes). A new git step goes here.
"""
