// plan.h: an algorithm as data. A plan says, for every rank, which ops it runs, in order,
// on each slice of a message; one engine (csrc/host/host_plan.cpp) runs any plan, and the
// checker (ringcoll/plans.py) proves a plan's postcondition before it runs. A learner's
// walk through: docs/algorithms.md.
//
// The message (one slice of it, ring_loop.h's sense) is cut into C chunks, as ring.h cuts
// it into P (chunk_begin(n, C, c)). An op computes one value per chunk of a range and
// writes it somewhere:
//
//     value = b == kNone ? a : a OP b        (OP the call's reduction; a first, as the
//                                             ring's reduce(received partial, own copy))
//
// where a and b each come from one of
//     kPeer    the publication of rank `from` that this op receives (see matching below)
//     kInput   the caller's input (all-gather: only this rank's own chunk; broadcast: the
//              root's only)
//     kOutput  the caller's output (reduce-scatter: only this rank's own chunk; reduce:
//              the root's only, the others' tensors stay as they were)
//     kWork    this rank's private work space (C chunks: one slice of the whole message)
//     kPeerInput  rank `from`'s input, read where it lies, not through any slot: every rank
//              posts where its input is when the call starts, and none returns before every
//              rank has finished reading (all-gather: chunk `from` only; broadcast: the
//              root's; reduce-scatter: any chunk but `from`'s own, which in place is its
//              output; all-reduce: a chunk `from` overwrites with its output only after it
//              has heard, through publications, that the read is done; never a reduce's: the
//              checker proves a read in place cannot race the owner's writes)
// and the value goes to any two of
//     kToOutput, kToWork, kToSlot (this rank's slots, published at once to `readers`).
// An op that writes its output alone may publish the chunks it writes where they lie
// (to = kToOutput | kShareOutput): its readers' receives read them out of this rank's output,
// as kPeerInput reads an input, and no slot is filled; the rank never writes those chunks
// again in the call (the checker proves it), and no rank returns before every rank has
// finished reading (the handshake kPeerInput uses). Where a reader cannot reach that output
// (CUDA: a peer in another process, an output not in symmetric memory) the publication goes
// through a slot instead, as kToSlot, on every rank alike (device_plan.h); the checker proves
// the plan both ways.
//
// The ring, for instance, is per rank: one op "publish my input's chunk k-1 to my right
// neighbour" (a = kInput, to = kToSlot), then for each step one op "receive chunk c from my
// left neighbour, reduce it with my input's chunk c (b = kInput), and publish the result to
// my right neighbour", the last reduce-scatter step writing kToOutput instead, and so on
// (ring_plan below). One-shot, recursive halving-doubling, recursive doubling and a
// binomial tree are other op lists over the same records.
//
// Matching. A publication is read by each of its readers exactly once, and the receives of
// rank j from rank k read k's publications that list j as a reader, in the order k makes
// them (first in, first out, per connection). compile_plan resolves each receive to the
// number of the publication it reads and checks that the two name the same chunks.
//
// Roots. A rooted collective's plan (broadcast, reduce) is written for root 0; for root r
// compile_plan relabels it, rank k doing what rank (k - r) mod P does for root 0 (MPI's
// "relative rank"), so one plan serves every root.
//
// Slots. Each rank's buffer holds kBanks x C slots, slot (bank, c) for chunk c; a
// publication of chunks [first, first + count) fills slots first .. first+count-1 of the
// slice's bank. Before a rank overwrites a slot, every reader of the publication that last
// filled it must have read it (the engine waits for that).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ringcoll/check.h"
#include "ringcoll/collectives.h"
#include "ringcoll/ring.h"

namespace ringcoll {

// The most ranks a plan may address: readers are a bitmask of one word.
constexpr int kMaxPlanWorld = 64;

enum class Operand : uint8_t { kNone = 0, kPeer = 1, kInput = 2, kOutput = 3, kWork = 4, kPeerInput = 5 };
constexpr uint8_t kToOutput = 1, kToWork = 2, kToSlot = 4;
constexpr uint8_t kShareOutput = 8;  // with kToOutput: published to `readers` where it lies, not in a slot

constexpr int kMaxPlanChunks = 32767;  // PlanOp's chunk fields are 16 bits

struct PlanOp {
  Operand a = Operand::kNone;
  Operand b = Operand::kNone;  // kNone: the value is a (a copy)
  int16_t from = -1;           // with an operand kPeer: the rank whose publication is read
  int16_t first = 0;           // the chunks [first, first + count), at most kMaxPlanChunks
  int16_t count = 0;
  uint8_t to = 0;              // kToOutput | kToWork | kToSlot, at most two of them (| kShareOutput)
  bool final = false;          // the value is the chunks' result (AVG divides here)
  uint64_t readers = 0;        // with kToSlot or kShareOutput: the ranks that read the publication (bit r)
};

// Every rank's ops, and the chunk count; what a generator makes and compile_plan checks.
struct Plan {
  int chunks = 0;
  std::vector<std::vector<PlanOp>> ops;  // ops[rank]
  // Each rank's leading sends (ops that only publish its input) may run before the call
  // check, where the call is one slice: a small call then meets its peers once, not twice
  // (the one-shot's). Their price is a wait, before the check, for the readers of what the
  // rank last published in the bank they fill (one-slice calls take the banks in turn),
  // which where a call has many steps costs more than it saves.
  bool sends_early = false;
};

// A plan resolved for running, per rank: for each receive, the number (1, 2, ...) of the
// publication it reads among the sender's publications of one slice; and every rank's
// publications per slice, so each rank can number any peer's publications.
struct CompiledPlan {
  Plan plan;                                        // relabelled for `root`
  int root = 0;                                     // a rooted collective's root (0 for the others)
  uint32_t id = 0;                                  // the algorithm id its calls' descriptors carry
                                                    // (collectives.h's code, or a user plan's hash),
                                                    // so ranks running different plans mismatch
  std::vector<std::vector<int>> publication_read;  // [rank][op]: 0 if the op receives nothing
  std::vector<int> publications;                    // [rank]: publications per slice
  std::vector<std::vector<int>> last_read;          // [rank][op]: 1 if it is this rank's last read of
                                                    // its sender's publication
  std::vector<std::vector<int>> reads_shared;       // [rank][op]: 1 if the publication it receives lies
                                                    // in the sender's output (kShareOutput)
  bool reads_in_place = false;                      // some op reads a peer's memory where it lies: an
                                                    // input (kPeerInput) or a shared output
  std::vector<int> early_sends;                     // [rank]: its leading ops that run before the
                                                    // call check (0 unless plan.sends_early)
  uint64_t inputs_read = 0;                         // bit r: some rank's ops read rank r's input (kPeerInput)
  uint64_t outputs_read = 0;                        // bit r: some rank receives what rank r shares in its output
  std::vector<int> last_in_place_read_op;           // [rank]: its last op that reads a peer's memory where
                                                    // it lies (-1: none), after which, in the last slice,
                                                    // it tells its peers it is done reading theirs
  bool uses_work = false;                           // some op reads or writes the work space
  // CUDA only: the plan run instead where an input or output this one reads in place is
  // out of some rank's reach, as every rank finds alike from the posts (device_plan.h); its
  // id travels in the descriptor too. Null: out of reach is an error. (plan_with_fallback)
  std::shared_ptr<const CompiledPlan> fallback;
};

// `primary` (a plan that reads peers' inputs where they lie) with `fallback` (one that goes
// through the slots, cutting the message into as many chunks) to run where it cannot: what
// auto runs on CUDA over symmetric memory. Throws std::invalid_argument naming what differs.
inline CompiledPlan plan_with_fallback(const CompiledPlan& primary, const CompiledPlan& fallback) {
  RINGCOLL_CHECK(primary.reads_in_place && !fallback.reads_in_place && fallback.fallback == nullptr,
                 std::invalid_argument, "plan_with_fallback: the primary plan must read peers' memory where it "
                 "lies and the fallback must not");
  RINGCOLL_CHECK(primary.plan.chunks == fallback.plan.chunks && primary.root == fallback.root &&
                     primary.plan.ops.size() == fallback.plan.ops.size(),
                 std::invalid_argument, "plan_with_fallback: the two plans must cut the message alike (", primary.plan.chunks,
                 " and ", fallback.plan.chunks, " chunks) for the same ranks and root");
  CompiledPlan both = primary;
  both.fallback = std::make_shared<const CompiledPlan>(fallback);
  return both;
}

// Whether a plan fills slots (a plan of direct reads fills none, nor one whose every
// publication is a shared output).
inline bool fills_slots(const CompiledPlan& plan) {
  for (const auto& ops : plan.plan.ops)
    for (const PlanOp& op : ops)
      if (op.to & kToSlot) return true;
  return false;
}

RINGCOLL_INLINE bool names_a_peer(Operand o) { return o == Operand::kPeer || o == Operand::kPeerInput; }

RINGCOLL_INLINE bool has_bit(uint64_t mask, int r) { return (mask >> r) & 1u; }
RINGCOLL_INLINE uint64_t bit(int r) { return uint64_t{1} << r; }
RINGCOLL_INLINE uint64_t all_ranks(int world) { return world == kMaxPlanWorld ? ~uint64_t{0} : bit(world) - 1; }

// A plan for root 0 relabelled for root `root`: rank k runs rank (k - root) mod P's ops,
// with every peer it names moved on by `root` too.
inline Plan rooted_plan(const Plan& plan, int root) {
  const int world = static_cast<int>(plan.ops.size());
  auto moved = [&](int rank) { return (rank + root) % world; };
  Plan out;
  out.chunks = plan.chunks;
  out.sends_early = plan.sends_early;
  out.ops.resize(world);
  for (int k = 0; k < world; ++k) {
    for (PlanOp op : plan.ops[k]) {
      if (op.from >= 0) op.from = static_cast<int16_t>(moved(op.from));
      uint64_t readers = 0;
      for (int r = 0; r < world; ++r)
        if (has_bit(op.readers, r)) readers |= bit(moved(r));
      op.readers = readers;
      out.ops[moved(k)].push_back(op);
    }
  }
  return out;
}

// Resolve and check a plan's structure (not its result: that is the Python checker's, and
// every generator's test's), relabelled for `root` (a rooted collective's; 0 leaves it as it
// is); `id` is what its calls' descriptors will carry. Throws std::invalid_argument naming
// the first bad op.
inline CompiledPlan compile_plan(Plan plan, const std::string& name, int world, uint32_t id, int root = 0) {
  auto where = [&](int rank, size_t i) {
    return name + ": rank " + std::to_string(rank) + ", op " + std::to_string(i) + ": ";
  };
  RINGCOLL_CHECK(world >= 1 && world <= kMaxPlanWorld, std::invalid_argument, name, ": plans run on 1 to ",
                 kMaxPlanWorld, " ranks, not ", world);
  RINGCOLL_CHECK(static_cast<int>(plan.ops.size()) == world, std::invalid_argument, name, ": ", plan.ops.size(),
                 " op lists for ", world, " ranks");
  RINGCOLL_CHECK(plan.chunks >= 1 && plan.chunks <= kMaxPlanChunks, std::invalid_argument, name, ": ", plan.chunks,
                 " chunks; a plan cuts a slice into 1 to ", kMaxPlanChunks,
                 " chunks (an op's chunk range is held in 16 bits)");
  RINGCOLL_CHECK(root >= 0 && root < world, std::invalid_argument, name, ": root ", root, " is not a rank of ",
                 world);
  CompiledPlan out;
  out.root = root;
  out.id = id;
  if (root != 0) plan = rooted_plan(plan, root);
  out.publications.assign(world, 0);
  out.last_in_place_read_op.assign(world, -1);
  out.early_sends.assign(world, 0);
  // sent[k][j]: the (publication number, first, count) of k's publications that j reads, in order
  struct Sent { int number, first, count; bool shared; };
  std::vector<std::vector<std::vector<Sent>>> sent(world, std::vector<std::vector<Sent>>(world));
  for (int k = 0; k < world; ++k) {
    for (size_t i = 0; i < plan.ops[k].size(); ++i) {
      const PlanOp& op = plan.ops[k][i];
      RINGCOLL_CHECK(op.count >= 1 && op.first >= 0 && op.first + op.count <= plan.chunks, std::invalid_argument,
                     where(k, i), "chunks [", op.first, ", ", op.first + op.count, ") are not within 0..",
                     plan.chunks);
      RINGCOLL_CHECK(op.a != Operand::kNone, std::invalid_argument, where(k, i), "has no first operand");
      const int targets = (op.to & kToOutput ? 1 : 0) + (op.to & kToWork ? 1 : 0) + (op.to & kToSlot ? 1 : 0);
      RINGCOLL_CHECK(targets >= 1 && targets <= 2 && (op.to & ~(kToOutput | kToWork | kToSlot | kShareOutput)) == 0,
                     std::invalid_argument, where(k, i), "writes to ", targets, " places: one or two of output, "
                     "work, slot");
      RINGCOLL_CHECK(!(op.to & kShareOutput) || op.to == (kToOutput | kShareOutput), std::invalid_argument,
                     where(k, i), "shares its output chunks where they lie, so must write the output and nothing else");
      RINGCOLL_CHECK(static_cast<int>(op.a) <= static_cast<int>(Operand::kPeerInput) &&
                         static_cast<int>(op.b) <= static_cast<int>(Operand::kPeerInput),
                     std::invalid_argument, where(k, i), "has an operand of no known kind");
      const bool peer = names_a_peer(op.a) || names_a_peer(op.b);
      RINGCOLL_CHECK(!(names_a_peer(op.a) && names_a_peer(op.b)), std::invalid_argument, where(k, i),
                     "reads two peers' values (a publication or an input) in one op");
      out.uses_work = out.uses_work || op.a == Operand::kWork || op.b == Operand::kWork || (op.to & kToWork) != 0;
      RINGCOLL_CHECK(!peer || (op.from >= 0 && op.from < world && op.from != k), std::invalid_argument,
                     where(k, i), "reads from rank ", op.from, ", not a peer");
      if (op.a == Operand::kPeerInput || op.b == Operand::kPeerInput) {
        out.reads_in_place = true;
        out.last_in_place_read_op[k] = static_cast<int>(i);
        out.inputs_read |= bit(op.from);
      }
      if (op.to & (kToSlot | kShareOutput)) {
        const uint64_t everyone = all_ranks(world);
        RINGCOLL_CHECK(op.readers != 0 && (op.readers & ~everyone) == 0 && !has_bit(op.readers, k),
                       std::invalid_argument, where(k, i), "publishes to no peer, or to itself or a rank beyond ",
                       world - 1);
        const int number = ++out.publications[k];
        for (int j = 0; j < world; ++j)
          if (has_bit(op.readers, j))
            sent[k][j].push_back(Sent{number, op.first, op.count, (op.to & kShareOutput) != 0});
      } else {
        RINGCOLL_CHECK(op.readers == 0, std::invalid_argument, where(k, i), "names readers but publishes nothing");
      }
    }
  }
  // The leading ops that read nothing but the input and write nothing but a publication.
  for (int k = 0; k < world && plan.sends_early; ++k)
    for (const PlanOp& op : plan.ops[k]) {
      if (op.a != Operand::kInput || op.b != Operand::kNone || op.to != kToSlot) break;
      ++out.early_sends[k];
    }
  out.publication_read.resize(world);
  out.last_read.resize(world);
  out.reads_shared.resize(world);
  for (int j = 0; j < world; ++j) {
    std::vector<size_t> next(world, 0);  // per sender: its next publication to j
    out.publication_read[j].assign(plan.ops[j].size(), 0);
    out.last_read[j].assign(plan.ops[j].size(), 0);
    out.reads_shared[j].assign(plan.ops[j].size(), 0);
    for (size_t i = 0; i < plan.ops[j].size(); ++i) {
      const PlanOp& op = plan.ops[j][i];
      if (op.a != Operand::kPeer && op.b != Operand::kPeer) continue;
      const int k = op.from;
      RINGCOLL_CHECK(next[k] < sent[k][j].size(), std::invalid_argument, where(j, i), "receives from rank ", k,
                     " more often than rank ", k, " publishes to it (", sent[k][j].size(), " times)");
      const Sent& s = sent[k][j][next[k]++];
      RINGCOLL_CHECK(s.first == op.first && s.count == op.count, std::invalid_argument, where(j, i),
                     "receives chunks [", op.first, ", ", op.first + op.count, ") from rank ", k,
                     ", whose publication it reads holds [", s.first, ", ", s.first + s.count, ")");
      out.publication_read[j][i] = s.number;
      if (s.shared) {  // read where it lies, in rank k's output
        out.reads_shared[j][i] = 1;
        out.reads_in_place = true;
        out.outputs_read |= bit(k);
        out.last_in_place_read_op[j] = std::max(out.last_in_place_read_op[j], static_cast<int>(i));
      }
      out.last_read[j][i] = 1;  // one receive per publication: each read is the last
    }
    for (int k = 0; k < world; ++k)
      RINGCOLL_CHECK(next[k] == sent[k][j].size(), std::invalid_argument, name, ": rank ", k, " publishes to rank ",
                     j, " ", sent[k][j].size(), " times, which receives ", next[k], " of them");
  }
  out.plan = std::move(plan);
  return out;
}

// Throws std::invalid_argument, naming `op`, unless `plan` can run `coll` on `world` ranks:
// one op list per rank, and one chunk per rank where the input (all-gather) or the output
// (reduce-scatter) is one rank's chunk. Every engine checks it before anything moves.
inline void check_plan_fits(const CompiledPlan& plan, Collective coll, int world, const char* op) {
  RINGCOLL_CHECK(static_cast<int>(plan.plan.ops.size()) == world, std::invalid_argument, op, ": a plan for ",
                 plan.plan.ops.size(), " ranks on a communicator of ", world);
  const bool chunk_per_rank = coll == Collective::kReduceScatter || coll == Collective::kAllGather;
  RINGCOLL_CHECK(!chunk_per_rank || plan.plan.chunks == world, std::invalid_argument, op, ": a plan of ",
                 plan.plan.chunks, " chunks; ", op, " needs one per rank (", world, ")");
}

// --- the built-in plans ------------------------------------------------------------------
//
// Each generator returns every rank's ops for `coll` on `world` ranks (the algorithms'
// list: RINGCOLL_ALGORITHMS in collectives.h).

// An op, spelled short for the generators below: value = a [OP b] over chunks [first,
// first + count), to `to` (published to `readers` with kToSlot).
inline PlanOp make_op(Operand a, int first, int count, uint8_t to, Operand b = Operand::kNone, int from = -1,
                      uint64_t readers = 0, bool final = false) {
  PlanOp op;
  op.a = a;
  op.b = b;
  op.from = static_cast<int16_t>(from);
  op.first = static_cast<int16_t>(first);
  op.count = static_cast<int16_t>(count);
  op.to = to;
  op.final = final;
  op.readers = readers;
  return op;
}

// The ring (ring.h): C = P chunks. Reduce-scatter: publish the input's chunk k-1 to the
// right, then P-1 times receive chunk k-s-2 from the left and reduce it with the input's
// copy, passing it on (the last one, chunk k, to the output). All-gather: the own chunk
// to the output and to the right, then P-1 times receive a chunk and copy it to the
// output, passing it on but the last. All-reduce: the two, the first all-gather send being
// the last reduce-scatter result.
constexpr int kChainChunks = 16;  // the chain's pipeline depth, at least (chain_plan, measured there)
inline Plan chain_plan(Collective coll, int world);

inline Plan ring_plan(Collective coll, int world) {
  if (collective_info(coll).rooted) return chain_plan(coll, world);
  Plan plan;
  plan.chunks = world;
  plan.ops.resize(world);
  if (world == 1) return plan;
  for (int k = 0; k < world; ++k) {
    const uint64_t right = bit(right_neighbour(k, world));
    const bool gather = coll == Collective::kAllGather;
    auto& ops = plan.ops[k];
    ops.push_back(make_op(Operand::kInput, first_send_chunk(coll, k, world), 1, kToSlot | (gather ? kToOutput : 0),
                          Operand::kNone, -1, right, gather));
    for (int s = 0; s < ring_steps(coll, world); ++s) {
      const bool final = step_writes_output(coll, s, world), forwards = step_forwards(coll, s, world);
      ops.push_back(make_op(Operand::kPeer, step_recv_chunk(coll, k, s, world), 1,
                            (final ? kToOutput : 0) | (forwards ? kToSlot : 0),
                            step_reduces(coll, s, world) ? Operand::kInput : Operand::kNone,
                            left_neighbour(k, world), forwards ? right : 0, final));
    }
  }
  return plan;
}

// The rooted collectives' ring (root 0): a chain, the ring with the link into the root cut.
// Broadcast: rank 0 publishes each chunk of its input to rank 1; rank k receives each from
// rank k-1, copies it to its output and passes it on to rank k+1 (the last keeps it).
// Reduce: the other way, rank P-1 publishes its input to rank P-2; rank k receives each
// chunk's partial from rank k+1, adds its own (received first, as the ring's reduce) and
// passes it on; rank 0 finishes it into its output: ((x[P-1] OP x[P-2]) ...) OP x[0].
// C = max(P, kChainChunks) chunks: a rank passes chunk c on while its predecessor sends
// chunk c+1, so the P-1 links work at once, and the deeper the pipeline the sooner the
// last rank starts (P = 2, 1 MiB broadcast: 103 us with C = 2, 80 with 8, 71 with 16).
inline Plan chain_plan(Collective coll, int world) {
  Plan plan;
  plan.chunks = world < kChainChunks ? kChainChunks : world;
  plan.ops.resize(world);
  if (world == 1) return plan;
  const bool down = coll == Collective::kBroadcast;  // from rank 0 to P-1; reduce: from P-1 to 0
  for (int k = 0; k < world; ++k) {
    const int from = down ? k - 1 : k + 1, to = down ? k + 1 : k - 1;  // -1 or world: no such rank
    const bool first = from < 0 || from == world, last = to < 0 || to == world;
    for (int c = 0; c < plan.chunks; ++c) {
      auto& ops = plan.ops[k];
      if (first)  // the chain's head publishes its input
        ops.push_back(make_op(Operand::kInput, c, 1, kToSlot, Operand::kNone, -1, bit(to)));
      else if (down)  // broadcast: to my output, and on unless I am the tail
        ops.push_back(make_op(Operand::kPeer, c, 1, kToOutput | (last ? 0 : kToSlot), Operand::kNone, from,
                              last ? 0 : bit(to)));
      else  // reduce: add mine; the tail (rank 0) finishes it into its output
        ops.push_back(make_op(Operand::kPeer, c, 1, last ? kToOutput : kToSlot, Operand::kInput, from,
                              last ? 0 : bit(to), last));
    }
  }
  return plan;
}

// The broadcast's star (root 0): the root publishes each of its input's C = kChainChunks
// chunks once, to every peer, and each peer copies each chunk to its output as it lands.
// Shared memory is no chain of links: one publication is read by every rank at once, so
// the P-1 copies run side by side, where the chain copies the message into and out of
// each of its P-2 middle ranks in turn (P = 4, 256 KiB to 4 MiB: 1.2-1.6x the chain's
// speed, two cores oversubscribed; bench/results/2026-12-04-rooted.txt). At P = 2 it is
// the chain. A reduce has no star: the root would do all P-1 additions (as a registered
// plan at P = 4, 1.1-1.6x slower than the chain from 256 KiB). oneshot's broadcast is its
// one-chunk form, for small messages.
inline Plan star_plan(Collective coll, int world, int chunks = kChainChunks) {
  (void)coll;  // broadcast only (RINGCOLL_ALGORITHMS)
  Plan plan;
  plan.chunks = chunks;
  plan.ops.resize(world);
  if (world == 1) return plan;
  for (int c = 0; c < plan.chunks; ++c) {
    plan.ops[0].push_back(make_op(Operand::kInput, c, 1, kToSlot, Operand::kNone, -1, all_ranks(world) & ~bit(0)));
    for (int k = 1; k < world; ++k)
      plan.ops[k].push_back(make_op(Operand::kPeer, c, 1, kToOutput, Operand::kNone, 0));
  }
  return plan;
}

// One step for small messages (the CPU transport's small-message path): every rank
// publishes each chunk of its input to every peer, then folds each chunk itself, in the
// order the ring reduces it (rs_contributor: the ring's bits); all-gather publishes its
// own chunk and copies every peer's. C = P chunks. The rooted collectives (root 0), C = 1:
// broadcast, the star of one chunk (the root publishes its input to every peer, which
// copies it); reduce, every other rank publishes its input to the root, which folds them
// in the chain's order (chain_plan: the same bits as the chain).
inline Plan one_shot_plan(Collective coll, int world) {
  Plan plan;
  if (coll == Collective::kBroadcast) {
    plan = star_plan(coll, world, 1);
    plan.sends_early = true;
    return plan;
  }
  plan.chunks = collective_info(coll).rooted ? 1 : world;
  plan.sends_early = true;  // one step: its publications go before the call check
  plan.ops.resize(world);
  if (world == 1) return plan;
  const uint64_t everyone = all_ranks(world);
  if (coll == Collective::kReduce) {  // the root: ((x[P-1] OP x[P-2]) ... OP x[1]) OP x[0]
    for (int k = 1; k < world; ++k)
      plan.ops[k].push_back(make_op(Operand::kInput, 0, 1, kToSlot, Operand::kNone, -1, bit(0)));
    auto& ops = plan.ops[0];
    if (world == 2) {
      ops.push_back(make_op(Operand::kPeer, 0, 1, kToOutput, Operand::kInput, 1, 0, true));
      return plan;
    }
    ops.push_back(make_op(Operand::kPeer, 0, 1, kToWork, Operand::kNone, world - 1));
    for (int r = world - 2; r >= 1; --r) ops.push_back(make_op(Operand::kWork, 0, 1, kToWork, Operand::kPeer, r));
    ops.push_back(make_op(Operand::kWork, 0, 1, kToOutput, Operand::kInput, -1, 0, true));
    return plan;
  }
  for (int k = 0; k < world; ++k) {
    auto& ops = plan.ops[k];
    if (coll == Collective::kAllGather) {  // publish my chunk (early: to the slot only), copy every peer's
      ops.push_back(make_op(Operand::kInput, k, 1, kToSlot, Operand::kNone, -1, everyone & ~bit(k)));
      for (int c = 0; c < world; ++c)
        ops.push_back(c == k ? make_op(Operand::kInput, c, 1, kToOutput, Operand::kNone, -1, 0, true)
                             : make_op(Operand::kPeer, c, 1, kToOutput, Operand::kNone, c, 0, true));
      continue;
    }
    const bool scatter = coll == Collective::kReduceScatter;
    for (int c = 0; c < world; ++c)  // reduce-scatter: chunk c to its owner only, mine stays here
      if (!(scatter && c == k))
        ops.push_back(make_op(Operand::kInput, c, 1, kToSlot, Operand::kNone, -1,
                              scatter ? bit(c) : everyone & ~bit(k)));
    for (int c = scatter ? k : 0; c < (scatter ? k + 1 : world); ++c) {
      // Fold chunk c in the ring's order: ((x_0 OP x_1) OP x_2) ... with x_i the input of
      // rank rs_contributor(c, i). Where mine is x_0 or x_1, the first two take one op (at
      // P = 2 the whole fold does).
      auto x = [&](int i) { return rs_contributor(c, i, world); };
      auto operand = [&](int i) { return x(i) == k ? Operand::kInput : Operand::kPeer; };
      auto to = [&](int i) { return i + 1 == world ? kToOutput : kToWork; };
      int i = 1;
      if (x(0) == k || x(1) == k) {
        const int peer = x(0) == k ? x(1) : x(0);
        ops.push_back(make_op(operand(0), c, 1, to(1), operand(1), peer, 0, world == 2));
        i = 2;
      } else {
        ops.push_back(make_op(Operand::kPeer, c, 1, kToWork, Operand::kNone, x(0)));
      }
      for (; i < world; ++i)
        ops.push_back(make_op(Operand::kWork, c, 1, to(i), operand(i), x(i) == k ? -1 : x(i), 0, i + 1 == world));
    }
  }
  return plan;
}

// Powers of two below a world that is not one: the recursive algorithms pair ranks 2i and
// 2i+1 for i < extra (extra = P - 2^floor(log2 P)); the even one of each pair takes part
// for both, so 2^floor(log2 P) "participants" remain, numbered v = 0, 1, ... in rank order.
struct Participants {
  int world, count, extra;
  explicit Participants(int p) : world(p), count(1), extra(0) {
    while (count * 2 <= p) count *= 2;
    extra = p - count;
  }
  bool takes_part(int rank) const { return rank >= 2 * extra || rank % 2 == 0; }
  bool stands_in(int rank) const { return rank < 2 * extra && rank % 2 == 0; }  // for rank + 1 too
  int index(int rank) const { return rank < 2 * extra ? rank / 2 : rank - extra; }  // v of a participant
  int rank_of(int v) const { return v < extra ? 2 * v : v + extra; }
  // The chunks participant v answers for, one per rank it stands for: [first, first + width).
  int first(int v) const { return v < extra ? 2 * v : v + extra; }
  int width(int v) const { return v < extra ? 2 : 1; }
  // Chunks [first(lo), first(lo + n)) of participants lo .. lo+n-1: contiguous, in rank order.
  int span_first(int lo) const { return first(lo); }
  int span_count(int lo, int n) const { return (lo + n < count ? first(lo + n) : world) - first(lo); }
};

// Recursive halving reduce-scatter, then (all-reduce) recursive doubling all-gather
// (Rabenseifner's): log2 steps each, every rank sending (P-1)/P n per phase, as the ring,
// but in log2 P steps instead of P-1. C = P chunks.
//   halving   step s = 0, 1, ..: partner v ^ d (d = count/2, count/4, ..); keep the half of
//             the range that holds my own chunks, send the other half (my partial of it),
//             receive the partner's partial of mine and add it: partner's first, mine second.
//   doubling  step s = 0, 1, ..: partner v ^ d (d = 1, 2, ..); send the range I hold (final
//             values), receive the partner's into the output: the range doubles.
// Ranks that do not take part (P not a power of two) hand their input to the even rank of
// their pair first and get the result back at the end. The all-reduce cuts the message in
// one chunk per participant (C = 2^floor(log2 P)), so every halving step sends half of what
// it holds and a rank standing in sends and receives 2 (C-1)/C n + n, the textbook fold (one
// chunk per rank sent up to a third more at P = 6); the reduce-scatter and all-gather keep
// one chunk per rank, their outputs' layout, a participant standing in answering for two.
inline Plan halving_doubling_plan(Collective coll, int world) {
  Plan plan;
  plan.ops.resize(world);
  const Participants parts(world);
  const bool by_participant = coll == Collective::kAllReduce;
  plan.chunks = by_participant ? parts.count : world;
  if (world == 1) return plan;
  const int all = plan.chunks;
  auto span_first = [&](int lo) { return by_participant ? lo : parts.span_first(lo); };
  auto span_count = [&](int lo, int n) { return by_participant ? n : parts.span_count(lo, n); };
  const bool reduces = coll != Collective::kAllGather;
  for (int k = 0; k < world; ++k) {
    auto& ops = plan.ops[k];
    if (!parts.takes_part(k)) {  // rank 2i+1 of a pair: hand over, get back
      const int host = k - 1;
      if (reduces) ops.push_back(make_op(Operand::kInput, 0, all, kToSlot, Operand::kNone, -1, bit(host)));
      else ops.push_back(make_op(Operand::kInput, k, 1, kToSlot | kToOutput, Operand::kNone, -1, bit(host), true));
      if (coll == Collective::kReduceScatter)
        ops.push_back(make_op(Operand::kPeer, k, 1, kToOutput, Operand::kNone, host));
      else
        ops.push_back(make_op(Operand::kPeer, 0, all, kToOutput, Operand::kNone, host));
      continue;
    }
    const int v = parts.index(k);
    Operand mine = Operand::kInput;  // where my partials are: the input until the first add
    if (parts.stands_in(k)) {        // take my pair's contribution in first
      if (reduces) {
        ops.push_back(make_op(Operand::kPeer, 0, all, kToWork, Operand::kInput, k + 1));
        mine = Operand::kWork;
      } else {
        ops.push_back(make_op(Operand::kInput, k, 1, kToOutput, Operand::kNone, -1, 0, true));
        ops.push_back(make_op(Operand::kPeer, k + 1, 1, kToOutput, Operand::kNone, k + 1));
      }
    }
    int lo = 0, n = parts.count;  // the participants whose chunks this rank still answers for
    if (reduces) {
      for (int d = parts.count / 2; d >= 1; d /= 2) {
        const int partner = v ^ d;
        const int keep_lo = (v & d) ? lo + d : lo, send_lo = (v & d) ? lo : lo + d;
        const bool last = d == 1;
        ops.push_back(make_op(mine, span_first(send_lo), span_count(send_lo, d), kToSlot, Operand::kNone,
                              -1, bit(parts.rank_of(partner))));
        // The last add completes my chunks: to the output for all-reduce and for my own chunk,
        // to work where it goes on to a pair's rank
        const bool own_out = last && (coll == Collective::kAllReduce || !parts.stands_in(k));
        const uint8_t to = own_out ? kToOutput : kToWork;
        ops.push_back(make_op(Operand::kPeer, span_first(keep_lo), span_count(keep_lo, d), to, mine,
                              parts.rank_of(partner), 0, last));
        mine = Operand::kWork;
        lo = keep_lo;
        n = d;
      }
      if (coll == Collective::kReduceScatter) {
        if (parts.stands_in(k)) {  // both chunks finished in work: mine to the output, my pair's to it
          ops.push_back(make_op(Operand::kWork, k, 1, kToOutput));
          ops.push_back(make_op(Operand::kWork, k + 1, 1, kToSlot, Operand::kNone, -1, bit(k + 1)));
        }
        continue;
      }
    } else {
      lo = v;
      n = 1;
    }
    // all-gather (of all-reduce's results, or of the inputs): my range doubles each step
    for (int d = 1; d < parts.count; d *= 2) {
      const int partner = v ^ d;
      const int theirs = lo ^ d;  // the partner's range starts there (ranges are aligned to d)
      const bool first_send = !reduces && d == 1 && !parts.stands_in(k);
      ops.push_back(make_op(first_send ? Operand::kInput : Operand::kOutput, span_first(lo),
                            span_count(lo, n), kToSlot | (first_send ? kToOutput : 0), Operand::kNone, -1,
                            bit(parts.rank_of(partner)), first_send));
      ops.push_back(make_op(Operand::kPeer, span_first(theirs), span_count(theirs, n), kToOutput,
                            Operand::kNone, parts.rank_of(partner)));
      lo = lo < theirs ? lo : theirs;
      n *= 2;
    }
    if (parts.stands_in(k))  // the whole result to my pair
      ops.push_back(make_op(Operand::kOutput, 0, all, kToSlot, Operand::kNone, -1, bit(k + 1)));
  }
  return plan;
}

// Recursive doubling all-reduce, for small messages: log2 P steps, each an exchange of the
// whole message with partner v ^ d (d = 1, 2, ..), both adding the lower rank's value first
// so both hold the same bits. C = 1 chunk. Pairs as in halving_doubling_plan.
inline Plan recursive_doubling_plan(Collective coll, int world) {
  RINGCOLL_CHECK(coll == Collective::kAllReduce, std::invalid_argument,
                 "rd (recursive doubling) is an all-reduce; for ", collective_info(coll).name, " use rhd");
  Plan plan;
  plan.chunks = 1;
  plan.ops.resize(world);
  if (world == 1) return plan;
  const Participants parts(world);
  for (int k = 0; k < world; ++k) {
    auto& ops = plan.ops[k];
    if (!parts.takes_part(k)) {
      ops.push_back(make_op(Operand::kInput, 0, 1, kToSlot, Operand::kNone, -1, bit(k - 1)));
      ops.push_back(make_op(Operand::kPeer, 0, 1, kToOutput, Operand::kNone, k - 1));
      continue;
    }
    Operand mine = Operand::kInput;
    if (parts.stands_in(k)) {
      ops.push_back(make_op(Operand::kInput, 0, 1, kToWork, Operand::kPeer, k + 1));  // mine first: lower rank
      mine = Operand::kWork;
    }
    const int v = parts.index(k);
    for (int d = 1; d < parts.count; d *= 2) {
      const int partner = parts.rank_of(v ^ d);
      const bool last = 2 * d >= parts.count;
      ops.push_back(make_op(mine, 0, 1, kToSlot, Operand::kNone, -1, bit(partner)));
      const bool lower = k < partner;
      ops.push_back(make_op(lower ? mine : Operand::kPeer, 0, 1, last ? kToOutput : kToWork,
                            lower ? Operand::kPeer : mine, partner, 0, last));
      mine = Operand::kWork;
    }
    if (parts.stands_in(k)) ops.push_back(make_op(Operand::kOutput, 0, 1, kToSlot, Operand::kNone, -1, bit(k + 1)));
  }
  return plan;
}

// A binomial tree rooted at rank 0: rank k's parent is k minus its lowest set bit; its
// children k + 1, k + 2, k + 4, .. below that bit (nearest first). log2 P levels.
struct BinomialTree {
  int world;
  int parent(int k) const { return k - (k & -k); }
  std::vector<int> children(int k) const {
    const int low = k == 0 ? world : (k & -k);
    std::vector<int> out;
    for (int d = 1; d < low && k + d < world; d *= 2) out.push_back(k + d);
    return out;
  }
  uint64_t children_mask(int k) const {
    uint64_t mask = 0;
    for (int child : children(k)) mask |= bit(child);
    return mask;
  }
};

// Rank k's ops of a reduce up the tree (C = 1 chunk): add each child's partial to mine
// (mine first), nearest child first, then send the sum up; the root finishes it into its
// output.
inline void tree_reduce_ops(std::vector<PlanOp>& ops, const BinomialTree& tree, int k) {
  const std::vector<int> children = tree.children(k);
  const uint64_t parent = k == 0 ? 0 : bit(tree.parent(k));
  if (children.empty()) {  // a leaf: its input is its partial
    ops.push_back(make_op(Operand::kInput, 0, 1, kToSlot, Operand::kNone, -1, parent));
    return;
  }
  Operand mine = Operand::kInput;
  for (size_t i = 0; i < children.size(); ++i) {
    const bool last = i + 1 == children.size();
    const uint8_t to = !last ? kToWork : (k == 0 ? kToOutput : kToSlot);
    ops.push_back(make_op(mine, 0, 1, to, Operand::kPeer, children[i], last ? parent : 0, last && k == 0));
    mine = Operand::kWork;
  }
}

// Rank k's ops of a broadcast down the tree (C = 1 chunk): the root publishes `source` to
// its children; every other rank receives from its parent, copying to its output and on to
// its children in one op.
inline void tree_broadcast_ops(std::vector<PlanOp>& ops, const BinomialTree& tree, int k, Operand source) {
  const uint64_t children = tree.children_mask(k);
  if (k == 0)
    ops.push_back(make_op(source, 0, 1, kToSlot, Operand::kNone, -1, children));
  else
    ops.push_back(make_op(Operand::kPeer, 0, 1, kToOutput | (children ? kToSlot : 0), Operand::kNone,
                          tree.parent(k), children));
}

// The binomial tree. All-reduce: reduce to rank 0, then broadcast from it: log2 P steps
// each way; each rank sends n up and n down: fewer steps than the ring, more bytes (the
// root's link carries log2 P messages). Broadcast and reduce (root 0): one half each. The
// whole message is one chunk: C = 1.
inline Plan tree_plan(Collective coll, int world) {
  RINGCOLL_CHECK(coll == Collective::kAllReduce || collective_info(coll).rooted, std::invalid_argument,
                 "tree has no ", collective_info(coll).name, "; use ring or rhd");
  Plan plan;
  plan.chunks = 1;
  plan.ops.resize(world);
  if (world == 1) return plan;
  const BinomialTree tree{world};
  for (int k = 0; k < world; ++k) {
    if (coll != Collective::kBroadcast) tree_reduce_ops(plan.ops[k], tree, k);
    if (coll != Collective::kReduce)
      tree_broadcast_ops(plan.ops[k], tree, k, coll == Collective::kBroadcast ? Operand::kInput : Operand::kOutput);
  }
  return plan;
}

// Direct reads: no slot at all. All-gather: rank k copies each peer's input straight into
// its output, starting at its right neighbour (k+1, k+2, ..: at each turn every input is
// read by one rank), then its own chunk, while the peers may still be reading it.
// Broadcast (root 0): every other rank copies the root's tensor into its own. One copy per
// byte a rank receives, where the slots make two (the owner's into a slot, the reader's
// out of it); the price is two handshakes (the posts at the start, "finished reading" at
// the end) and a transport that can read a peer's memory (process_vm_readv on the CPU).
// Reduce-scatter: rank k folds chunk k of every peer's input where it lies, in the ring's
// order (rank k+1's first, its own last: the ring's bits), through its work space; no rank
// reads a peer's own chunk, which in place is the peer's output. One read per byte of the
// fold, where the slots add a write and a read per step.
// All-reduce (vLLM's and SymmetricMemory's "two-shot"): that fold, its result written to the
// output and shared there with every peer (kShareOutput), then each peer's reduced chunk
// copied out of that peer's output: one copy per byte received, where a slot makes two (a
// 16 MiB all-reduce in place at P = 2: 2.2 -> 1.8 ms, docs/algorithms.md). In place a rank
// overwrites chunk j of its input only with rank j's publication, which rank j makes once it
// has read chunk j of every input: the checker proves such orders.
// C = P chunks, 1 for a broadcast.
inline Plan direct_plan(Collective coll, int world) {
  Plan plan;
  plan.chunks = coll == Collective::kBroadcast ? 1 : world;
  plan.ops.resize(world);
  if (world == 1) return plan;
  for (int k = 0; k < world; ++k) {
    auto& ops = plan.ops[k];
    if (coll == Collective::kBroadcast) {
      if (k != 0) ops.push_back(make_op(Operand::kPeerInput, 0, 1, kToOutput, Operand::kNone, 0, 0, true));
      continue;
    }
    if (coll == Collective::kReduceScatter || coll == Collective::kAllReduce) {
      // The fold of chunk k; an all-reduce shares its result, in its output, with every peer
      const bool all = coll == Collective::kAllReduce;
      const uint8_t to = all ? kToOutput | kShareOutput : kToOutput;
      const uint64_t readers = all ? all_ranks(world) & ~bit(k) : 0;
      const int first = (k + 1) % world;  // rs_contributor's order: rank k+1 first, k last
      if (world == 2) {
        ops.push_back(make_op(Operand::kPeerInput, k, 1, to, Operand::kInput, first, readers, true));
      } else {
        ops.push_back(make_op(Operand::kPeerInput, k, 1, kToWork, Operand::kNone, first));
        for (int i = 2; i < world; ++i)
          ops.push_back(make_op(Operand::kWork, k, 1, kToWork, Operand::kPeerInput, (k + i) % world));
        ops.push_back(make_op(Operand::kWork, k, 1, to, Operand::kInput, -1, readers, true));
      }
      for (int i = 1; all && i < world; ++i) {  // then every peer's reduced chunk, from its output
        const int peer = (k + i) % world;
        ops.push_back(make_op(Operand::kPeer, peer, 1, kToOutput, Operand::kNone, peer));
      }
      continue;
    }
    for (int i = 1; i < world; ++i) {
      const int peer = (k + i) % world;
      ops.push_back(make_op(Operand::kPeerInput, peer, 1, kToOutput, Operand::kNone, peer, 0, true));
    }
    ops.push_back(make_op(Operand::kInput, k, 1, kToOutput, Operand::kNone, -1, 0, true));
  }
  return plan;
}

// Whether the built-in `algorithm` has a plan for `coll` (the algorithms' table).
inline bool algorithm_has(Algorithm algorithm, Collective coll) {
  switch (algorithm) {
#define RINGCOLL_ALGORITHM_HAS(e, name, code, collectives) \
  case Algorithm::e: return ((collectives) & collective_bit(coll)) != 0;
    RINGCOLL_ALGORITHMS(RINGCOLL_ALGORITHM_HAS)
#undef RINGCOLL_ALGORITHM_HAS
  }
  return false;
}

inline Plan builtin_plan(Algorithm algorithm, Collective coll, int world) {
  RINGCOLL_CHECK(algorithm_has(algorithm, coll), std::invalid_argument, algorithm_name(static_cast<int>(algorithm)),
                 " has no ", collective_info(coll).name);
  switch (algorithm) {
    case Algorithm::kRing: return ring_plan(coll, world);
    case Algorithm::kOneShot: return one_shot_plan(coll, world);
    case Algorithm::kHalvingDoubling: return halving_doubling_plan(coll, world);
    case Algorithm::kRecursiveDoubling: return recursive_doubling_plan(coll, world);
    case Algorithm::kTree: return tree_plan(coll, world);
    case Algorithm::kStar: return star_plan(coll, world);
    case Algorithm::kDirect: return direct_plan(coll, world);
  }
  throw std::invalid_argument("unknown algorithm");
}

}  // namespace ringcoll
