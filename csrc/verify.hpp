// Lossless verification of a token tree with token ids only (SpecExec / FlowSpec rule): at a node,
// draw the target's token x; descend into the child holding x, else emit x as the bonus token.
//
// Reproducibility contract (tests/ref_core.py implements the same, bit for bit):
// * The token at sequence position p is drawn with u(seed, p) = splitmix64 output number p+1 of the
//   stream seeded with `seed`, as a double in [0, 1) (top 53 bits). Keying draws by position makes
//   the output identical to plain sampling with the same seed, whatever the draft tree was.
// * temperature == 0: argmax (lowest id among equal maxima; NaN never wins).
// * Otherwise (NaN logits are an error): over all ids in ascending id order, w_i = exp((l_i - lmax) / T),
//   S = sum w, pick the first id with cumulative w > u * S (else the last id with w > 0). All in double.
//   Truncation (top-k, typical-p, top-p, min-p) is the sampler chain's, before the draw
//   (src/edgespec/node/sampler.py): a token it dropped comes here with logit -inf and weighs 0.
#pragma once
#include <cstdint>
#include <vector>

namespace edgespec {

struct SamplerConfig {
    double temperature = 0.0;  // 0 = greedy
    uint64_t seed = 0;
    void validate() const;
};

double uniform_at(uint64_t seed, int64_t pos);
int32_t argmax_row(const float *row, int64_t n);
// Target token for the position `pos` (the position of the token being drawn).
int32_t sample_row(const float *row, int64_t n, const SamplerConfig &cfg, int64_t pos);

enum Status : int32_t { ACCEPTED = 0, PENDING = 1 };

struct Decision {
    int32_t status = PENDING;
    std::vector<int32_t> path{0};   // rows from the root; the last one is the deepest accepted node
    std::vector<int32_t> tokens;    // accepted draft tokens (tokens of path[1:])
    int32_t bonus = -1;             // ACCEPTED: the target's token after the path
    int32_t need_row = 0;           // PENDING: the row whose logits are needed next (path.back())
    int32_t n_processed = 0;        // rows whose logits were fed so far
};

// One lap of step-wise verification over a tree structure given as rows (tokens, parents;
// parents-first, row 0 the root). Rows arrive in order, segment by segment.
class Verification {
public:
    Verification(const SamplerConfig &cfg, int32_t root_pos, const int32_t *tokens, const int32_t *parents,
                 int32_t n);
    void extend(const int32_t *tokens, const int32_t *parents, int32_t n, int32_t start);
    // logits: `rows` rows of `vocab` floats, row r at logits + r * row_stride. They belong to tree
    // rows start, start+1, ... or, when `ids` is given, to rows ids[0] < ids[1] < ... (>= start):
    // stages drop the rows of pruned nodes. Rows below `start` not fed before are skipped; a skipped
    // row on the accepted path is an error.
    const Decision &feed_logits(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride,
                                int32_t start, const int32_t *ids = nullptr);
    // targets: the target's token already drawn at each row (argmax_rows / sample_rows).
    const Decision &feed_targets(const int32_t *targets, int64_t rows, int32_t start,
                                 const int32_t *ids = nullptr);
    const Decision &decision() const { return dec_; }
    int32_t n_known() const { return static_cast<int32_t>(parent_.size()); }
    int32_t root_pos() const { return root_pos_; }
    const SamplerConfig &config() const { return cfg_; }

private:
    void begin_feed(int64_t rows, int32_t start, const int32_t *ids);
    int32_t child_with(int32_t node, int32_t token) const;
    template <class Target>
    void walk(int32_t start, int64_t rows, const int32_t *ids, Target target);

    SamplerConfig cfg_;
    int32_t root_pos_;
    std::vector<int32_t> token_, parent_, depth_, first_child_, last_child_, next_sibling_;
    Decision dec_;
};

}  // namespace edgespec
