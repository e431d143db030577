// Token tree of drafted candidates: best-first selection, descending-score row order, leaf seq
// ids from a bounded pool, and the batch layout of any row range (a FlowSpec segment).
//
// Index spaces: nodes [0, n_rows) are *rows* (placed by order(), stable for the whole lap, even
// after pruning, which only marks them dead); nodes [n_rows, size) are *pending* (added since the
// last order()) and are renumbered by select() and order(), which return the old->new map.
#pragma once
#include <array>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace edgespec {

// KV operations, one row each: (code, seq, p0, p1, arg), the numbering and layout of the wire's
// KV_OPS field and of edgespec.tree.kvop (docs/design.md 1, "KvOp"); p0/p1 = -1: open end.
enum OpKind : int32_t {
    OP_SEQ_RM = 1,    // llama_memory_seq_rm(mem, seq, p0, p1); arg 0
    OP_SEQ_CP = 2,    // llama_memory_seq_cp(mem, src=seq, dst=arg, p0, p1)
    OP_SEQ_KEEP = 3,  // llama_memory_seq_keep(mem, seq); p0 = p1 = -1, arg 0
    OP_SEQ_ADD = 4,   // llama_memory_seq_add(mem, seq, p0, p1, delta=arg) (never planned here)
};
using Op = std::array<int32_t, 5>;

// Result of order(): the renumbering of pending nodes, the rows they now occupy, and the KV ops
// every stage applies before decoding the first of those rows.
struct OrderResult {
    std::vector<int32_t> remap;  // old index -> new index (identity for rows placed earlier)
    int32_t start = 0, stop = 0; // rows placed by this call
    std::vector<Op> ops;         // SEQ_CP ops giving each new leaf seq its prefix
};

class TokenTree {
public:
    static constexpr int32_t kMaxSeqs = 255;  // llama.cpp n_seq_max is 256 with seq 0 committed

    TokenTree(int32_t root_token, int32_t root_pos, int32_t max_seqs = kMaxSeqs);

    // Adds one candidate under `parent`; a duplicate (parent, token) returns the existing node and
    // keeps the larger log-prob (scores of its subtree follow). log-probs must be <= 0.
    int32_t add(int32_t parent, int32_t token, double logprob);

    // Best-first selection among pending nodes: keep at most `budget` non-root pending nodes of
    // highest key (score desc, depth asc, index asc), each only with its parent, never more live
    // leaves than max_seqs. Returns the old->new index map (-1 = dropped).
    std::vector<int32_t> select(int32_t budget);

    // Places the pending nodes as rows in key order and assigns seq ids to new leaves.
    OrderResult order();

    // Rows [start, stop) cut into segments of `size` rows, or into `count` near-equal segments
    // (exactly one of size/count > 0). Returns the boundaries (k+1 values).
    std::vector<int32_t> segment_bounds(int32_t start, int32_t stop, int32_t size,
                                        int32_t count) const;

    // Seq ids of the live leaves below each row: CSR over all rows (offsets[n_rows + 1], flat),
    // ascending seq ids; cached until the rows or seqs change.
    const std::vector<int32_t> &row_seq_offsets() const { ensure_row_seqs(); return rs_off_; }
    const std::vector<int32_t> &row_seq_flat() const { ensure_row_seqs(); return rs_flat_; }

    // Resets to a lone root: the state after a commit.
    void reset(int32_t root_token, int32_t root_pos);

    // Accessors.
    int32_t size() const { return static_cast<int32_t>(parent_.size()); }
    int32_t n_rows() const { return n_rows_; }
    int32_t last_start() const { return last_start_; }
    int32_t root_pos() const { return root_pos_; }
    int32_t max_seqs() const { return max_seqs_; }
    int32_t n_free_seqs() const;
    int32_t n_live_leaves() const;
    const std::vector<int32_t> &parents() const { return parent_; }
    const std::vector<int32_t> &tokens() const { return token_; }
    const std::vector<int32_t> &depths() const { return depth_; }
    const std::vector<double> &logprobs() const { return lp_; }
    const std::vector<double> &scores() const { return score_; }
    const std::vector<int32_t> &seqs() const { return seq_; }
    const std::vector<uint8_t> &alive() const { return alive_; }
    const std::vector<int32_t> &first_child() const { return first_child_; }
    const std::vector<int32_t> &next_sibling() const { return next_sibling_; }

    void check_node(int32_t i, const char *what) const;
    bool is_leaf(int32_t i) const;         // alive and without alive children
    int32_t any_leaf_seq(int32_t i) const; // seq of the lowest-row live leaf below row i
    void free_seq(int32_t s);
    void drop(int32_t i) {  // prune a row: it stays numbered but dead, without a seq
        alive_[i] = 0;
        seq_[i] = -1;
        rs_valid_ = false;
    }

private:
    bool key_less(int32_t a, int32_t b) const;  // a sorts before b
    void rebuild_children();
    void append_child(int32_t parent, int32_t child);
    int32_t alloc_seq();
    void apply_renumber(const std::vector<int32_t> &remap, int32_t new_size);
    void refresh_scores_from(int32_t first);

    int32_t root_pos_ = 0, max_seqs_ = kMaxSeqs, n_rows_ = 0, last_start_ = 0;
    std::vector<int32_t> parent_, token_, depth_, seq_, first_child_, last_child_, next_sibling_;
    std::vector<double> lp_, score_;
    std::vector<uint8_t> alive_;
    std::vector<uint8_t> seq_used_;  // index 1..max_seqs
    void ensure_row_seqs() const;
    mutable std::vector<int32_t> rs_off_, rs_flat_;
    mutable bool rs_valid_ = false;
};

}  // namespace edgespec
