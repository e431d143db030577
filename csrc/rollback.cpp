#include "bindings.hpp"

namespace edgespec {
void bind_rollback(pybind11::module_ &) {}
}  // namespace edgespec
