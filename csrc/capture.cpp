#include "bindings.hpp"

namespace edgespec {
void bind_capture(pybind11::module_ &) {}
}  // namespace edgespec
