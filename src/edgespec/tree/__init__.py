"""The token tree of one verification and its KV operations (docs/design.md 2, 6).

``core`` is the typed facade over the C++ speculative core (TokenTree, Verifier, plans);
``kvop`` holds the one KvOp: the numbering of KV-cache operations used by the core, the wire and
the stages alike.
"""
