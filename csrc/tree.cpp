#include "bindings.hpp"

namespace edgespec {
void bind_tree(pybind11::module_ &) {}
}  // namespace edgespec
