#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
    m.doc() = "edgespec C++ core: token trees, lossless verification, rollback plans, capture";
    edgespec::bind_tree(m);
    edgespec::bind_verify(m);
    edgespec::bind_rollback(m);
    edgespec::bind_capture(m);
}
