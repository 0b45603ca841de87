// kernel_abi.h: what the host side of the CUDA transport and the ring kernels agree on.
// The layout of each rank's IPC allocation, the launch parameters, the plan of launches for
// one collective, and the error records a kernel leaves when it gives up, with their
// translation into the message the host raises. No CUDA types: cuda_comm.cu (nvcc), the
// bindings and the CPU emulation of the kernels (csrc/emulation/, g++) all include it.
//
// Per-rank IPC allocation (one cudaMalloc, one handle):
//
//   [ flag area, kFlagAreaBytes: per block b < kMaxBlocks published, consumed; aborted;
//                       the call descriptor; hello; finished[r] for r < kMaxWorld; the
//                       placement of the data in the slots, one word per call parity;
//                       then the plans' words: per block b, plan_published and
//                       consumed_from[r] for r < kMaxWorld; the input post (where this
//                       rank's input and output lie for a plan that reads peers' memory
//                       where it lies); per block b, inputs_read
//                       (128-byte lines; docs/flags.md says who writes and reads each word) ]
//   [ data area: kBanks x P slots of slot_bytes each (call.h); a plan of C chunks cuts
//                the same bytes into kBanks x C slots (plan_slot_bytes)              ]
//
// Block b of rank k talks only to block b of ranks k-1 and k+1 (its own tiles of every
// chunk), so blocks never wait for each other. A plan's block b talks to block b of any
// peer the plan names (device_plan.h), with flags of its own. A fused launch has fused_blocks() blocks:
// sized from the message and the device (its SM count), so it changes between calls; the
// kernel then drains the ring before any slot changes hands (device_ring.h). The
// bookkeeping (step base, the last publication of every slot, see ring_loop.h) is one
// record in a private device array that persists between launches, like HostComm's
// members: every block computes the same values, and the last block to finish writes them.
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ringcoll/call.h"
#include "ringcoll/descriptor.h"
#include "ringcoll/flags.h"
#include "ringcoll/plan.h"
#include "ringcoll/ring_loop.h"
#include "ringcoll/strip.h"
#include "ringcoll/symmetric_heap.h"

namespace ringcoll::cuda {

// The most blocks a fused launch may have: the flag area, the error records and the
// bookkeeping are sized for it. A block per SM is the most a launch uses (fused_blocks),
// and GPUs today have fewer SMs than this (H100/H200: 132, B200: 148); a device with more
// runs with kMaxBlocks (CudaComm's constructor).
constexpr int kMaxBlocks = 256;
constexpr int kMaxWorld = 16;          // per-thread copy of the slot bookkeeping is sized for it
constexpr size_t kFlagStride = 128;    // one flag per 128-byte line
constexpr size_t kAbortedOffset = 2 * kMaxBlocks * kFlagStride;
constexpr size_t kDescriptorOffset = kAbortedOffset + kFlagStride;
constexpr size_t kHelloOffset = kDescriptorOffset + kFlagStride;
constexpr uint64_t kHelloMagic = 0x72696e67636f6c6cULL;  // "ringcoll"; the word holds magic ^ rank
constexpr size_t kFinishedOffset = kHelloOffset + kFlagStride;
constexpr size_t kPlacementOffset = kFinishedOffset + kFlagStride;
// The plan engine's words (device_plan.h): per block, the number of this rank's latest plan
// publication, and a line of kMaxWorld words, consumed_from[k] = the number of rank k's
// latest plan publication this rank has read (flow control per connection).
constexpr size_t kPlanPublishedOffset = kPlacementOffset + kFlagStride;
constexpr size_t kConsumedFromOffset = kPlanPublishedOffset + kMaxBlocks * kFlagStride;
// A plan that reads peers' memory where it lies (Operand::kPeerInput, kShareOutput;
// device_plan.h): the owner posts where its input and output lie for its n-th such call
// (InputPost, `number` = n stored last), and its block b says in inputs_read[b] = n that it
// has read all it reads of every peer's input and output.
constexpr size_t kInputPostOffset = kConsumedFromOffset + kMaxBlocks * kFlagStride;
constexpr size_t kInputsReadOffset = kInputPostOffset + kFlagStride;
constexpr size_t kFlagAreaBytes = (kInputsReadOffset + kMaxBlocks * kFlagStride + 4095) / 4096 * 4096;  // 164 KiB
// Where an input lies is said one of two ways. In symmetric memory (the owner's segment of
// arena a, every peer having mapped it: CudaComm::open_symmetric_arena): `arena` = a and
// `address` its offset there, which each reader adds to its own mapping of that segment
// (SymmetricTable), the only form a peer in another process can use. Anywhere else:
// `arena` = kPlainAddress and `address` the device pointer, usable only by peers that are
// threads of the owner's process (the in-process mode).
constexpr int64_t kPlainAddress = -1;
struct InputPost {
  uint64_t address;     // the device pointer (kPlainAddress), or the offset in the owner's segment of `arena`
  int64_t arena;        // the symmetric arena the input lies in, or kPlainAddress
  uint64_t output_address;  // the same two for its output (what it shares there: kShareOutput)
  int64_t output_arena;
  CallDescriptor call;  // the owner's call, compared whole (its count, dtype, collective and root
                        // size the input), so no rank reads past a peer's input, checked or not
  uint64_t number;      // the owner's n-th call of such a plan (stored last, with release)
};
static_assert(sizeof(InputPost) <= kFlagStride, "the input post must fit its line");
inline size_t finished_word_offset(int rank) { return kFinishedOffset + sizeof(uint64_t) * static_cast<size_t>(rank); }
static_assert(kMaxWorld * sizeof(uint64_t) <= kFlagStride, "the finished and consumed_from words must fit a line");
// A slice is the whole slot: every rank slices every call the same way, whatever its
// pointers. Data sits in a slot at the offset modulo 16 of the user memory it comes from or
// goes to (device_ring.h: slot_in), so 16-byte vectors stay possible for misaligned user
// pointers; what of a full slice would pass the slot's end at such an offset (under 16
// bytes, the scalar tail) wraps round to the slot's start, which that offset leaves free.
// (A 16-byte slack kept free at the end of every slot instead cost a power-of-two message
// an extra slice of a few bytes per chunk; reserving it only for misaligned pointers would
// need the ranks to agree on a slicing their pointers cannot tell them: issue 22.)
RINGCOLL_INLINE int64_t slice_elems_for(int64_t slot_bytes, int elem_size) { return slot_bytes / elem_size; }
constexpr size_t kSlotAlignment = 128;  // a GPU cache line (and a multiple of 16: slices keep their offset)
// The bookkeeping record: [0] step base, [1..] last publication per slot,
// [kPlanBaseWord] the plans' numbering (the last plan publication number of every rank),
// [kPlanGridWord] blocks of the last plan launch whose publications may still be unread (0:
// none), [kPlanUnreadWord + r] per peer r: the latest of them r reads, [kInputPostsWord]
// the calls whose plans read peers' inputs (each posted its input: InputPost), [kFallbacksWord]
// how many of those ran their fallback plan instead (for tests),
// [kPlacementsWord] the offsets of the last launch that moved data (placement_signature),
// [kDataCallWord] calls that moved data (its parity picks the placement word), [kGridWord]
// blocks of the last ring launch that moved data, [kBlocksDoneWord] blocks of the running launch
// that have finished, [kCallWord] calls checked so far. The call number lives on the device,
// not the host, so a collective captured in a CUDA graph gets a new number at every replay.
constexpr int kStateWords = 3 * kMaxWorld + 10;
constexpr int kPlanBaseWord = kBanks * kMaxWorld + 1;
constexpr int kPlanGridWord = kPlanBaseWord + 1;
constexpr int kPlanUnreadWord = kPlanGridWord + 1;
constexpr int kInputPostsWord = kPlanUnreadWord + kMaxWorld;  // calls that posted their input (InputPost)
constexpr int kFallbacksWord = kInputPostsWord + 1;  // of those, the calls that ran their fallback plan
constexpr int kPlacementsWord = kStateWords - 5;
constexpr int kDataCallWord = kStateWords - 4;
constexpr int kGridWord = kStateWords - 3;
constexpr int kBlocksDoneWord = kStateWords - 2;
constexpr int kCallWord = kStateWords - 1;
static_assert(kFallbacksWord < kPlacementsWord, "bookkeeping must fit its words");

// Where a rank puts each chunk in its slots during a call, in one word: the offset modulo
// 16 (bytes) of chunk c, for c < world, in bits 4c..4c+3 (kMaxWorld chunks of 4 bits fill
// 64). `placement` is the offset of the rank's user pointer (device_ring.h), the chunk
// begins are the call's (ring.h), so ranks differ only through their pointers. A block owns
// the bytes of a slot by the tiles of the elements placed there, so when this changes
// between calls, bytes change owner, as when the grid changes: the kernel drains first.
RINGCOLL_INLINE uint64_t placement_signature(int placement, int64_t ring_count, int world, int elem_size) {
  uint64_t signature = 0;
  for (int c = 0; c < world; ++c) {
    const int64_t offset = (placement + chunk_begin(ring_count, world, c) * elem_size) % kVectorBytes;
    signature |= static_cast<uint64_t>(offset) << (4 * c);
  }
  return signature;
}
static_assert(kMaxWorld * 4 <= 64 && kVectorBytes == 16, "a chunk's offset takes 4 bits of the signature");
static_assert(kDescriptorOffset + sizeof(DescriptorSlot) <= kHelloOffset, "the descriptor must fit its line");
static_assert(kFlagAreaBytes % kSlotAlignment == 0, "slots start aligned after the flag area");

// Blocks of a fused launch: one per tile (strip.h) of the longest slice a ring step moves,
// at most `max_blocks` (max_blocks_for). A block with no tile would only pass
// flags on; more than one block per SM would only share that SM's bandwidth. Every rank
// must launch the same number (block b talks to block b): ranks agree on max_blocks when
// they connect, and matching calls have the same count.
RINGCOLL_INLINE int fused_blocks(int64_t ring_count, int world, int64_t slice_elems, int elem_size, int max_blocks) {
  const int64_t longest = max_chunk_length(ring_count, world);
  const int64_t tiles = tile_count(longest < slice_elems ? longest : slice_elems, elem_size);
  return static_cast<int>(tiles < 1 ? 1 : tiles < max_blocks ? tiles : max_blocks);
}

// RINGCOLL_CUDA_FLAG_SCOPE: which scope the data flags take. kAuto (the default): the
// narrowest correct one (flag_scope_for). kSystem: .sys always, for a ring of processes
// sharing one GPU, where .gpu is what the hardware needs (all the threads run on that GPU)
// but the PTX memory model does not spell out that it orders grids of different processes;
// `system` trades the cheaper L2-level ordering for certainty. There is no `device`: forced
// where a peer runs on another GPU it would leave that peer's data unordered, and where
// every rank shares this GPU `auto` already chooses it.
enum class FlagScopeSetting : int32_t { kAuto = 0, kSystem = 1 };
constexpr const char* kFlagScopeVariable = "RINGCOLL_CUDA_FLAG_SCOPE";

inline const char* flag_scope_setting_name(FlagScopeSetting setting) {
  return setting == FlagScopeSetting::kSystem ? "system" : "auto";
}

// The setting a value of RINGCOLL_CUDA_FLAG_SCOPE names (null or empty: unset, so kAuto;
// trimmed, any case, as RINGCOLL_CUDA_KERNEL is read). Throws std::invalid_argument naming
// the variable and the values it takes.
inline FlagScopeSetting parse_flag_scope_setting(const char* value) {
  std::string text = value == nullptr ? "" : value;
  const size_t first = text.find_first_not_of(" \t\n\r");
  text = first == std::string::npos ? "" : text.substr(first, text.find_last_not_of(" \t\n\r") - first + 1);
  std::string lower;
  for (char ch : text) lower += static_cast<char>(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
  if (lower.empty() || lower == "auto") return FlagScopeSetting::kAuto;
  if (lower == "system") return FlagScopeSetting::kSystem;
  throw std::invalid_argument(std::string("Communicator: ") + kFlagScopeVariable + "='" + text +
                              "'; expected one of auto (the default: .gpu where every rank runs on this GPU, "
                              "else .sys), system (.sys always)");
}

// Every rank's setting (`settings[r]`, from its handle) must be the same: a ring whose ranks
// mixed .sys and .gpu flags would still pair each release with an acquire whose scope
// covers its thread (the mix arises only where every rank shares one GPU), so it would be
// exactly as sound as `auto`, but not what `system` was set for: every flag at .sys. So,
// like RINGCOLL_CUDA_KERNEL, a difference is an error, raised on every rank (each sees every
// handle). Throws std::invalid_argument naming each rank's value.
inline void check_flag_scope_settings(const std::vector<FlagScopeSetting>& settings) {
  bool same = true;
  for (FlagScopeSetting s : settings) same = same && s == settings.front();
  if (same) return;
  std::ostringstream msg;
  msg << "Communicator: " << kFlagScopeVariable << " differs between ranks: ";
  for (size_t r = 0; r < settings.size(); ++r)
    msg << (r ? ", " : "") << "rank " << r << ": " << flag_scope_setting_name(settings[r]);
  throw std::invalid_argument(msg.str());
}

// The scope the data flags use: device scope when every rank's GPU is this one
// (`same_device[r]`: rank r runs on it) and the setting is kAuto, else system scope (flags.h).
inline FlagScope flag_scope_for(const std::vector<bool>& same_device,
                                FlagScopeSetting setting = FlagScopeSetting::kAuto) {
  if (setting == FlagScopeSetting::kSystem) return FlagScope::kSystem;
  for (bool same : same_device)
    if (!same) return FlagScope::kSystem;
  return FlagScope::kDevice;
}

// The default buffer_bytes of a CUDA communicator of `world` ranks (ringcoll/communicator.py
// uses it when neither buffer_bytes= nor RINGCOLL_BUFFER_BYTES says otherwise): a slot of a
// tile for each of the most blocks a launch may have, so a message of a slot per chunk or
// more gets the whole grid max_blocks_for allows, on any GPU the flag area supports, the
// ranks sharing a GPU or not (16 MiB x world). The same on every rank: the world alone decides.
inline size_t default_buffer_bytes(int world) {
  return static_cast<size_t>(kBanks) * static_cast<size_t>(world < 1 ? 1 : world) * kMaxBlocks *
         static_cast<size_t>(kTileBytes);
}
static_assert(kMaxBlocks * kTileBytes % kSlotAlignment == 0, "the default slot is whole lines");

// The most blocks each rank launches: a block per SM of the smallest GPU (`sm_count`),
// shared among the ranks that run on one GPU (`ranks_per_gpu`, the most on any). Every
// block of every rank must be resident at once: a block spins on its neighbours' block of
// the same number, so a block left waiting for an SM that spinning blocks hold would never
// run. A 512-thread block (launch bounds: at most 128 registers a thread) always fits an
// SM, but more than one may not (ptxas: about 100 registers, docs/cuda.md), so one per SM.
inline int max_blocks_for(int sm_count, int ranks_per_gpu = 1) {
  const int share = sm_count / (ranks_per_gpu < 1 ? 1 : ranks_per_gpu);
  return share < 1 ? 1 : share < kMaxBlocks ? share : kMaxBlocks;
}

enum class KernelVariant : int {
  kFused = 0,  // fused_blocks() blocks, 16-byte vectors, one launch per collective
  kNaive = 1,  // one block, scalar loops, one launch per ring step: the teaching version
};

// Why a rank gave up: the value of its `aborted` flag, and the kind of its error record.
enum class AbortCause : int32_t {
  kNone = 0,
  kTimedOut = 1,    // a wait outlasted the communicator's timeout
  kMismatch = 2,    // its call differs from its left neighbour's
  kPeerAborted = 3, // (records only) a neighbour gave up; `cause` says why that one did
  kClosed = 4,      // (flag only) the rank closed its communicator after its last call
  kPeerLeft = 5,    // (flag only) a neighbour it was waiting for had closed: passed on like a timeout
  kNotSymmetric = 6,  // a plan reads peers' inputs, and a rank's input is where some peer cannot reach it
                      // (an output out of reach is no error: its shared chunks go through slots)
};

// What a neighbour's `aborted` value says, for messages.
inline const char* abort_cause_text(int32_t cause) {
  switch (static_cast<AbortCause>(cause)) {
    case AbortCause::kMismatch: return "abandoned the call: ranks made mismatched calls";
    case AbortCause::kClosed: return "closed its communicator";
    case AbortCause::kPeerLeft: return "abandoned the call: a rank closed its communicator while others waited for it";
    case AbortCause::kNotSymmetric:
      return "abandoned the call: a rank's input is not in symmetric memory, so a peer in another process cannot read it";
    default: return "abandoned the call: a wait in the ring timed out";
  }
}

// Where a block that gave up records why (host-mapped, one per block).
struct ErrorRecord {
  int32_t valid;     // written last
  int32_t kind;      // AbortCause
  int32_t cause;     // kPeerAborted: the neighbour's AbortCause
  int32_t rank, peer, block;
  int32_t waiting_for;  // which flag: 0 publish, 1 consume, 2 descriptor, 3 input post, 4 inputs read
  int32_t aborted_rank;  // kPeerAborted: the neighbour that gave up (the awaited one, or the other)
  int32_t step;      // -1 before the first ring step
  int64_t slice;
  uint64_t call;     // the communicator's call number (0: unknown, the check is off)
  uint64_t expected, seen;
  uint64_t waited_ns;
  CallDescriptor mine, theirs;  // kMismatch
};

// One op of a plan as a kernel reads it: plan.h's PlanOp, with the number compile_plan found
// for its receive.
struct DevicePlanOp {
  uint64_t readers;  // with kToSlot: the ranks that read the publication (bit r: rank r)
  int32_t reads;     // a receive: which of the sender's publications of a slice it reads (1, 2, ..); 0: none
  int16_t from, first, count;
  uint8_t a, b, to, final;  // plan.h's Operand codes, kTo* bits (| kShareOutput), PlanOp::final
  uint8_t shared;           // a receive whose publication lies in the sender's output (CompiledPlan::reads_shared)
};

// A plan's slot bookkeeping is per block, in shared memory (device_plan.h): this many chunks
// at most. The built-in plans have at most max(P, 16); a user plan with more is refused.
constexpr int kMaxPlanChunks = 64;

// What a plan call adds to the launch parameters (zero for the ring).
struct PlanParams {
  const DevicePlanOp* ops;  // this rank's ops, in memory its kernels read (device memory on a GPU)
  int32_t op_count;
  int32_t chunks;           // C: a slice is cut into C chunks, so the data area into kBanks x C slots
  int64_t slot_bytes;       // of one of those slots (plan_slot_bytes)
  int32_t publications[kMaxWorld];  // per rank: its publications per slice (CompiledPlan::publications)
  int32_t most_publications;        // the largest of them: a call advances the numbering by slices x this
  void* work;               // private scratch of C chunks x slot_bytes
  // A plan that reads peers' memory where it lies (CompiledPlan::reads_in_place): every rank
  // posts where its input and output lie; this rank's last op that reads a peer's (-1:
  // none), after which, in the last slice, each block says it has read them (device_plan.h).
  int32_t reads_in_place;
  int32_t last_in_place_read_op;
  uint64_t inputs_read;                // bit r: some rank's ops read rank r's input (all-gather: all; broadcast: the root)
  uint64_t outputs_read;               // bit r: some rank receives what rank r shares in its output
  // Where this rank's input and output lie, for its post (InputPost), and how peers' posts are read.
  int64_t input_arena;                 // kPlainAddress, or the symmetric arena this rank's input lies in
  uint64_t input_offset;               // its offset in this rank's part of that arena
  int64_t output_arena;                // the same two for its output
  uint64_t output_offset;
  const char* const* symmetric_bases;  // the SymmetricTable's entries, in memory the kernels read
  int32_t symmetric_arenas;            // how many arenas the table holds
  int32_t plain_addresses_readable;    // every peer is a thread of this process: a plain post can be read
};

struct RingParams {
  char* my_base;            // my IPC allocation (flags, then data)
  const char* left_base;    // my left neighbour's, mapped here
  const char* right_base;   // my right neighbour's (its consumed flags and aborted flag are read)
  const char* peer_bases[kMaxWorld];  // every rank's, mapped here (mine at my rank): a plan's peers
  // The scope of the data flags (published, consumed): kDevice when every rank runs on this
  // GPU, else (or with RINGCOLL_CUDA_FLAG_SCOPE=system) kSystem (flag_scope_for). The aborted
  // flags and the descriptor, which hosts also write, and the error records, which hosts
  // read, stay at system scope.
  FlagScope flag_scope;
  uint64_t* state;          // the bookkeeping record, kStateWords words, private
  ErrorRecord* errors;      // kMaxBlocks records, host-mapped
  const void* input;
  void* output;
  int64_t ring_count;       // in elements of the kernel's type (call.h)
  int64_t slot_bytes;
  uint64_t timeout_ns;
  int rank, world;
  int collective;           // ringcoll::Collective
  // The units of ring_loop.h this launch runs: all of them (fused), or one (naive).
  int64_t first_unit, last_unit;
  // The mismatch check (descriptor.h), made by the launch that starts the call. `call`
  // also says which kernel runs (dispatch_call), and, by call.algorithm != 0, whether it is
  // a plan's (then `plan` says which).
  bool check_call;
  CallDescriptor call;
  PlanParams plan;
  // With a plan that reads peers' inputs where they lie: the plan run instead where one of
  // those inputs is out of some rank's reach (CompiledPlan::fallback; the same chunks and slot
  // size, so the same slices and grid); chunks == 0: none, out of reach is an error.
  PlanParams fallback;
};

// Where a rank's kernels find memory (RingParams has the meaning of each).
struct LaunchMemory {
  char* my_base;
  const char* const* peer_bases;  // world of them, mine at my rank
  FlagScope flag_scope;
  uint64_t* state;
  ErrorRecord* errors;
  const void* input;
  void* output;
};

// The launch parameters of one call.
inline RingParams call_params(const RingCall& call, int rank, int world, size_t slot_bytes, double timeout_seconds,
                              bool check_calls, KernelVariant variant, const LaunchMemory& memory) {
  RingParams p{};
  p.my_base = memory.my_base;
  p.left_base = memory.peer_bases[left_neighbour(rank, world)];
  p.right_base = memory.peer_bases[right_neighbour(rank, world)];
  for (int r = 0; r < world; ++r) p.peer_bases[r] = memory.peer_bases[r];
  p.flag_scope = memory.flag_scope;
  p.state = memory.state;
  p.errors = memory.errors;
  p.input = memory.input;
  p.output = memory.output;
  p.ring_count = call.ring_count;
  p.slot_bytes = static_cast<int64_t>(slot_bytes);
  const double ns = timeout_seconds * 1e9;
  p.timeout_ns = ns < 1.8e19 ? static_cast<uint64_t>(ns) : UINT64_MAX;  // NaN and inf included
  p.rank = rank;
  p.world = world;
  p.collective = static_cast<int>(call.collective);
  p.check_call = check_calls;
  p.call = call.descriptor;
  p.call.variant = static_cast<int32_t>(variant);  // ranks must also agree on the kernel variant
  return p;
}

// The launches that make one collective: `launch(params, blocks, vectorise)` is called once
// for the fused variant (fused_blocks() blocks, at most `max_blocks`), once per ring step
// for the naive one, not at all for a call with nothing to move or check; `elem_size` is
// RingCall::elem_size.
template <class Launch>
void for_each_launch(RingParams p, KernelVariant variant, int elem_size, int max_blocks, Launch&& launch) {
  const int64_t slice_elems = slice_elems_for(p.slot_bytes, elem_size);
  const int64_t units = ring_units(static_cast<Collective>(p.collective), p.ring_count, p.world, slice_elems);
  if (units == 0 && !p.check_call) return;  // a zero-length call still takes part in the check
  p.first_unit = 0, p.last_unit = units;
  if (variant == KernelVariant::kFused) {
    launch(p, fused_blocks(p.ring_count, p.world, slice_elems, elem_size, max_blocks), true);
  } else if (units == 0) {
    launch(p, 1, false);  // a zero-length call launches only to take part in the check
  } else {
    const bool check = p.check_call;
    for (int64_t u = 0; u < units; ++u) {
      p.first_unit = u, p.last_unit = u + 1;
      p.check_call = check && u == 0;
      launch(p, 1, false);
    }
  }
}

// --- plans ---------------------------------------------------------------------------------

// A plan's slot: the data area (kBanks x world slots of the ring's slot_bytes) cut into
// kBanks x chunks slots, aligned as the ring's.
inline int64_t plan_slot_bytes(size_t ring_slot_bytes, int world, int chunks) {
  return static_cast<int64_t>(slot_bytes_for(static_cast<size_t>(kBanks) * world * ring_slot_bytes, chunks,
                                             kSlotAlignment));
}

// Rank `rank`'s ops of a compiled plan as its kernels read them. Throws std::invalid_argument
// for a plan the kernels cannot run (too many chunks for their bookkeeping). Whether a plan
// that reads peers' inputs can reach them is not known here (a peer's input may lie in
// symmetric memory or not): the kernels decide from the posts (device_plan.h).
inline std::vector<DevicePlanOp> device_plan_ops(const CompiledPlan& plan, int rank, const char* op) {
  RINGCOLL_CHECK(plan.plan.chunks <= kMaxPlanChunks, std::invalid_argument, op, ": a plan of ", plan.plan.chunks,
                 " chunks; the CUDA kernels run plans of at most ", kMaxPlanChunks);
  std::vector<DevicePlanOp> out;
  const auto& ops = plan.plan.ops[static_cast<size_t>(rank)];
  for (size_t i = 0; i < ops.size(); ++i) {
    const PlanOp& o = ops[i];
    DevicePlanOp d;
    std::memset(&d, 0, sizeof(d));  // padding too: PlanRecords compares records bytewise
    d.readers = o.readers;
    d.reads = plan.publication_read[static_cast<size_t>(rank)][i];
    d.from = o.from, d.first = o.first, d.count = o.count;
    d.a = static_cast<uint8_t>(o.a), d.b = static_cast<uint8_t>(o.b), d.to = o.to, d.final = o.final ? 1 : 0;
    d.shared = static_cast<uint8_t>(plan.reads_shared[static_cast<size_t>(rank)][i]);
    out.push_back(d);
  }
  return out;
}

// The plan part of a call's launch parameters; `ops` and `work` are where this rank's kernels
// find device_plan_ops' records and their scratch (plan_work_bytes). Throws
// std::invalid_argument, naming `op`, when the buffer has no whole slot for each chunk.
inline PlanParams plan_params(const CompiledPlan& plan, const DevicePlanOp* ops, int op_count, size_t ring_slot_bytes,
                              int world, void* work, const char* op) {
  PlanParams q{};
  q.ops = ops;
  q.op_count = op_count;
  q.chunks = plan.plan.chunks;
  q.slot_bytes = plan_slot_bytes(ring_slot_bytes, world, plan.plan.chunks);
  RINGCOLL_CHECK(q.slot_bytes > 0, std::invalid_argument, op, ": a plan of ", q.chunks, " chunks needs two banks of ",
                 q.chunks, " slots of ", kSlotAlignment, " bytes; this communicator's buffer has ",
                 static_cast<size_t>(kBanks) * world * ring_slot_bytes, " bytes of slots: raise buffer_bytes");
  for (int r = 0; r < world; ++r) {
    q.publications[r] = plan.publications[static_cast<size_t>(r)];
    if (q.publications[r] > q.most_publications) q.most_publications = q.publications[r];
  }
  q.work = work;
  return q;
}

// The plans a communicator has run, each rank's records placed once in an area of
// kPlanRecordCapacity records that its kernels read (device memory on a GPU): a queued
// kernel may still read any of them, so none moves or goes before the communicator closes.
// The area is allocated with the communicator, never during a call: an allocation may wait
// for the whole device, and in one process that includes peers' kernels spinning on us.
constexpr int64_t kPlanRecordCapacity = 16384;  // 384 KiB: hundreds of distinct plans

class PlanRecords {
 public:
  // The index of `ops` in the area, placing them after those already there if they are new
  // (then `*added` is true and the caller copies them to that index). Throws
  // std::invalid_argument, naming `op`, when the area is full.
  int64_t place(const std::vector<DevicePlanOp>& ops, bool* added, const char* op) {
    for (size_t k = 0; k < known_.size(); ++k)
      if (known_[k].size() == ops.size() &&
          (ops.empty() || std::memcmp(known_[k].data(), ops.data(), ops.size() * sizeof(DevicePlanOp)) == 0)) {
        *added = false;
        return at_[k];
      }
    const int64_t n = static_cast<int64_t>(ops.size());
    RINGCOLL_CHECK(used_ + n <= kPlanRecordCapacity, std::invalid_argument, op, ": this communicator has run plans of ",
                   used_, " records in all, and this one's ", n, " more do not fit its area of ", kPlanRecordCapacity,
                   "; build a new communicator for more plans");
    known_.push_back(ops);
    at_.push_back(used_);
    used_ += n;
    *added = true;
    return at_.back();
  }
  // The records last placed, kept here (their memory does not move) until the communicator
  // goes: an asynchronous copy may read them after place() returns.
  const std::vector<DevicePlanOp>& newest() const { return known_.back(); }

 private:
  std::vector<std::vector<DevicePlanOp>> known_;
  std::vector<int64_t> at_;
  int64_t used_ = 0;
};

// A plan's private scratch on every rank: C chunks of a plan's slot, at most half the data
// area (plan_slot_bytes), whatever the plan: allocated with the communicator.
inline size_t plan_work_bytes(size_t ring_slot_bytes, int world) { return static_cast<size_t>(world) * ring_slot_bytes; }

// A plan call's PlanParams for `rank` (what CudaComm and the emulator both do before they
// queue it): the plan checked for this communicator, its records placed in `records`, and
// copied by `copy_new(to, records)` into `area` the first time this plan runs.
template <class CopyNew>
PlanParams prepare_plan(PlanRecords& records, DevicePlanOp* area, void* work, const CompiledPlan& plan,
                        Collective coll, int rank, int world, size_t ring_slot_bytes, const char* op,
                        CopyNew&& copy_new) {
  check_plan_fits(plan, coll, world, op);
  const std::vector<DevicePlanOp> ops = device_plan_ops(plan, rank, op);
  bool added = false;
  const int64_t at = records.place(ops, &added, op);
  if (added && !ops.empty()) copy_new(area + at, records.newest());
  PlanParams q = plan_params(plan, area + at, static_cast<int>(ops.size()), ring_slot_bytes, world, work, op);
  q.reads_in_place = plan.reads_in_place ? 1 : 0;
  q.last_in_place_read_op = plan.last_in_place_read_op[static_cast<size_t>(rank)];
  q.inputs_read = plan.inputs_read;
  q.outputs_read = plan.outputs_read;
  return q;
}

// --- symmetric memory ------------------------------------------------------------------
// On CUDA (and in its emulator) arena a of symmetric memory (ringcoll/symmetric_heap.h) is
// one device allocation per rank, every peer's mapped here: through CUDA IPC from another
// process, as the plain pointer from this one. A kernel finds rank r's part of arena a, as
// mapped here, at entry a * kMaxWorld + r of a table, which the host keeps (SymmetricTable)
// and the kernels read from memory of theirs (device memory on a GPU: CudaComm copies each
// new row there, on its stream, before any kernel that can read it).
constexpr int kMaxSymmetricArenas = 128;
constexpr size_t kSymmetricTableEntries = static_cast<size_t>(kMaxSymmetricArenas) * kMaxWorld;

class SymmetricTable {
 public:
  SymmetricTable() : entries_(kSymmetricTableEntries, nullptr) {}
  // A new arena, in the table and in this rank's `heap` together (so both number it alike):
  // `bases[r]` rank r's part of it as mapped here, `mine` (the owner of `bytes` at `base`)
  // this rank's. Returns its index. Throws std::invalid_argument naming `op` when the table
  // is full.
  size_t add_arena(SymmetricHeap& heap, const std::vector<const char*>& bases, std::shared_ptr<void> mine, char* base,
                   size_t bytes, const char* op) {
    const size_t arena = heap.arenas();
    RINGCOLL_CHECK(arena == static_cast<size_t>(arenas_), std::logic_error, op, ": the heap has ", arena,
                   " arenas and the table ", arenas_);
    RINGCOLL_CHECK(arenas_ < kMaxSymmetricArenas, std::invalid_argument, op, ": a communicator holds at most ",
                   kMaxSymmetricArenas, " arenas of symmetric memory (each ",
                   kSymmetricArenaBytes >> 20, " MiB or one large tensor); free tensors, or allocate fewer, larger ones");
    for (size_t r = 0; r < bases.size(); ++r) entries_[arena * kMaxWorld + r] = bases[r];
    ++arenas_;
    heap.add_arena(std::move(mine), base, bytes);
    return arena;
  }
  int arenas() const { return arenas_; }
  const char* const* entries() const { return entries_.data(); }
  const char* const* row(size_t arena) const { return entries_.data() + arena * kMaxWorld; }

 private:
  std::vector<const char*> entries_;  // never resized: a kernel's copy may be read at any time
  int arenas_ = 0;
};

// The symmetric part of a plan call's parameters: where this rank's input and output lie
// (each its arena and offset, or kPlainAddress), the table the kernels read (`bases`: the
// table's entries in their memory), and whether peers' plain addresses can be read (every
// peer is a thread of this process).
inline void place_arguments(PlanParams& q, const SymmetricHeap& heap, const SymmetricTable& table,
                            const char* const* bases, const RingCall& call, int world, const void* input,
                            const void* output, bool plain_addresses_readable) {
  const auto place = heap.locate(input, input_bytes(call, world));
  q.input_arena = place ? static_cast<int64_t>(place->arena) : kPlainAddress;
  q.input_offset = place ? place->offset : reinterpret_cast<uint64_t>(input);
  const auto out_place = heap.locate(output, output_bytes(call, world));
  q.output_arena = out_place ? static_cast<int64_t>(out_place->arena) : kPlainAddress;
  q.output_offset = out_place ? out_place->offset : reinterpret_cast<uint64_t>(output);
  q.symmetric_bases = bases;
  q.symmetric_arenas = table.arenas();
  q.plain_addresses_readable = plain_addresses_readable ? 1 : 0;
}

// The plan part of a call's fallback (CompiledPlan::fallback; chunks == 0: none), prepared by
// `prepare(plan)` (prepare_plan, as CudaComm or the emulator places records) beside the
// plan's own part `primary`; the fallback's id goes into the call's descriptor. Throws
// std::invalid_argument if the two cut the message into slots of different sizes (they could
// not share the call's slices and grid).
template <class Prepare>
PlanParams prepare_fallback(const PlanParams& primary, RingCall& call, const CompiledPlan& plan, Prepare&& prepare) {
  if (plan.fallback == nullptr) return PlanParams{};
  const PlanParams fallback = prepare(*plan.fallback);
  RINGCOLL_CHECK(fallback.chunks == primary.chunks && fallback.slot_bytes == primary.slot_bytes,
                 std::invalid_argument, "a plan's fallback must cut the message as it does");
  call.descriptor.fallback = static_cast<int32_t>(plan.fallback->id);
  return fallback;
}

// The one launch of a plan call (none for a call with nothing to move or check): the fused
// variant's grid is fused_blocks() over the plan's chunks (block b takes the same tiles of
// every chunk on every rank), the naive one a single block of scalar loops.
template <class Launch>
void for_each_plan_launch(const RingParams& p, KernelVariant variant, int elem_size, int max_blocks, Launch&& launch) {
  const int64_t slice_elems = slice_elems_for(p.plan.slot_bytes, elem_size);
  const int64_t slices = p.ring_count > 0 ? num_slices(p.ring_count, p.plan.chunks, slice_elems) : 0;
  if (slices == 0 && !p.check_call) return;
  RingParams q = p;
  q.first_unit = 0, q.last_unit = slices;
  if (variant == KernelVariant::kFused)
    launch(q, fused_blocks(p.ring_count, p.plan.chunks, slice_elems, elem_size, max_blocks), true);
  else
    launch(q, 1, false);
}

// The record the host reports among a launch's blocks: a block's own finding (timeout,
// mismatch) over a note that a neighbour gave up. Null if no block recorded anything.
inline const ErrorRecord* first_error(const ErrorRecord* records, int blocks) {
  const ErrorRecord* found = nullptr;
  for (int b = 0; b < blocks; ++b) {
    const ErrorRecord& r = records[b];
    if (__atomic_load_n(&r.valid, __ATOMIC_ACQUIRE) == 0) continue;
    if (found == nullptr || (found->kind == static_cast<int32_t>(AbortCause::kPeerAborted) &&
                             r.kind != static_cast<int32_t>(AbortCause::kPeerAborted)))
      found = &r;
  }
  return found;
}

// What the host raises for a record: the message, and which error (the cause at the origin:
// a mismatch anywhere in the ring is a mismatch on every rank, as on the CPU transport).
inline AbortCause error_cause(const ErrorRecord& r) {
  return static_cast<AbortCause>(r.kind == static_cast<int32_t>(AbortCause::kPeerAborted) ? r.cause : r.kind);
}

inline std::string error_message(const ErrorRecord& r, int world, double timeout_seconds) {
  std::ostringstream msg;
  const bool plan = r.mine.algorithm != 0;  // a plan's kernel: its peers are any ranks, its steps ops
  const char* side = plan ? "" : r.peer == left_neighbour(r.rank, world) ? "left neighbour " : "right neighbour ";
  static const char* const kWhat[] = {"publish data", "consume data", "announce its call", "post where its input lies",
                                      "finish reading this rank's input or shared output"};
  const char* what = kWhat[r.waiting_for >= 0 && r.waiting_for < 5 ? r.waiting_for : 0];
  switch (static_cast<AbortCause>(r.kind)) {
    case AbortCause::kTimedOut:
      msg << "rank " << r.rank << " timed out after " << timeout_seconds << " s waiting for " << side << "rank "
          << r.peer << " to " << what;
      break;
    case AbortCause::kNotSymmetric:
      if (r.seen == static_cast<uint64_t>(kPlainAddress))
        msg << "rank " << r.peer << "'s input is not in symmetric memory (ringcoll.empty), so its peers in other "
            << "processes cannot read it where it lies; a plan that reads peers' inputs (algorithm \"direct\") "
            << "needs the input of every rank it reads in symmetric memory of this communicator";
      else
        msg << "rank " << r.peer << "'s input lies in symmetric arena " << r.seen << ", which rank " << r.rank
            << " has not mapped (it has " << r.expected << ")";
      msg << "; no data was moved";
      break;
    case AbortCause::kMismatch:
      msg << "mismatched collective calls (call " << r.call << " on this communicator): rank " << r.rank
          << " called " << describe_call(r.mine) << " but " << (plan ? "" : "its ") << side << "rank " << r.peer << " called "
          << (r.theirs.collective >= 0 ? describe_call(r.theirs) : "a zero-length collective and has moved on")
          << "; no data was moved";
      break;
    default:
      msg << "rank " << r.rank << " stopped waiting for " << side << "rank " << r.peer << " to " << what << ": rank "
          << r.aborted_rank << " " << abort_cause_text(r.cause) << " (its own error says more)";
  }
  msg << " (GPU kernel, ";
  if (r.call > 0) msg << "call " << r.call << ", ";
  msg << "block " << r.block << ", ";
  if (r.waiting_for == 2) msg << "checking the call)";
  else {
    msg << "slice " << r.slice + 1 << ", ";
    if (plan && r.step < 0) msg << "before the plan's first op)";
    else if (plan) msg << "plan op " << r.step + 1 << ")";
    else if (r.step < 0) msg << "before ring step 1)";
    else msg << "ring step " << r.step + 1 << ")";
  }
  if (r.kind == static_cast<int32_t>(AbortCause::kTimedOut))
    msg << "; flag is " << r.seen << ", expected >= " << r.expected;
  return msg.str();
}

}  // namespace ringcoll::cuda
