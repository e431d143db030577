#include "verify.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.hpp"

namespace edgespec {

void SamplerConfig::validate() const {
    if (!(temperature >= 0.0) || !std::isfinite(temperature))
        throw std::invalid_argument("temperature must be a finite number >= 0");
}

double uniform_at(uint64_t seed, int64_t pos) {
    // splitmix64: output number pos+1 of the stream that starts at state `seed`.
    uint64_t z = seed + static_cast<uint64_t>(pos + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
}

int32_t argmax_row(const float *row, int64_t n) {
    // One pass; 2 x 4 lanes each keep the first index of their maximum (strict >, so NaN never
    // wins). GCC/Clang 16-byte vector extensions map to SSE2 on x86 and NEON on ARM (Jetson);
    // wider vectors without -mavx get split badly (measured 15x slower).
    typedef float v4f __attribute__((vector_size(16)));
    typedef int32_t v4i __attribute__((vector_size(16)));
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    float best = kNegInf;
    int64_t best_i = 0;
    int64_t i = 0;
    if (n >= 8) {
        v4f acc0 = {kNegInf, kNegInf, kNegInf, kNegInf}, acc1 = acc0;
        v4i idx0 = {0, 0, 0, 0}, idx1 = idx0;
        v4i cur0 = {0, 1, 2, 3}, cur1 = {4, 5, 6, 7};
        const v4i step = {8, 8, 8, 8};
        for (; i + 8 <= n; i += 8) {
            v4f a, b;
            std::memcpy(&a, row + i, sizeof a);
            std::memcpy(&b, row + i + 4, sizeof b);
            const v4i g0 = a > acc0, g1 = b > acc1;
            acc0 = reinterpret_cast<v4f>((reinterpret_cast<v4i>(a) & g0) | (reinterpret_cast<v4i>(acc0) & ~g0));
            acc1 = reinterpret_cast<v4f>((reinterpret_cast<v4i>(b) & g1) | (reinterpret_cast<v4i>(acc1) & ~g1));
            idx0 = (cur0 & g0) | (idx0 & ~g0);
            idx1 = (cur1 & g1) | (idx1 & ~g1);
            cur0 += step;
            cur1 += step;
        }
        auto take = [&](float v, int32_t at) {
            if (v > best || (v == best && v != kNegInf && at < best_i)) {
                best = v;
                best_i = at;
            }
        };
        for (int j = 0; j < 4; ++j) {
            take(acc0[j], idx0[j]);
            take(acc1[j], idx1[j]);
        }
    }
    for (; i < n; ++i)
        if (row[i] > best) {
            best = row[i];
            best_i = i;
        }
    return static_cast<int32_t>(best_i);  // all -inf/NaN: 0
}

namespace {

thread_local std::vector<double> scratch_w;

}  // namespace

int32_t sample_row(const float *row, int64_t n, const SamplerConfig &cfg, int64_t pos) {
    if (cfg.temperature == 0.0) return argmax_row(row, n);
    float fmax = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t i = 0; i < n; ++i) {
        const float v = row[i];
        nan |= (v != v);
        fmax = v > fmax ? v : fmax;
    }
    if (nan) throw std::invalid_argument("NaN in a logits row");
    if (fmax == -std::numeric_limits<float>::infinity())
        throw std::invalid_argument("logits row has no finite value");
    // Inverse-CDF draw over all ids in ascending order with weights exp((l - lmax) / T).
    const double lmax = fmax, temp = cfg.temperature;
    auto &w = scratch_w;
    w.resize(static_cast<size_t>(n));
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        w[i] = std::exp((static_cast<double>(row[i]) - lmax) / temp);
        total += w[i];
    }
    const double target = uniform_at(cfg.seed, pos) * total;
    double cum = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < n; ++i) {
        cum += w[i];
        if (w[i] > 0.0) last = i;
        if (cum > target) return static_cast<int32_t>(i);
    }
    return static_cast<int32_t>(last < 0 ? 0 : last);
}

// ---------------------------------------------------------------------------------------------

Verification::Verification(const SamplerConfig &cfg, int32_t root_pos, const int32_t *tokens,
                           const int32_t *parents, int32_t n)
    : cfg_(cfg), root_pos_(root_pos) {
    cfg_.validate();
    if (root_pos < 0) throw std::invalid_argument("root position must be >= 0");
    if (n < 1) throw std::invalid_argument("a tree has at least its root row");
    if (parents[0] != -1) throw std::invalid_argument("row 0 must be the root (parent -1)");
    extend(tokens, parents, n, 0);
}

void Verification::extend(const int32_t *tokens, const int32_t *parents, int32_t n, int32_t start) {
    if (start != n_known())
        throw std::invalid_argument("extension must start at row " + std::to_string(n_known()) + ", got " +
                                    std::to_string(start));
    for (int32_t j = 0; j < n; ++j) {
        const int32_t i = start + j, p = parents[j], t = tokens[j];
        if (t < 0) throw std::invalid_argument("token ids must be >= 0");
        if (i > 0 && (p < 0 || p >= i))
            throw std::invalid_argument("row " + std::to_string(i) + " has parent " + std::to_string(p) +
                                        "; rows must be parents-first with one root");
        if (i > 0 && child_with(p, t) >= 0)
            throw std::invalid_argument("row " + std::to_string(i) + " duplicates token " + std::to_string(t) +
                                        " under row " + std::to_string(p));
        token_.push_back(t);
        parent_.push_back(i == 0 ? -1 : p);
        depth_.push_back(i == 0 ? 0 : depth_[p] + 1);
        first_child_.push_back(-1);
        last_child_.push_back(-1);
        next_sibling_.push_back(-1);
        if (i > 0) {
            if (last_child_[p] < 0) first_child_[p] = i;
            else next_sibling_[last_child_[p]] = i;
            last_child_[p] = i;
        }
    }
}

int32_t Verification::child_with(int32_t node, int32_t token) const {
    for (int32_t c = first_child_[node]; c >= 0; c = next_sibling_[c])
        if (token_[c] == token) return c;
    return -1;
}

void Verification::begin_feed(int64_t rows, int32_t start, const int32_t *ids) {
    if (start < dec_.n_processed)
        throw std::invalid_argument("rows must arrive in order: row " + std::to_string(start) +
                                    " is before the next unprocessed row " + std::to_string(dec_.n_processed));
    if (rows < 0) throw std::invalid_argument("negative row count");
    int64_t stop = start + rows;
    if (ids != nullptr) {
        for (int64_t r = 0; r < rows; ++r)
            if (ids[r] < start || (r > 0 && ids[r] <= ids[r - 1]))
                throw std::invalid_argument("row ids must be ascending and >= start");
        stop = rows > 0 ? static_cast<int64_t>(ids[rows - 1]) + 1 : start;
    }
    if (stop > n_known())
        throw std::invalid_argument("fed rows up to " + std::to_string(stop) + " exceed the " +
                                    std::to_string(n_known()) + " known rows");
    dec_.n_processed = static_cast<int32_t>(stop);
}

template <class Target>
void Verification::walk(int32_t start, int64_t rows, const int32_t *ids, Target target) {
    if (dec_.status == ACCEPTED) return;
    int32_t cur = dec_.path.back();
    int64_t hint = 0;  // the walk only descends, so the row lookup only moves forward
    while (cur < dec_.n_processed) {
        int64_t local = -1;
        if (ids == nullptr) {
            if (cur >= start) local = cur - start;
        } else {
            while (hint < rows && ids[hint] < cur) ++hint;
            if (hint < rows && ids[hint] == cur) local = hint;
        }
        if (local < 0)
            throw std::invalid_argument("row " + std::to_string(cur) +
                                        " is on the accepted path but its logits were never fed");
        const int32_t x = target(local, cur);
        const int32_t c = child_with(cur, x);
        if (c < 0) {
            dec_.status = ACCEPTED;
            dec_.bonus = x;
            dec_.need_row = -1;
            return;
        }
        dec_.path.push_back(c);
        dec_.tokens.push_back(x);
        cur = c;
    }
    dec_.need_row = cur;
}

const Decision &Verification::feed_logits(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride,
                                          int32_t start, const int32_t *ids) {
    if (vocab < 1) throw std::invalid_argument("logits rows are empty");
    begin_feed(rows, start, ids);
    walk(start, rows, ids, [&](int64_t local, int32_t node) {
        return sample_row(logits + local * row_stride, vocab, cfg_, root_pos_ + depth_[node] + 1);
    });
    return dec_;
}

const Decision &Verification::feed_targets(const int32_t *targets, int64_t rows, int32_t start,
                                           const int32_t *ids) {
    begin_feed(rows, start, ids);
    walk(start, rows, ids, [&](int64_t local, int32_t) { return targets[local]; });
    return dec_;
}

// ---------------------------------------------------------------------------------------------
// Python bindings

namespace py = pybind11;

namespace {

using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

I32 as_i32(const py::handle &h, const char *what) {
    auto a = I32::ensure(h);
    if (!a || a.ndim() != 1) throw std::invalid_argument(std::string(what) + " must be a 1-D integer array");
    return a;
}

// A float32 [rows, vocab] view with contiguous rows (any row stride: llama.cpp buffers, slices).
struct LogitsView {
    const float *data;
    int64_t rows, vocab, stride;
};

LogitsView as_logits(const py::array &a) {
    if (!py::isinstance<py::array_t<float>>(a) || a.ndim() != 2)
        throw std::invalid_argument("logits must be a float32 array of shape [rows, vocab]");
    if (a.shape(1) > 1 && a.strides(1) != static_cast<py::ssize_t>(sizeof(float)))
        throw std::invalid_argument("logits rows must be contiguous (last stride 4 bytes)");
    if (a.strides(0) % static_cast<py::ssize_t>(sizeof(float)) != 0 || a.strides(0) < 0)
        throw std::invalid_argument("logits row stride must be a positive multiple of 4 bytes");
    return {static_cast<const float *>(a.data()), a.shape(0), a.shape(1),
            a.strides(0) / static_cast<py::ssize_t>(sizeof(float))};
}

template <class T>
py::array_t<T> to_array(const std::vector<T> &v) {
    py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), a.mutable_data());
    return a;
}

std::unique_ptr<Verification> make_verification(const SamplerConfig &cfg, int32_t root_pos, py::handle tokens,
                                                py::handle parents) {
    auto t = as_i32(tokens, "tokens");
    auto p = as_i32(parents, "parents");
    if (t.shape(0) != p.shape(0)) throw std::invalid_argument("tokens and parents differ in length");
    return std::make_unique<Verification>(cfg, root_pos, t.data(), p.data(), static_cast<int32_t>(t.shape(0)));
}

}  // namespace

void bind_verify(py::module_ &m) {
    m.attr("ACCEPTED") = static_cast<int>(ACCEPTED);
    m.attr("PENDING") = static_cast<int>(PENDING);

    py::class_<SamplerConfig>(m, "SamplerConfig")
        .def(py::init([](double temperature, uint64_t seed) {
                 SamplerConfig c{temperature, seed};
                 c.validate();
                 return c;
             }),
             py::arg("temperature") = 0.0, py::arg("seed") = 0)
        .def_readonly("temperature", &SamplerConfig::temperature)
        .def_readonly("seed", &SamplerConfig::seed)
        .def("__repr__", [](const SamplerConfig &c) {
            return "SamplerConfig(temperature=" + std::to_string(c.temperature) + ", seed=" +
                   std::to_string(c.seed) + ")";
        });

    py::class_<Decision>(m, "Decision")
        .def(py::init([](int32_t status, py::handle path, int32_t bonus, py::handle tokens) {
                 if (status != ACCEPTED && status != PENDING) throw std::invalid_argument("unknown status");
                 Decision d;
                 auto p = as_i32(path, "path");
                 if (p.shape(0) < 1) throw std::invalid_argument("a path holds at least the root row");
                 d.status = status;
                 d.path.assign(p.data(), p.data() + p.shape(0));
                 if (!tokens.is_none()) {
                     auto t = as_i32(tokens, "tokens");
                     d.tokens.assign(t.data(), t.data() + t.shape(0));
                     if (d.tokens.size() + 1 != d.path.size())
                         throw std::invalid_argument("tokens must hold one token per path row after the root");
                 }
                 if (status == ACCEPTED && bonus < 0) throw std::invalid_argument("an accepted decision needs a bonus token");
                 d.bonus = status == ACCEPTED ? bonus : -1;
                 d.need_row = status == PENDING ? d.path.back() : -1;
                 return d;
             }),
             py::arg("status"), py::arg("path"), py::arg("bonus") = -1, py::arg("tokens") = py::none())
        .def_readonly("status", &Decision::status)
        .def_property_readonly("accepted", [](const Decision &d) { return d.status == ACCEPTED; })
        .def_property_readonly("path", [](const Decision &d) { return to_array(d.path); })
        .def_property_readonly("tokens", [](const Decision &d) { return to_array(d.tokens); })
        .def_readonly("bonus", &Decision::bonus)
        .def_readonly("need_row", &Decision::need_row)
        .def_readonly("n_processed", &Decision::n_processed)
        .def("__repr__", [](const Decision &d) {
            std::string s = d.status == ACCEPTED ? "Decision(ACCEPTED, path=[" : "Decision(PENDING, path=[";
            for (size_t i = 0; i < d.path.size(); ++i) s += (i ? ", " : "") + std::to_string(d.path[i]);
            s += "], ";
            s += d.status == ACCEPTED ? "bonus=" + std::to_string(d.bonus) : "need_row=" + std::to_string(d.need_row);
            return s + ")";
        });

    py::class_<Verification>(m, "Verification")
        .def(py::init(&make_verification), py::arg("config"), py::arg("root_pos"), py::arg("tokens"),
             py::arg("parents"))
        .def(
            "extend",
            [](Verification &v, py::handle tokens, py::handle parents, int32_t start) {
                auto t = as_i32(tokens, "tokens");
                auto p = as_i32(parents, "parents");
                if (t.shape(0) != p.shape(0)) throw std::invalid_argument("tokens and parents differ in length");
                v.extend(t.data(), p.data(), static_cast<int32_t>(t.shape(0)), start);
            },
            py::arg("tokens"), py::arg("parents"), py::arg("start"))
        .def(
            "feed",
            [](Verification &v, const py::array &logits, int32_t start, py::handle rows) {
                const LogitsView l = as_logits(logits);
                I32 ids;
                if (!rows.is_none()) {
                    ids = as_i32(rows, "rows");
                    if (ids.shape(0) != l.rows) throw std::invalid_argument("one row id per logits row");
                }
                const int32_t *pid = rows.is_none() ? nullptr : ids.data();
                Decision d;
                {
                    py::gil_scoped_release nogil;
                    d = v.feed_logits(l.data, l.rows, l.vocab, l.stride, start, pid);
                }
                return d;
            },
            py::arg("logits"), py::arg("start"), py::arg("rows") = py::none())
        .def(
            "feed_targets",
            [](Verification &v, py::handle targets, int32_t start, py::handle rows) {
                auto t = as_i32(targets, "targets");
                I32 ids;
                if (!rows.is_none()) {
                    ids = as_i32(rows, "rows");
                    if (ids.shape(0) != t.shape(0)) throw std::invalid_argument("one row id per target");
                }
                return v.feed_targets(t.data(), t.shape(0), start, rows.is_none() ? nullptr : ids.data());
            },
            py::arg("targets"), py::arg("start"), py::arg("rows") = py::none())
        .def_property_readonly("decision", &Verification::decision)
        .def_property_readonly("n_known", &Verification::n_known)
        .def_property_readonly("root_pos", &Verification::root_pos)
        .def_property_readonly("config", &Verification::config);

    m.def("uniform", &uniform_at, py::arg("seed"), py::arg("pos"),
          "The uniform draw used for the token at sequence position `pos`.");
    m.def(
        "argmax_rows",
        [](const py::array &logits) {
            const LogitsView l = as_logits(logits);
            py::array_t<int32_t> out(l.rows);
            int32_t *o = out.mutable_data();
            {
                py::gil_scoped_release nogil;
                for (int64_t r = 0; r < l.rows; ++r) o[r] = argmax_row(l.data + r * l.stride, l.vocab);
            }
            return out;
        },
        py::arg("logits"));
    m.def(
        "mask_rows",
        [](py::array_t<float, py::array::c_style> logits, py::array_t<int32_t, py::array::c_style> bitmask) {
            // Constrained decoding: every token whose bit is clear in its row of the grammar's
            // bitmask (llguidance's layout: bit t % 32 of word t / 32) becomes -inf, in place.
            if (logits.ndim() != 2 || bitmask.ndim() != 2 || bitmask.shape(0) != logits.shape(0))
                throw std::invalid_argument("mask_rows: logits [k, vocab] and bitmask [k, words]");
            const int64_t rows = logits.shape(0), vocab = logits.shape(1), words = bitmask.shape(1);
            float *l = logits.mutable_data();
            const uint32_t *b = reinterpret_cast<const uint32_t *>(bitmask.data());
            const float ninf = -std::numeric_limits<float>::infinity();
            {
                py::gil_scoped_release nogil;
                for (int64_t r = 0; r < rows; ++r) {
                    float *row = l + r * vocab;
                    const uint32_t *bits = b + r * words;
                    for (int64_t w = 0; w * 32 < vocab; ++w) {
                        const uint32_t word = w < words ? bits[w] : 0u;
                        if (word == 0xFFFFFFFFu) continue;
                        const int64_t end = std::min<int64_t>(vocab, (w + 1) * 32);
                        if (word == 0u) {
                            std::fill(row + w * 32, row + end, ninf);
                            continue;
                        }
                        for (int64_t t = w * 32; t < end; ++t)
                            if (!((word >> (t - w * 32)) & 1u)) row[t] = ninf;
                    }
                }
            }
        },
        py::arg("logits").noconvert(), py::arg("bitmask").noconvert());
    m.def(
        "sample_rows",
        [](const py::array &logits, py::handle positions, const SamplerConfig &cfg) {
            const LogitsView l = as_logits(logits);
            auto pos = as_i32(positions, "positions");
            if (pos.shape(0) != l.rows) throw std::invalid_argument("one position per logits row");
            py::array_t<int32_t> out(l.rows);
            int32_t *o = out.mutable_data();
            const int32_t *pp = pos.data();
            {
                py::gil_scoped_release nogil;
                for (int64_t r = 0; r < l.rows; ++r)
                    o[r] = sample_row(l.data + r * l.stride, l.vocab, cfg, static_cast<int64_t>(pp[r]) + 1);
            }
            return out;
        },
        py::arg("logits"), py::arg("positions"), py::arg("config"));
}

}  // namespace edgespec
