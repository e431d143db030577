// KV rollback plans after a verification decision: the llama_memory_* operations every stage
// applies, the rows that survive (to drop in-flight rows of rejected nodes) and their re-indexing.
#pragma once
#include <cstdint>
#include <vector>

#include "tree.hpp"
#include "verify.hpp"

namespace edgespec {

struct Plan {
    std::vector<Op> ops;              // apply in order, before decoding any later row
    std::vector<int32_t> survivors;   // rows still alive, ascending (empty after a commit)
    std::vector<int32_t> remap;       // old row -> index among survivors (-1: rejected)
    std::vector<int32_t> path;        // accepted rows, root first
    std::vector<int32_t> tokens;      // accepted draft tokens (tokens of path[1:])
    int32_t next_root_token = -1;     // commit: the bonus token, root of the next tree
    int32_t next_root_pos = -1;
};

// ACCEPTED decision: copy the accepted path into seq 0, drop every leaf seq, reset the tree to the
// bonus token as its new root.
Plan plan_commit(TokenTree &tree, const Decision &d);

// PENDING decision (FlowSpec): keep the accepted path and the subtree under its deepest node,
// remove the seqs of every other leaf, mark those rows dead (row numbers stay stable in a lap).
Plan plan_prune(TokenTree &tree, const Decision &d);

}  // namespace edgespec
