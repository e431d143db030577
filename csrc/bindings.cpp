#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
    m.doc() = "edgespec C++ core: token trees, lossless verification, rollback plans, capture, batch frames";
    edgespec::bind_tree(m);
    edgespec::bind_verify(m);
    edgespec::bind_rollback(m);
    edgespec::bind_capture(m);
    edgespec::bind_frames(m);
}
