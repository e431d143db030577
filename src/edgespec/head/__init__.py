"""The head's side of edgespec (docs/design.md 1, 5)."""
