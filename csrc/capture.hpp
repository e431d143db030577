// Hidden-state capture for a non-last stage: a llama.cpp eval callback (ggml_backend_sched_eval_callback)
// that claims exactly one tensor, `l_out-{k-1}` (the residual stream after the window's last layer),
// copies it into a buffer owned here and ends the graph split (docs/design.md 3.2).
//
// Nothing here links llama.cpp or ggml: the three ggml functions the callback needs are handed in as
// addresses at run time (read with ctypes from libggml-base.so), so the core builds without llama.cpp
// headers and works with whichever ggml the installed llama-cpp-python ships.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace edgespec {

// Signatures of the ggml functions we call, with ggml_tensor kept opaque.
using ggml_get_name_fn = const char *(*)(const void *tensor);
using ggml_nbytes_fn = std::size_t (*)(const void *tensor);
using ggml_backend_tensor_get_fn = void (*)(const void *tensor, void *data, std::size_t offset,
                                            std::size_t size);
using ggml_backend_tensor_set_fn = void (*)(void *tensor, const void *data, std::size_t offset,
                                            std::size_t size);

class HiddenCapture {
public:
    // tensor_name: the one tensor to claim (e.g. "l_out-5"; "" = capture nothing, for a last
    // window that only restores its input); n_embd: row width in floats; max_rows: buffer
    // capacity in rows (the context's n_batch: one decode never yields more).
    HiddenCapture(std::string tensor_name, std::size_t n_embd, std::size_t max_rows,
                  std::uintptr_t fn_get_name, std::uintptr_t fn_nbytes, std::uintptr_t fn_tensor_get);

    // The C callback llama.cpp calls; user_data must be the HiddenCapture's address.
    static bool callback(void *tensor, bool ask, void *user_data) noexcept;

    // Forget what was captured; called before each llama_decode (rows accumulate across the
    // ubatches of one decode, in batch order).
    void reset() noexcept;

    // Input restore, for architectures whose graph rescales hidden-state input (gemma2 multiplies
    // every input by sqrt(n_embd)): once `name` is computed, overwrite it with the rows given to
    // set_input, so the window's layers see the previous window's states bit for bit.
    void restore_input(std::string name, std::uintptr_t fn_tensor_set);
    // Rows of the next decode's input (float32 [rows, n_embd], owned by the caller, alive until
    // the decode returns); call after reset().
    void set_input(std::uintptr_t data, std::size_t rows) noexcept;
    const std::string &restore_name() const { return restore_name_; }
    std::size_t restored_rows() const { return restored_rows_; }
    const std::string &tensor_name() const { return name_; }
    std::size_t n_embd() const { return n_embd_; }
    std::size_t max_rows() const { return max_rows_; }
    std::size_t rows() const { return rows_; }        // rows captured since reset()
    std::size_t calls() const { return calls_; }      // tensors claimed since reset()
    const std::string &error() const { return error_; }  // why the last capture failed, "" if fine
    float *data() { return buffer_.data(); }

private:
    bool on_tensor(void *tensor, bool ask) noexcept;

    std::string name_;
    std::size_t n_embd_;
    std::size_t max_rows_;
    std::vector<float> buffer_;
    std::size_t rows_ = 0;
    std::size_t calls_ = 0;
    std::string error_;
    ggml_get_name_fn get_name_;
    ggml_nbytes_fn nbytes_;
    ggml_backend_tensor_get_fn tensor_get_;
    std::string restore_name_;
    ggml_backend_tensor_set_fn tensor_set_ = nullptr;
    const float *input_ = nullptr;
    std::size_t input_rows_ = 0;
    std::size_t restored_rows_ = 0;
    bool restore(void *tensor) noexcept;
};

}  // namespace edgespec
