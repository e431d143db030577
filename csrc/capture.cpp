// The llama.cpp eval callback that captures a stage's output hidden states (see capture.hpp).
#include "capture.hpp"

#include <cstring>
#include <stdexcept>
#include <utility>

#include <pybind11/numpy.h>

#include "bindings.hpp"

namespace py = pybind11;

namespace edgespec {

HiddenCapture::HiddenCapture(std::string tensor_name, std::size_t n_embd, std::size_t max_rows,
                             std::uintptr_t fn_get_name, std::uintptr_t fn_nbytes,
                             std::uintptr_t fn_tensor_get)
    : name_(std::move(tensor_name)), n_embd_(n_embd), max_rows_(max_rows) {
    if (n_embd_ == 0 || max_rows_ == 0)
        throw std::invalid_argument("HiddenCapture: n_embd and max_rows must be positive");
    if (fn_get_name == 0 || fn_nbytes == 0 || fn_tensor_get == 0)
        throw std::invalid_argument("HiddenCapture: null ggml function address");
    get_name_ = reinterpret_cast<ggml_get_name_fn>(fn_get_name);
    nbytes_ = reinterpret_cast<ggml_nbytes_fn>(fn_nbytes);
    tensor_get_ = reinterpret_cast<ggml_backend_tensor_get_fn>(fn_tensor_get);
    buffer_.assign(n_embd_ * max_rows_, 0.0f);
}

void HiddenCapture::reset() noexcept {
    rows_ = 0;
    calls_ = 0;
    error_.clear();
    input_ = nullptr;
    input_rows_ = 0;
    restored_rows_ = 0;
}

void HiddenCapture::restore_input(std::string name, std::uintptr_t fn_tensor_set) {
    if (name.empty()) throw std::invalid_argument("HiddenCapture: empty restore tensor name");
    if (fn_tensor_set == 0) throw std::invalid_argument("HiddenCapture: null ggml function address");
    restore_name_ = std::move(name);
    tensor_set_ = reinterpret_cast<ggml_backend_tensor_set_fn>(fn_tensor_set);
}

void HiddenCapture::set_input(std::uintptr_t data, std::size_t rows) noexcept {
    input_ = reinterpret_cast<const float *>(data);
    input_rows_ = rows;
    restored_rows_ = 0;
}

bool HiddenCapture::restore(void *tensor) noexcept {
    const std::size_t row_bytes = n_embd_ * sizeof(float);
    const std::size_t nbytes = nbytes_(tensor);
    const std::size_t rows = nbytes / row_bytes;
    if (input_ == nullptr || nbytes % row_bytes != 0 || restored_rows_ + rows > input_rows_) {
        try {
            error_ = "cannot restore " + restore_name_ + ": " + std::to_string(nbytes) + " bytes, " +
                     std::to_string(input_rows_ - restored_rows_) + " input rows left";
        } catch (...) {
        }
        return false;
    }
    tensor_set_(tensor, input_ + restored_rows_ * n_embd_, 0, nbytes);
    restored_rows_ += rows;
    return true;  // keep computing: the layers read the restored rows
}

bool HiddenCapture::callback(void *tensor, bool ask, void *user_data) noexcept {
    if (user_data == nullptr || tensor == nullptr) return false;
    return static_cast<HiddenCapture *>(user_data)->on_tensor(tensor, ask);
}

bool HiddenCapture::on_tensor(void *tensor, bool ask) noexcept {
    // llama.cpp calls this on every graph node: anything that throws or allocates here would
    // unwind through C frames, so every failure is recorded in error_ and reported by Python.
    const char *name = get_name_(tensor);
    if (name != nullptr && !restore_name_.empty() && std::strcmp(name, restore_name_.c_str()) == 0) {
        return ask ? true : restore(tensor);
    }
    if (name == nullptr || name_.empty() || std::strcmp(name, name_.c_str()) != 0) {
        // Not ours: on ask we decline (so the scheduler batches it with its neighbours);
        // a non-ask call for a tensor we did not claim cannot happen, keep computing anyway.
        return !ask;
    }
    if (ask) return true;  // claim it: the scheduler computes up to here, then calls again

    ++calls_;
    const std::size_t row_bytes = n_embd_ * sizeof(float);
    const std::size_t nbytes = nbytes_(tensor);
    if (nbytes % row_bytes != 0) {
        try {
            error_ = "tensor " + name_ + " has " + std::to_string(nbytes) +
                     " bytes, not a multiple of a float32 row of " + std::to_string(n_embd_);
        } catch (...) {
        }
        return false;
    }
    const std::size_t rows = nbytes / row_bytes;
    if (rows_ + rows > max_rows_) {
        try {
            error_ = "captured rows exceed capacity " + std::to_string(max_rows_);
        } catch (...) {
        }
        return false;
    }
    // Rows of successive ubatches arrive in batch order (unified KV splits sequentially).
    tensor_get_(tensor, buffer_.data() + rows_ * n_embd_, 0, nbytes);
    rows_ += rows;
    // false ends this graph split: on a CPU context that skips output norm and lm_head.
    return false;
}

void bind_capture(py::module_ &m) {
    py::class_<HiddenCapture>(m, "HiddenCapture", R"doc(
Eval callback that copies one named tensor (a stage's last `l_out-{k-1}`) into an owned float32
buffer. Put `callback_address` into llama_context_params.cb_eval and `user_data` into
cb_eval_user_data; call reset() before every llama_decode, then `view()` gives the rows captured
by that decode without a copy (valid until the next decode).
)doc")
        .def(py::init<std::string, std::size_t, std::size_t, std::uintptr_t, std::uintptr_t,
                      std::uintptr_t>(),
             py::arg("tensor_name"), py::arg("n_embd"), py::arg("max_rows"), py::arg("fn_get_name"),
             py::arg("fn_nbytes"), py::arg("fn_tensor_get"))
        .def_property_readonly_static(
            "callback_address",
            [](py::object) {
                return reinterpret_cast<std::uintptr_t>(&HiddenCapture::callback);
            },
            "address of the C callback bool(ggml_tensor*, bool ask, void* user_data)")
        .def_property_readonly(
            "user_data", [](HiddenCapture &self) { return reinterpret_cast<std::uintptr_t>(&self); },
            "address to pass as cb_eval_user_data")
        .def("reset", &HiddenCapture::reset)
        .def("restore_input", &HiddenCapture::restore_input, py::arg("tensor_name"),
             py::arg("fn_tensor_set"),
             "after `tensor_name` is computed, overwrite it with the rows given to set_input")
        .def("set_input", &HiddenCapture::set_input, py::arg("data"), py::arg("rows"),
             "address and row count of the next decode's float32 input (call after reset)")
        .def_property_readonly("restore_name", &HiddenCapture::restore_name)
        .def_property_readonly("restored_rows", &HiddenCapture::restored_rows)
        .def_property_readonly("tensor_name", &HiddenCapture::tensor_name)
        .def_property_readonly("n_embd", &HiddenCapture::n_embd)
        .def_property_readonly("max_rows", &HiddenCapture::max_rows)
        .def_property_readonly("rows", &HiddenCapture::rows)
        .def_property_readonly("calls", &HiddenCapture::calls)
        .def_property_readonly("error", &HiddenCapture::error)
        .def(
            "view",
            [](py::object self_obj) {
                auto &self = self_obj.cast<HiddenCapture &>();
                const auto n = static_cast<py::ssize_t>(self.n_embd());
                // The array keeps the capture object alive through its base.
                return py::array_t<float>({static_cast<py::ssize_t>(self.rows()), n},
                                          {n * static_cast<py::ssize_t>(sizeof(float)),
                                           static_cast<py::ssize_t>(sizeof(float))},
                                          self.data(), self_obj);
            },
            "float32 [rows, n_embd] view of the captured rows (no copy; valid until next decode)");
}

}  // namespace edgespec
