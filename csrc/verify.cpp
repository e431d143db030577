#include "bindings.hpp"

namespace edgespec {
void bind_verify(pybind11::module_ &) {}
}  // namespace edgespec
