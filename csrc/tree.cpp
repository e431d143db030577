#include "tree.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.hpp"

namespace edgespec {

namespace {
// log-probs a hair above 0 come from float rounding of log-softmax; anything more is a bug.
constexpr double kLogprobSlack = 1e-5;
}  // namespace

TokenTree::TokenTree(int32_t root_token, int32_t root_pos, int32_t max_seqs) {
    if (max_seqs < 1 || max_seqs > kMaxSeqs)
        throw std::invalid_argument("max_seqs must be in [1, 255], got " + std::to_string(max_seqs));
    max_seqs_ = max_seqs;
    reset(root_token, root_pos);
}

void TokenTree::reset(int32_t root_token, int32_t root_pos) {
    if (root_token < 0) throw std::invalid_argument("root token must be >= 0");
    if (root_pos < 0) throw std::invalid_argument("root position must be >= 0");
    root_pos_ = root_pos;
    n_rows_ = 0;
    last_start_ = 0;
    parent_.assign(1, -1);
    token_.assign(1, root_token);
    depth_.assign(1, 0);
    seq_.assign(1, -1);
    first_child_.assign(1, -1);
    last_child_.assign(1, -1);
    next_sibling_.assign(1, -1);
    lp_.assign(1, 0.0);
    score_.assign(1, 0.0);
    alive_.assign(1, 1);
    seq_used_.assign(static_cast<size_t>(max_seqs_) + 1, 0);
    rs_valid_ = false;
}

void TokenTree::check_node(int32_t i, const char *what) const {
    if (i < 0 || i >= size())
        throw std::out_of_range(std::string(what) + " " + std::to_string(i) + " is not a node (tree has " +
                                std::to_string(size()) + ")");
    if (!alive_[i]) throw std::invalid_argument(std::string(what) + " " + std::to_string(i) + " was pruned");
}

void TokenTree::append_child(int32_t parent, int32_t child) {
    if (last_child_[parent] < 0) first_child_[parent] = child;
    else next_sibling_[last_child_[parent]] = child;
    last_child_[parent] = child;
}

void TokenTree::rebuild_children() {
    const int32_t n = size();
    std::fill(first_child_.begin(), first_child_.end(), -1);
    std::fill(last_child_.begin(), last_child_.end(), -1);
    std::fill(next_sibling_.begin(), next_sibling_.end(), -1);
    for (int32_t i = 1; i < n; ++i)
        if (parent_[i] >= 0) append_child(parent_[i], i);
}

void TokenTree::refresh_scores_from(int32_t first) {
    // Indices are topological (a parent always precedes its children), so one forward pass works.
    for (int32_t i = std::max(first, 1); i < size(); ++i) score_[i] = score_[parent_[i]] + lp_[i];
}

int32_t TokenTree::add(int32_t parent, int32_t token, double logprob) {
    check_node(parent, "parent");
    if (token < 0) throw std::invalid_argument("token ids must be >= 0, got " + std::to_string(token));
    if (std::isnan(logprob) || logprob > kLogprobSlack)
        throw std::invalid_argument("draft log-prob must be <= 0, got " + std::to_string(logprob));
    logprob = std::min(logprob, 0.0);
    for (int32_t c = first_child_[parent]; c >= 0; c = next_sibling_[c]) {
        if (token_[c] != token) continue;
        if (!alive_[c])  // the verifier knows that row: a second one would make the choice ambiguous
            throw std::invalid_argument("token " + std::to_string(token) + " under node " + std::to_string(parent) +
                                        " was pruned in this lap; expand under the deepest accepted node");
        if (logprob > lp_[c]) {  // merged duplicate: the better draft evidence wins
            lp_[c] = logprob;
            refresh_scores_from(c);
        }
        return c;
    }
    const int32_t i = size();
    parent_.push_back(parent);
    token_.push_back(token);
    depth_.push_back(depth_[parent] + 1);
    seq_.push_back(-1);
    first_child_.push_back(-1);
    last_child_.push_back(-1);
    next_sibling_.push_back(-1);
    lp_.push_back(logprob);
    score_.push_back(score_[parent] + logprob);
    alive_.push_back(1);
    append_child(parent, i);
    return i;
}

bool TokenTree::key_less(int32_t a, int32_t b) const {
    if (score_[a] != score_[b]) return score_[a] > score_[b];
    if (depth_[a] != depth_[b]) return depth_[a] < depth_[b];
    return a < b;
}

bool TokenTree::is_leaf(int32_t i) const {
    if (!alive_[i]) return false;
    for (int32_t c = first_child_[i]; c >= 0; c = next_sibling_[c])
        if (alive_[c]) return false;
    return true;
}

int32_t TokenTree::n_live_leaves() const {
    int32_t n = 0;
    for (int32_t i = 0; i < size(); ++i) n += is_leaf(i) ? 1 : 0;
    return n;
}

int32_t TokenTree::n_free_seqs() const {
    int32_t n = 0;
    for (int32_t s = 1; s <= max_seqs_; ++s) n += seq_used_[s] ? 0 : 1;
    return n;
}

int32_t TokenTree::alloc_seq() {
    for (int32_t s = 1; s <= max_seqs_; ++s)
        if (!seq_used_[s]) {
            seq_used_[s] = 1;
            return s;
        }
    throw std::runtime_error("seq id pool exhausted");  // order() checks capacity first
}

void TokenTree::free_seq(int32_t s) {
    if (s >= 1 && s <= max_seqs_) seq_used_[s] = 0;
}

int32_t TokenTree::any_leaf_seq(int32_t i) const {
    // Lowest-row live leaf below i (children have larger indices than their parent, so the first
    // leaf met in a preorder walk that always takes the smallest child is not guaranteed lowest:
    // scan the whole subtree).
    int32_t best = -1;
    std::vector<int32_t> stack{i};
    while (!stack.empty()) {
        const int32_t v = stack.back();
        stack.pop_back();
        if (!alive_[v]) continue;
        bool leaf = true;
        for (int32_t c = first_child_[v]; c >= 0; c = next_sibling_[c])
            if (alive_[c]) {
                leaf = false;
                stack.push_back(c);
            }
        if (leaf && seq_[v] >= 0 && (best < 0 || v < best)) best = v;
    }
    return best < 0 ? -1 : seq_[best];
}

void TokenTree::apply_renumber(const std::vector<int32_t> &remap, int32_t new_size) {
    auto move_i = [&](auto &v) {
        using V = std::decay_t<decltype(v)>;
        V out(static_cast<size_t>(new_size));
        for (size_t i = 0; i < remap.size(); ++i)
            if (remap[i] >= 0) out[remap[i]] = v[i];
        v.swap(out);
    };
    move_i(parent_);
    move_i(token_);
    move_i(depth_);
    move_i(seq_);
    move_i(lp_);
    move_i(score_);
    move_i(alive_);
    for (auto &p : parent_)
        if (p >= 0) p = remap[p];
    first_child_.assign(new_size, -1);
    last_child_.assign(new_size, -1);
    next_sibling_.assign(new_size, -1);
    rebuild_children();
}

std::vector<int32_t> TokenTree::select(int32_t budget) {
    if (budget < 0) throw std::invalid_argument("budget must be >= 0");
    const int32_t n = size();
    std::vector<int32_t> pending;
    for (int32_t i = n_rows_; i < n; ++i) pending.push_back(i);
    std::sort(pending.begin(), pending.end(), [&](int32_t a, int32_t b) { return key_less(a, b); });

    std::vector<uint8_t> chosen(n, 0), has_child(n, 0);
    int32_t leaves = 0;
    for (int32_t i = 0; i < n_rows_; ++i)
        if (alive_[i]) {
            chosen[i] = 1;
            if (parent_[i] >= 0) has_child[parent_[i]] = 1;
        }
    for (int32_t i = 0; i < n_rows_; ++i) leaves += (alive_[i] && !has_child[i]) ? 1 : 0;

    int32_t kept = 0;
    for (int32_t v : pending) {
        const int32_t p = parent_[v];
        if (p < 0) {  // a fresh root is always kept and is not part of the budget
            chosen[v] = 1;
            leaves += 1;
            continue;
        }
        if (!chosen[p] || kept >= budget) continue;
        if (has_child[p]) {
            if (leaves + 1 > max_seqs_) continue;  // one more leaf than the seq pool can hold
            leaves += 1;
        }
        chosen[v] = 1;
        has_child[p] = 1;
        ++kept;
    }
    std::vector<int32_t> remap(n, -1);
    int32_t next = 0;
    for (int32_t i = 0; i < n; ++i)
        if (chosen[i] || i < n_rows_) remap[i] = next++;
    if (next != n) apply_renumber(remap, next);
    return remap;
}

OrderResult TokenTree::order() {
    const int32_t n = size();
    const int32_t old_rows = n_rows_;
    OrderResult res;
    res.remap.resize(n);
    for (int32_t i = 0; i < n; ++i) res.remap[i] = i;
    res.start = res.stop = old_rows;
    if (n == old_rows) return res;

    const int32_t leaves_after = n_live_leaves();
    if (leaves_after > max_seqs_)
        throw std::invalid_argument("tree has " + std::to_string(leaves_after) + " leaves but only " +
                                    std::to_string(max_seqs_) +
                                    " seq ids exist; call select() with the budget first");

    std::vector<int32_t> pending;
    for (int32_t i = old_rows; i < n; ++i) pending.push_back(i);
    std::sort(pending.begin(), pending.end(), [&](int32_t a, int32_t b) { return key_less(a, b); });
    for (size_t r = 0; r < pending.size(); ++r) res.remap[pending[r]] = old_rows + static_cast<int32_t>(r);
    apply_renumber(res.remap, n);

    // Seqs held before this call, and for each earlier row the lowest-row live leaf below it: the
    // source of SEQ_CP when a new leaf hangs below an earlier internal row.
    const std::vector<int32_t> seq_before(seq_.begin(), seq_.begin() + old_rows);
    std::vector<int32_t> min_leaf;
    auto lowest_leaf = [&](int32_t a) {
        if (min_leaf.empty()) {
            constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
            min_leaf.assign(old_rows, kNone);
            for (int32_t v = 0; v < old_rows; ++v)
                if (alive_[v] && seq_before[v] >= 0) min_leaf[v] = v;
            for (int32_t v = old_rows - 1; v >= 1; --v)
                if (alive_[v] && parent_[v] >= 0) min_leaf[parent_[v]] = std::min(min_leaf[parent_[v]], min_leaf[v]);
        }
        return min_leaf[a];
    };

    for (int32_t v = old_rows; v < n; ++v) {
        if (first_child_[v] >= 0) continue;  // new nodes are alive: no child means leaf
        int32_t a = v;
        while (a >= old_rows) a = parent_[a];  // nearest earlier row above v (-1: fresh tree)
        int32_t s;
        if (a < 0) {
            s = alloc_seq();
            res.ops.push_back({OP_SEQ_CP, 0, -1, -1, s});
        } else if (seq_[a] >= 0) {  // an earlier leaf hands its seq to its first new leaf
            s = seq_[a];
            seq_[a] = -1;
        } else {
            const int32_t src_row = lowest_leaf(a);
            if (src_row >= old_rows) throw std::logic_error("row without a live leaf below it");
            s = alloc_seq();
            res.ops.push_back({OP_SEQ_CP, seq_before[src_row], -1, root_pos_ + depth_[a] + 1, s});
        }
        seq_[v] = s;
    }
    n_rows_ = n;
    last_start_ = old_rows;
    rs_valid_ = false;
    res.stop = n;
    return res;
}

std::vector<int32_t> TokenTree::segment_bounds(int32_t start, int32_t stop, int32_t size,
                                               int32_t count) const {
    if (start < 0 || stop > n_rows_ || start >= stop)
        throw std::invalid_argument("segment range [" + std::to_string(start) + ", " + std::to_string(stop) +
                                    ") is not a non-empty range of the " + std::to_string(n_rows_) +
                                    " placed rows");
    if ((size > 0) == (count > 0)) throw std::invalid_argument("give exactly one of size > 0 or count > 0");
    const int32_t n = stop - start;
    std::vector<int32_t> b{start};
    if (size > 0) {
        for (int32_t x = start + size; x < stop; x += size) b.push_back(x);
    } else {
        if (count > n)
            throw std::invalid_argument("cannot cut " + std::to_string(n) + " rows into " + std::to_string(count) +
                                        " non-empty segments");
        const int32_t base = n / count, extra = n % count;
        int32_t x = start;
        for (int32_t k = 0; k + 1 < count; ++k) {
            x += base + (k < extra ? 1 : 0);
            b.push_back(x);
        }
    }
    b.push_back(stop);
    return b;
}

void TokenTree::ensure_row_seqs() const {
    if (rs_valid_) return;
    rs_valid_ = true;
    std::vector<int32_t> &offsets = rs_off_, &flat = rs_flat_;
    std::vector<int32_t> owner(static_cast<size_t>(max_seqs_) + 1, -1);
    for (int32_t i = 0; i < n_rows_; ++i)
        if (alive_[i] && seq_[i] >= 0) owner[seq_[i]] = i;
    offsets.assign(static_cast<size_t>(n_rows_) + 1, 0);
    for (int32_t s = 1; s <= max_seqs_; ++s)
        for (int32_t v = owner[s]; v >= 0; v = parent_[v]) ++offsets[v + 1];
    for (int32_t i = 0; i < n_rows_; ++i) offsets[i + 1] += offsets[i];
    flat.assign(offsets[n_rows_], -1);
    std::vector<int32_t> cursor(offsets.begin(), offsets.end() - 1);
    for (int32_t s = 1; s <= max_seqs_; ++s)  // ascending seq ids within each row
        for (int32_t v = owner[s]; v >= 0; v = parent_[v]) flat[cursor[v]++] = s;
}

// ---------------------------------------------------------------------------------------------
// Python bindings

namespace py = pybind11;

namespace {

template <class T>
py::array_t<T> to_array(const std::vector<T> &v, size_t first = 0, size_t last = SIZE_MAX) {
    last = std::min(last, v.size());
    py::array_t<T> a(static_cast<py::ssize_t>(last - first));
    std::copy(v.begin() + first, v.begin() + last, a.mutable_data());
    return a;
}

py::array_t<int32_t> ops_array(const std::vector<Op> &ops) {
    py::array_t<int32_t> a({static_cast<py::ssize_t>(ops.size()), static_cast<py::ssize_t>(5)});
    int32_t *d = a.mutable_data();
    for (size_t k = 0; k < ops.size(); ++k) std::copy(ops[k].begin(), ops[k].end(), d + 5 * k);
    return a;
}

py::array_t<int32_t, py::array::c_style | py::array::forcecast> as_i32(const py::handle &h, const char *what) {
    auto a = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(h);
    if (!a || a.ndim() != 1) throw std::invalid_argument(std::string(what) + " must be a 1-D integer array");
    return a;
}

py::tuple layout(const TokenTree &t, int32_t start, int32_t stop) {
    if (start < 0 || stop > t.n_rows() || start > stop)
        throw std::invalid_argument("layout range [" + std::to_string(start) + ", " + std::to_string(stop) +
                                    ") outside the " + std::to_string(t.n_rows()) + " placed rows");
    const std::vector<int32_t> &off = t.row_seq_offsets(), &flat = t.row_seq_flat();
    const py::ssize_t n = stop - start;
    int32_t width = 1;
    for (int32_t i = start; i < stop; ++i) {
        if (!t.alive()[i]) throw std::invalid_argument("row " + std::to_string(i) + " was pruned");
        width = std::max(width, off[i + 1] - off[i]);
    }
    py::array_t<int32_t> tokens(n), pos(n), nseq(n), parents(n), depths(n);
    py::array_t<int32_t> seqs({n, static_cast<py::ssize_t>(width)});
    int32_t *pt = tokens.mutable_data(), *pp = pos.mutable_data(), *pn = nseq.mutable_data(),
            *pa = parents.mutable_data(), *pd = depths.mutable_data(), *ps = seqs.mutable_data();
    std::fill(ps, ps + n * width, -1);
    for (py::ssize_t r = 0; r < n; ++r) {
        const int32_t i = start + static_cast<int32_t>(r);
        pt[r] = t.tokens()[i];
        pd[r] = t.depths()[i];
        pp[r] = t.root_pos() + pd[r];
        pa[r] = t.parents()[i];
        pn[r] = off[i + 1] - off[i];
        std::copy(flat.begin() + off[i], flat.begin() + off[i + 1], ps + r * width);
    }
    return py::make_tuple(tokens, pos, seqs, nseq, parents, depths);
}

}  // namespace

void bind_tree(py::module_ &m) {
    // The KvOp codes the plans use (edgespec.tree.kvop.KvOpCode checks them at import).
    m.attr("KV_RM") = static_cast<int>(OP_SEQ_RM);
    m.attr("KV_CP") = static_cast<int>(OP_SEQ_CP);
    m.attr("KV_KEEP") = static_cast<int>(OP_SEQ_KEEP);
    m.attr("MAX_SEQS") = TokenTree::kMaxSeqs;

    py::class_<TokenTree>(m, "TokenTree")
        .def(py::init<int32_t, int32_t, int32_t>(), py::arg("root_token"), py::arg("root_pos"),
             py::arg("max_seqs") = TokenTree::kMaxSeqs)
        .def("add", &TokenTree::add, py::arg("parent"), py::arg("token"), py::arg("logprob"))
        .def(
            "add_nodes",
            [](TokenTree &t, py::handle parents, py::handle tokens, py::handle logprobs) {
                auto p = as_i32(parents, "parents");
                auto k = as_i32(tokens, "tokens");
                auto lp = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(logprobs);
                if (!lp || lp.ndim() != 1) throw std::invalid_argument("logprobs must be a 1-D float array");
                const py::ssize_t n = p.shape(0);
                if (k.shape(0) != n || lp.shape(0) != n)
                    throw std::invalid_argument("parents, tokens and logprobs differ in length");
                py::array_t<int32_t> out(n);
                int32_t *o = out.mutable_data();
                const int32_t *pp = p.data(), *pk = k.data();
                const double *pl = lp.data();
                for (py::ssize_t j = 0; j < n; ++j) {
                    int32_t par = pp[j];
                    if (par < 0) {  // -(j'+1): the node made by entry j' of this call
                        const py::ssize_t ref = -static_cast<py::ssize_t>(par) - 1;
                        if (ref >= j) throw std::invalid_argument("parent reference to a later entry");
                        par = o[ref];
                    }
                    o[j] = t.add(par, pk[j], pl[j]);
                }
                return out;
            },
            py::arg("parents"), py::arg("tokens"), py::arg("logprobs"))
        .def("select", [](TokenTree &t, int32_t b) { return to_array(t.select(b)); }, py::arg("budget"))
        .def("_order",
             [](TokenTree &t) {
                 OrderResult r = t.order();
                 return py::make_tuple(to_array(r.remap), r.start, r.stop, ops_array(r.ops));
             })
        .def(
            "_segment_bounds",
            [](const TokenTree &t, int32_t start, int32_t stop, int32_t size, int32_t count) {
                return to_array(t.segment_bounds(start, stop, size, count));
            },
            py::arg("start"), py::arg("stop"), py::arg("size") = 0, py::arg("count") = 0)
        .def("_layout", &layout, py::arg("start"), py::arg("stop"))
        .def("reset", &TokenTree::reset, py::arg("root_token"), py::arg("root_pos"))
        .def("score", [](const TokenTree &t, int32_t i) { t.check_node(i, "node"); return t.scores()[i]; })
        .def_property_readonly("size", &TokenTree::size)
        .def_property_readonly("n_rows", &TokenTree::n_rows)
        .def_property_readonly("last_start", &TokenTree::last_start)
        .def_property_readonly("root_pos", &TokenTree::root_pos)
        .def_property_readonly("root_token", [](const TokenTree &t) { return t.tokens()[0]; })
        .def_property_readonly("max_seqs", &TokenTree::max_seqs)
        .def_property_readonly("n_free_seqs", &TokenTree::n_free_seqs)
        .def_property_readonly("n_live_leaves", &TokenTree::n_live_leaves)
        .def("tokens", [](const TokenTree &t) { return to_array(t.tokens()); })
        .def("parents", [](const TokenTree &t) { return to_array(t.parents()); })
        .def("depths", [](const TokenTree &t) { return to_array(t.depths()); })
        .def("scores", [](const TokenTree &t) { return to_array(t.scores()); })
        .def("logprobs", [](const TokenTree &t) { return to_array(t.logprobs()); })
        .def("seqs", [](const TokenTree &t) { return to_array(t.seqs()); })
        .def("alive", [](const TokenTree &t) {
            py::array_t<bool> a(t.size());
            std::copy(t.alive().begin(), t.alive().end(), a.mutable_data());
            return a;
        });
}

}  // namespace edgespec
