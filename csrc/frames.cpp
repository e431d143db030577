#include "frames.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <pybind11/numpy.h>

#include "bindings.hpp"

namespace py = pybind11;

namespace edgespec {

namespace {

// The wire's numbers (edgespec/wire/header.py, edgespec/wire/codec.py); the Python tests
// compare these with the enums there.
enum WireKind : int { KIND_TOKENS = 32, KIND_HIDDEN = 33, KIND_RESULT = 34 };
enum WireTag : int {
    TAG_TOKENS = 1, TAG_POSITIONS = 2, TAG_SEQ_IDS = 3, TAG_RESERVED = 4, TAG_HIDDEN = 5,
    TAG_KV_OPS = 6, TAG_TARGETS = 7, TAG_NODES = 8, TAG_META = 9,
};
enum WireEncoding : int { ENC_I32 = 1, ENC_F32 = 2, ENC_BITS = 5, ENC_JSON = 6 };

// The wire is little-endian; on another host every call defers to the Python codec.
bool little_endian() {
    const uint16_t one = 1;
    uint8_t first = 0;
    std::memcpy(&first, &one, 1);
    return first == 1;
}

using I32Array = py::array_t<int32_t, py::array::c_style>;
using F32Array = py::array_t<float, py::array::c_style>;

// An int32 C-contiguous array of the given rank, else nullptr-like (false).
bool as_i32(const py::handle &h, int ndim, I32Array &out) {
    if (!py::isinstance<I32Array>(h)) return false;
    out = py::reinterpret_borrow<I32Array>(h);
    return out.ndim() == ndim;
}

void put_u32(std::string &s, uint32_t v) {
    char b[4];
    std::memcpy(b, &v, 4);
    s.append(b, 4);
}

void field_head(std::string &s, int tag, int enc, std::initializer_list<uint64_t> dims) {
    s.push_back(static_cast<char>(tag));
    s.push_back(static_cast<char>(enc));
    s.push_back(static_cast<char>(dims.size()));
    s.push_back('\0');
    for (uint64_t d : dims) put_u32(s, static_cast<uint32_t>(d));
}

void pad4(std::string &s, size_t size) {
    s.append((4 - size % 4) % 4, '\0');
}

void i32_field(std::string &s, int tag, const I32Array &a, std::initializer_list<uint64_t> dims) {
    field_head(s, tag, ENC_I32, dims);
    const size_t bytes = static_cast<size_t>(a.size()) * 4;
    s.append(reinterpret_cast<const char *>(a.data()), bytes);
}

bool all_non_negative(const I32Array &a) {
    const int32_t *p = a.data();
    for (py::ssize_t i = 0; i < a.size(); ++i)
        if (p[i] < 0) return false;
    return true;
}

// One KV operation as edgespec.wire.codec.kv_ops_list accepts it (codes of tree/kvop.py).
bool kv_op_ok(const int32_t *r) {
    const int32_t code = r[0], seq = r[1], p0 = r[2], p1 = r[3], arg = r[4];
    if (code < 1 || code > 6) return false;
    if (seq < 0 || p0 < -1 || p1 < -1 || (p0 >= 0 && p1 >= 0 && p1 < p0)) return false;
    if (code == 2 && arg < 0) return false;            // CP needs a destination
    // RM, KEEP, PARK, RESTORE take no argument; PARK and RESTORE a whole sequence
    if (code != 2 && code != 4 && arg != 0) return false;
    if (code >= 5 && (p0 != -1 || p1 != -1)) return false;
    return true;
}

// Payload of a batch: TOKENS when `hidden` is None, else HIDDEN (float32). Fields in tag
// order, as edgespec.wire.codec encodes them. None when anything is not in the form taken
// here, or would be refused: the caller then goes through the Python codec, which encodes it
// or raises the fault's own WireError.
py::object build_batch_payload(py::handle tokens, py::handle positions, py::handle ids,
                               py::handle counts, py::handle nodes, py::handle hidden,
                               py::handle kv_ops, py::bytes meta) {
    if (!little_endian()) return py::none();
    I32Array pos, sid, cnt, nod, tok, kv;
    if (!as_i32(positions, 1, pos) || !as_i32(ids, 2, sid) || !as_i32(counts, 1, cnt) ||
        !as_i32(nodes, 1, nod))
        return py::none();
    const py::ssize_t n = pos.shape(0);
    if (n < 1 || n > 0x7fffffff || cnt.shape(0) != n || sid.shape(0) != n || nod.shape(0) != n)
        return py::none();
    const bool has_tokens = !tokens.is_none();
    if (has_tokens && (!as_i32(tokens, 1, tok) || tok.shape(0) != n || !all_non_negative(tok)))
        return py::none();
    F32Array hid;
    const bool has_hidden = !hidden.is_none();
    if (has_hidden) {
        if (!py::isinstance<F32Array>(hidden)) return py::none();
        hid = py::reinterpret_borrow<F32Array>(hidden);
        if (hid.ndim() != 2 || hid.shape(0) != n || hid.shape(1) < 1) return py::none();
    } else if (!has_tokens) {
        return py::none();
    }
    if (!all_non_negative(pos) || !all_non_negative(nod)) return py::none();
    py::ssize_t m = 0;
    if (!kv_ops.is_none()) {
        if (!as_i32(kv_ops, 2, kv) || kv.shape(1) != 5) return py::none();
        m = kv.shape(0);
        for (py::ssize_t i = 0; i < m; ++i)
            if (!kv_op_ok(kv.data() + 5 * i)) return py::none();
    }
    // SEQ_IDS: row i belongs to ids[i, :counts[i]]; the matrix is (largest id + 1) wide.
    const py::ssize_t k = sid.shape(1);
    const int32_t *ip = sid.data(), *cp = cnt.data();
    int64_t top = -1;
    for (py::ssize_t i = 0; i < n; ++i) {
        if (cp[i] < 1 || cp[i] > k) return py::none();
        for (int32_t j = 0; j < cp[i]; ++j) {
            const int32_t v = ip[i * k + j];
            if (v < 0) return py::none();
            if (v > top) top = v;
        }
    }
    const uint64_t width = static_cast<uint64_t>(top + 1);
    const uint64_t row_bytes = (width + 7) / 8;
    std::string bits(static_cast<size_t>(row_bytes * n), '\0');
    for (py::ssize_t i = 0; i < n; ++i)
        for (int32_t j = 0; j < cp[i]; ++j) {
            const int32_t v = ip[i * k + j];
            bits[i * row_bytes + v / 8] |= static_cast<char>(0x80u >> (v % 8));
        }

    const std::string meta_s = meta;
    std::string s;
    s.reserve(64 + 16 * n + bits.size() + (has_hidden ? 4 * hid.size() : 0) + 20 * m +
              meta_s.size());
    const uint64_t un = static_cast<uint64_t>(n);
    if (has_tokens) i32_field(s, TAG_TOKENS, tok, {un});
    i32_field(s, TAG_POSITIONS, pos, {un});
    field_head(s, TAG_SEQ_IDS, ENC_BITS, {un, width});
    s += bits;
    pad4(s, bits.size());
    if (has_hidden) {
        field_head(s, TAG_HIDDEN, ENC_F32, {un, static_cast<uint64_t>(hid.shape(1))});
        s.append(reinterpret_cast<const char *>(hid.data()), static_cast<size_t>(hid.size()) * 4);
    }
    if (m > 0) i32_field(s, TAG_KV_OPS, kv, {static_cast<uint64_t>(m), 5});
    i32_field(s, TAG_NODES, nod, {un});
    field_head(s, TAG_META, ENC_JSON, {meta_s.size()});
    s += meta_s;
    pad4(s, meta_s.size());
    return py::bytes(s);
}

struct Field {
    bool present = false;
    uint32_t dims[2] = {0, 0};
    size_t off = 0;
    size_t size = 0;
};

// An int32 array copied out of the payload (small: positions, ids, ops).
I32Array copy_i32(const uint8_t *base, const Field &f, std::vector<py::ssize_t> shape) {
    I32Array a(shape);
    if (f.size) std::memcpy(a.mutable_data(), base + f.off, f.size);
    return a;
}

bool i32_non_negative(const uint8_t *base, const Field &f) {
    for (size_t o = 0; o < f.size; o += 4) {
        int32_t v;
        std::memcpy(&v, base + f.off + o, 4);
        if (v < 0) return false;
    }
    return true;
}

// The payload as bytes; false when it is not a plain contiguous byte buffer.
bool payload_bytes(const py::object &payload, py::buffer_info &info) {
    info = py::reinterpret_borrow<py::buffer>(payload).request();
    return info.ndim == 1 && info.itemsize == 1 && (info.strides.empty() || info.strides[0] == 1);
}

// Walk a payload's fields into `f` (by tag), with the codec's checks on each: reserved byte
// zero, no field twice, dims within the payload, data within it, zero padding. `takes(tag,
// enc, ndim)` says which fields the caller reads (its kind's, in their one encoding and rank,
// at most 2 dims). False at the first field that fails or is not taken.
template <class Takes>
bool read_fields(const uint8_t *base, size_t end, Field (&f)[10], Takes takes) {
    size_t off = 0;
    while (off < end) {
        if (end - off < 4) return false;
        const int tag = base[off], enc = base[off + 1], ndim = base[off + 2], reserved = base[off + 3];
        off += 4;
        if (reserved || tag < 1 || tag > 9 || f[tag].present || !takes(tag, enc, ndim)) return false;
        if (ndim < 1 || ndim > 2 || end - off < 4u * ndim) return false;
        Field &fd = f[tag];
        for (int d = 0; d < ndim; ++d) std::memcpy(&fd.dims[d], base + off + 4 * d, 4);
        off += 4 * ndim;
        uint64_t size;
        if (enc == ENC_BITS) size = uint64_t(fd.dims[0]) * ((uint64_t(fd.dims[1]) + 7) / 8);
        else if (enc == ENC_JSON) size = fd.dims[0];
        else size = 4 * uint64_t(fd.dims[0]) * (ndim == 2 ? fd.dims[1] : 1);
        const uint64_t padded = size + (4 - size % 4) % 4;
        if (padded > end - off) return false;
        for (uint64_t p = size; p < padded; ++p)
            if (base[off + p]) return false;
        fd.present = true;
        fd.off = off;
        fd.size = static_cast<size_t>(size);
        off += static_cast<size_t>(padded);
    }
    return true;
}

// The arrays of a TOKENS / HIDDEN payload in the form edgespec.wire.frames builds a Batch
// from: (tokens or None, positions, seq ids [n, k] padded with -1, seq counts, nodes or None,
// hidden float32 [n, E] (a view of the payload) or None, KV ops [m, 5] or None, META's JSON
// bytes or None). None when the payload is anything but the canonical form with every check
// of edgespec.wire.codec passing (another encoding, a reserved tag, a fault of any kind): the caller
// then decodes it with the Python codec, which takes it or names the fault.
py::object parse_batch_payload(py::object payload, int kind) {
    py::buffer_info info;
    if (!little_endian() || (kind != KIND_TOKENS && kind != KIND_HIDDEN) ||
        !payload_bytes(payload, info))
        return py::none();
    const uint8_t *base = static_cast<const uint8_t *>(info.ptr);
    Field f[10];
    const bool read = read_fields(base, static_cast<size_t>(info.size), f, [](int tag, int enc, int ndim) {
        if (tag == TAG_TARGETS || tag == TAG_RESERVED) return false;  // not a batch's: the codec's
        const int want_ndim = (tag == TAG_SEQ_IDS || tag == TAG_HIDDEN || tag == TAG_KV_OPS) ? 2 : 1;
        const int want_enc = tag == TAG_SEQ_IDS ? ENC_BITS : tag == TAG_HIDDEN ? ENC_F32
                             : tag == TAG_META ? ENC_JSON : ENC_I32;
        return enc == want_enc && ndim == want_ndim;
    });
    if (!read) return py::none();
    // Schema of the kind (edgespec.wire.codec): what must be there, what may.
    if (!f[TAG_POSITIONS].present || !f[TAG_SEQ_IDS].present) return py::none();
    if (kind == KIND_TOKENS && (!f[TAG_TOKENS].present || f[TAG_HIDDEN].present)) return py::none();
    if (kind == KIND_HIDDEN && !f[TAG_HIDDEN].present) return py::none();
    const uint32_t n = f[TAG_POSITIONS].dims[0];
    if (n == 0 || f[TAG_SEQ_IDS].dims[0] != n) return py::none();
    for (int tag : {TAG_TOKENS, TAG_NODES, TAG_HIDDEN})
        if (f[tag].present && f[tag].dims[0] != n) return py::none();
    if (f[TAG_HIDDEN].present && f[TAG_HIDDEN].dims[1] == 0) return py::none();
    if (f[TAG_KV_OPS].present && f[TAG_KV_OPS].dims[1] != 5) return py::none();
    for (int tag : {TAG_TOKENS, TAG_POSITIONS, TAG_NODES})
        if (f[tag].present && !i32_non_negative(base, f[tag])) return py::none();
    // SEQ_IDS -> per row its set columns, ascending; every row needs one.
    const uint32_t width = f[TAG_SEQ_IDS].dims[1];
    const size_t row_bytes = (size_t(width) + 7) / 8;
    const uint8_t *bits = base + f[TAG_SEQ_IDS].off;
    std::vector<int32_t> cnt(n, 0);
    int32_t k = 1;
    for (uint32_t i = 0; i < n; ++i) {
        for (uint32_t c = 0; c < width; ++c)
            if (bits[i * row_bytes + c / 8] & (0x80u >> (c % 8))) ++cnt[i];
        if (cnt[i] == 0) return py::none();
        if (cnt[i] > k) k = cnt[i];
    }
    I32Array ids({py::ssize_t(n), py::ssize_t(k)});
    I32Array counts{py::ssize_t(n)};
    int32_t *idp = ids.mutable_data();
    std::memcpy(counts.mutable_data(), cnt.data(), 4 * size_t(n));
    for (uint32_t i = 0; i < n; ++i) {
        int32_t j = 0;
        for (uint32_t c = 0; c < width; ++c)
            if (bits[i * row_bytes + c / 8] & (0x80u >> (c % 8))) idp[size_t(i) * k + j++] = int32_t(c);
        for (; j < k; ++j) idp[size_t(i) * k + j] = -1;
    }
    py::object kv = py::none();
    if (f[TAG_KV_OPS].present) {
        const uint32_t m = f[TAG_KV_OPS].dims[0];
        I32Array ops = copy_i32(base, f[TAG_KV_OPS], {py::ssize_t(m), 5});
        for (uint32_t i = 0; i < m; ++i)
            if (!kv_op_ok(ops.data() + 5 * i)) return py::none();
        kv = ops;
    }
    py::object tokens = py::none(), nodes = py::none(), hidden = py::none(), meta = py::none();
    if (f[TAG_TOKENS].present) tokens = copy_i32(base, f[TAG_TOKENS], {py::ssize_t(n)});
    if (f[TAG_NODES].present) nodes = copy_i32(base, f[TAG_NODES], {py::ssize_t(n)});
    if (f[TAG_HIDDEN].present) {
        // A view: hidden states can be megabytes (a prefill chunk); the payload outlives it.
        const Field &h = f[TAG_HIDDEN];
        hidden = F32Array({py::ssize_t(n), py::ssize_t(h.dims[1])},
                          {py::ssize_t(4) * h.dims[1], py::ssize_t(4)},
                          reinterpret_cast<const float *>(base + h.off), payload);
    }
    if (f[TAG_META].present)
        meta = py::bytes(reinterpret_cast<const char *>(base + f[TAG_META].off), f[TAG_META].size);
    I32Array positions = copy_i32(base, f[TAG_POSITIONS], {py::ssize_t(n)});
    return py::make_tuple(tokens, positions, ids, counts, nodes, hidden, kv, meta);
}

// Payload of a RESULT: the target token of each wanted row (TARGETS), their tree nodes
// (NODES) and META. None when an input is not int32 [k] twice, non-negative.
py::object build_result_payload(py::handle accepted, py::handle nodes, py::bytes meta) {
    if (!little_endian()) return py::none();
    I32Array acc, nod;
    if (!as_i32(accepted, 1, acc) || !as_i32(nodes, 1, nod) || acc.shape(0) != nod.shape(0) ||
        acc.shape(0) > 0x7fffffff || !all_non_negative(acc) || !all_non_negative(nod))
        return py::none();
    const std::string meta_s = meta;
    const uint64_t k = static_cast<uint64_t>(acc.shape(0));
    std::string s;
    s.reserve(48 + 8 * k + meta_s.size());
    i32_field(s, TAG_TARGETS, acc, {k});
    i32_field(s, TAG_NODES, nod, {k});
    field_head(s, TAG_META, ENC_JSON, {meta_s.size()});
    s += meta_s;
    pad4(s, meta_s.size());
    return py::bytes(s);
}

// (accepted, nodes or None, META's JSON bytes or None) of a canonical RESULT payload; None
// when it is anything else (the Python codec then takes it or names the fault).
py::object parse_result_payload(py::object payload) {
    py::buffer_info info;
    if (!little_endian() || !payload_bytes(payload, info)) return py::none();
    const uint8_t *base = static_cast<const uint8_t *>(info.ptr);
    Field f[10];
    const bool read = read_fields(base, static_cast<size_t>(info.size), f, [](int tag, int enc, int ndim) {
        if (tag != TAG_TARGETS && tag != TAG_NODES && tag != TAG_META) return false;
        return enc == (tag == TAG_META ? ENC_JSON : ENC_I32) && ndim == 1;
    });
    if (!read) return py::none();
    if (!f[TAG_TARGETS].present) return py::none();
    for (int tag : {TAG_TARGETS, TAG_NODES})
        if (f[tag].present && !i32_non_negative(base, f[tag])) return py::none();
    py::object nodes = py::none(), meta = py::none();
    if (f[TAG_NODES].present) nodes = copy_i32(base, f[TAG_NODES], {py::ssize_t(f[TAG_NODES].dims[0])});
    if (f[TAG_META].present)
        meta = py::bytes(reinterpret_cast<const char *>(base + f[TAG_META].off), f[TAG_META].size);
    return py::make_tuple(copy_i32(base, f[TAG_TARGETS], {py::ssize_t(f[TAG_TARGETS].dims[0])}),
                          nodes, meta);
}

}  // namespace

void bind_frames(py::module_ &m) {
    m.def("build_batch_payload", &build_batch_payload, py::arg("tokens"), py::arg("positions"),
          py::arg("ids"), py::arg("counts"), py::arg("nodes"), py::arg("hidden"),
          py::arg("kv_ops"), py::arg("meta"),
          "Payload bytes of a TOKENS (hidden None) or HIDDEN batch; None: use the Python codec.");
    m.def("parse_batch_payload", &parse_batch_payload, py::arg("payload"), py::arg("kind"),
          "(tokens, positions, ids, counts, nodes, hidden, kv_ops, meta) of a canonical "
          "TOKENS/HIDDEN payload; None: use the Python codec.");
    m.def("build_result_payload", &build_result_payload, py::arg("accepted"), py::arg("nodes"),
          py::arg("meta"), "Payload bytes of a RESULT; None: use the Python codec.");
    m.def("parse_result_payload", &parse_result_payload, py::arg("payload"),
          "(accepted, nodes, meta) of a canonical RESULT payload; None: use the Python codec.");
}

}  // namespace edgespec
