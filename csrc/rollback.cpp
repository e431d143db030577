#include "rollback.hpp"

#include <stdexcept>
#include <string>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.hpp"

namespace edgespec {

namespace {

// The decision must describe a live path of this tree's placed rows, from the root down.
void check_path(const TokenTree &t, const Decision &d) {
    if (d.path.empty() || d.path[0] != 0) throw std::invalid_argument("decision path must start at the root row 0");
    for (size_t k = 0; k < d.path.size(); ++k) {
        const int32_t r = d.path[k];
        if (r < 0 || r >= t.n_rows())
            throw std::invalid_argument("decision row " + std::to_string(r) + " is not a placed row of this tree");
        if (!t.alive()[r]) throw std::invalid_argument("decision row " + std::to_string(r) + " was pruned");
        if (k > 0 && t.parents()[r] != d.path[k - 1])
            throw std::invalid_argument("decision path is not a chain: row " + std::to_string(r) +
                                        " is not a child of row " + std::to_string(d.path[k - 1]));
        if (k > 0 && k - 1 < d.tokens.size() && d.tokens[k - 1] != t.tokens()[r])
            throw std::invalid_argument("decision token " + std::to_string(d.tokens[k - 1]) + " differs from row " +
                                        std::to_string(r) + "'s token: decision of another tree?");
    }
}

std::vector<int32_t> path_tokens(const TokenTree &t, const std::vector<int32_t> &path) {
    std::vector<int32_t> out;
    for (size_t k = 1; k < path.size(); ++k) out.push_back(t.tokens()[path[k]]);
    return out;
}

}  // namespace

Plan plan_commit(TokenTree &t, const Decision &d) {
    if (d.status != ACCEPTED) throw std::invalid_argument("commit needs an ACCEPTED decision (use prune for PENDING)");
    if (d.bonus < 0) throw std::invalid_argument("an accepted decision needs a bonus token");
    check_path(t, d);
    Plan p;
    const int32_t n = d.path.back();
    const int32_t x = t.any_leaf_seq(n);
    if (x < 0) throw std::logic_error("accepted row has no leaf seq below it");
    const int32_t n_pos = t.root_pos() + t.depths()[n];
    p.ops.push_back({OP_SEQ_CP, x, t.root_pos(), n_pos + 1, 0});
    p.ops.push_back({OP_SEQ_KEEP, 0, -1, -1, 0});
    p.remap.assign(static_cast<size_t>(t.n_rows()), -1);
    p.path = d.path;
    p.tokens = path_tokens(t, d.path);
    p.next_root_token = d.bonus;
    p.next_root_pos = n_pos + 1;
    t.reset(d.bonus, n_pos + 1);
    return p;
}

Plan plan_prune(TokenTree &t, const Decision &d) {
    if (d.status != PENDING) throw std::invalid_argument("prune needs a PENDING decision (use commit for ACCEPTED)");
    if (t.size() != t.n_rows())
        throw std::invalid_argument("prune with pending (unordered) nodes: call order() first or add them after");
    check_path(t, d);
    const int32_t n_rows = t.n_rows();
    std::vector<uint8_t> keep(n_rows, 0);
    for (int32_t r : d.path) keep[r] = 1;
    // Rows are parents-first, so one forward pass marks the whole subtree of the deepest node.
    const int32_t deepest = d.path.back();
    keep[deepest] = 2;  // 1: on the accepted path, 2: in the subtree of its deepest node
    for (int32_t r = deepest + 1; r < n_rows; ++r)
        if (t.alive()[r] && keep[t.parents()[r]] == 2) keep[r] = 2;
    Plan p;
    p.remap.assign(n_rows, -1);
    for (int32_t r = 0; r < n_rows; ++r) {
        if (!t.alive()[r]) continue;
        if (keep[r]) {
            p.remap[r] = static_cast<int32_t>(p.survivors.size());
            p.survivors.push_back(r);
            continue;
        }
        // Every surviving row keeps a surviving leaf seq below it (the deepest accepted node's
        // subtree hangs under the whole path), so whole-seq removal never strands a live row.
        const int32_t s = t.seqs()[r];
        if (s >= 0) {
            p.ops.push_back({OP_SEQ_RM, s, -1, -1, 0});
            t.free_seq(s);
        }
        t.drop(r);
    }
    p.path = d.path;
    p.tokens = path_tokens(t, d.path);
    return p;
}

// ---------------------------------------------------------------------------------------------
// Python bindings

namespace py = pybind11;

namespace {

template <class T>
py::array_t<T> to_array(const std::vector<T> &v) {
    py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), a.mutable_data());
    return a;
}

py::dict plan_dict(const Plan &p) {
    py::array_t<int32_t> ops({static_cast<py::ssize_t>(p.ops.size()), static_cast<py::ssize_t>(5)});
    int32_t *o = ops.mutable_data();
    for (size_t k = 0; k < p.ops.size(); ++k) std::copy(p.ops[k].begin(), p.ops[k].end(), o + 5 * k);
    py::dict d;
    d["ops"] = ops;
    d["survivors"] = to_array(p.survivors);
    d["remap"] = to_array(p.remap);
    d["path"] = to_array(p.path);
    d["tokens"] = to_array(p.tokens);
    d["next_root_token"] = p.next_root_token;
    d["next_root_pos"] = p.next_root_pos;
    return d;
}

}  // namespace

void bind_rollback(py::module_ &m) {
    m.def("plan_commit", [](TokenTree &t, const Decision &d) { return plan_dict(plan_commit(t, d)); },
          py::arg("tree"), py::arg("decision"));
    m.def("plan_prune", [](TokenTree &t, const Decision &d) { return plan_dict(plan_prune(t, d)); },
          py::arg("tree"), py::arg("decision"));
}

}  // namespace edgespec
