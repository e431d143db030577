// Each part of the core registers its own Python bindings; bindings.cpp only assembles them.
#pragma once
#include <pybind11/pybind11.h>

namespace edgespec {
void bind_tree(pybind11::module_ &m);     // tree.cpp: TokenTree, segmentation
void bind_verify(pybind11::module_ &m);   // verify.cpp: greedy / sampling / step-wise verifier
void bind_rollback(pybind11::module_ &m); // rollback.cpp: KV plans after a decision
void bind_capture(pybind11::module_ &m);  // capture.cpp: llama.cpp eval callback (hidden states)
void bind_frames(pybind11::module_ &m);   // frames.cpp: TOKENS / HIDDEN payloads <-> arrays
}  // namespace edgespec
