// The data path's frames in C++: a batch's TOKENS / HIDDEN payload and its RESULT's built
// from their arrays, and read back into arrays (docs/design.md 5.1, 8.3).
//
// Why C++: every hop of every lap encodes one of these and decodes one, and measured in a
// running ring the Python codec runs several times slower than in a warm loop (llama.cpp's
// compute has just evicted the interpreter from the caches), so the handful of calls here
// replace a few hundred Python calls per hop. The protocol itself stays defined by
// edgespec/wire/codec.py: this is a fast path for the canonical form of two frame kinds, and
// anything it does not take (another field, another encoding, any fault) it hands back to the
// Python codec (returns None), which decodes it or names the fault. tests/test_wire_fast.py
// checks both paths agree byte for byte and field for field.
#pragma once

#include <pybind11/pybind11.h>

namespace edgespec {

void bind_frames(pybind11::module_ &m);

}  // namespace edgespec
