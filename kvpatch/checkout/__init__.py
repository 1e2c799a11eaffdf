"""The checkout: git, the transaction that writes it, and its record."""
