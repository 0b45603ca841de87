// host_plan.cpp: the plan engine on the CPU transport, its one step loop. It runs any plan
// (plan.h) over the ranks' shared-memory segments, addressed by any peer: native's plans
// (the ring's; the one-shot's for small messages; the direct reads' for mid-size
// all-gathers), every other built-in algorithm and a user's.
//
// Flags (docs/flags.md). Publications share the communicator's one numbering: every rank
// starts a plan call at the same base (each call ends with it equal on all ranks), and
// rank k's m-th publication of slice j is base + j * pubs(k) + m, where pubs(k) is how
// many publications rank k makes per slice (compile_plan counts them for every rank, so
// every rank can number any peer's). A reader waits until the sender's `published`
// reaches that number, reads, and stores it in its own `consumed_from[sender]`: flow
// control per connection, not one counter for the left neighbour. At the end of the call
// every rank moves its `published` to base + slices * max_k pubs(k), the same on every
// rank, so the numbering stays equal.
//
// Slots. A publication of chunks [f, f + n) in the slice's bank fills slots f .. f+n-1 of
// that bank of the sender's buffer, each 1/(kBanks C) of it (slot_bytes_for with C chunks);
// bank b starts at b * bank_bytes_for, whatever C (call.h says why). Before a
// rank overwrites a slot, every reader of the publication that last filled it must have
// consumed it. Between calls: before every plan call every rank waits until all it
// published has been read (drain_plan_publications): the slots' layout depends on the
// algorithm, so nothing carries from one call to the next (carrying it was tried:
// algorithms.md). A bank is the same half of the buffer whatever the plan, though, so a
// call of one slice whose sends go early (the one-shot's, before the call check) waits only
// for the bank it fills, and such calls take the two banks in turn (PlanCallStart).
//
// Peers' memory where it lies. A kPeerInput operand, and a receive of a publication shared
// in its sender's output (kShareOutput: numbered like any other, but no slot), read the
// peer's input or output with process_vm_readv, where it posted them before the call check
// (HostComm::read_peer), a bounce-buffer piece at a time where the value is combined; the
// call ends with the "done reading" handshake (finish_direct_reads).
#include <algorithm>
#include <cstring>

#include "host_comm.h"
#include "host_strip.h"
#include "ringcoll/ring_loop.h"

namespace ringcoll::host {

namespace {

template <typename T, class Op>
class PlanRun {
 public:
  // `at`: the call's first bank, and whether its early sends have run (the records hold them).
  PlanRun(HostComm& comm, const CompiledPlan& plan, Collective coll, int64_t ring_count, const void* input,
          void* output, uint64_t base, PlanScratch& scratch, PlanCallStart at)
      : comm_(comm), plan_(plan), coll_(coll), me_(comm.rank()), chunks_(plan.plan.chunks),
        ring_count_(ring_count), input_(static_cast<const T*>(input)), output_(static_cast<T*>(output)),
        slot_bytes_(slot_bytes_for(comm.buffer_bytes(), chunks_, kSlotAlignment)),
        bank_bytes_(bank_bytes_for(comm.buffer_bytes(), kSlotAlignment)),
        slice_elems_(plan_slice_elems(plan, comm.buffer_bytes(), ring_count, sizeof(T))),
        slices_(slice_elems_ > 0 ? num_slices(ring_count, chunks_, slice_elems_) : 0), base_(base),
        first_bank_(at.first_bank), slot_last_(scratch.slot_last), slot_readers_(scratch.slot_readers) {
    if (at.early_ops_done == 0) {
      slot_last_.assign(static_cast<size_t>(kBanks) * chunks_, 0);
      slot_readers_.assign(slot_last_.size(), 0);
    }
    // Python checks this first (Communicator._plan); here for callers of the binding itself
    RINGCOLL_CHECK(slice_elems_ > 0, std::invalid_argument, collective_info(coll).name, ": a plan of ", chunks_,
                   " chunks needs buffer_bytes >= ", min_buffer_bytes(chunks_, kSlotAlignment), "; this one's is ",
                   comm.buffer_bytes());
    // all-gather's input and reduce-scatter's output are one rank's chunk (C = P for both)
    const size_t message = static_cast<size_t>(ring_count) * sizeof(T);
    const size_t chunk = message / static_cast<size_t>(chunks_);
    stream_output_ = streams_output(input, coll == Collective::kAllGather ? chunk : message, output,
                                    coll == Collective::kReduceScatter ? chunk : message);
    if (plan.reads_in_place) {
      if (scratch.bounce.size() < kBounceBytes) scratch.bounce.resize(kBounceBytes);
      bounce_ = reinterpret_cast<T*>(scratch.bounce.data());
    }
    if (plan.uses_work) {
      const size_t work_bytes = static_cast<size_t>(chunks_) * static_cast<size_t>(slice_elems_) * sizeof(T);
      if (scratch.work.size() < work_bytes) scratch.work.resize(work_bytes);
      work_ = reinterpret_cast<T*>(scratch.work.data());
    }
  }

  int64_t slices() const { return slices_; }
  bool output_streams() const { return stream_output_; }

  // Slice j: this rank's ops [first, last), in order (every op but in the early sends'
  // split; the ops before `first` each published once).
  void run_slice(int64_t j, int first = 0, int last = -1) {
    const int bank = static_cast<int>((j + first_bank_) % kBanks);
    const auto& ops = plan_.plan.ops[me_];
    int published = first;  // this rank's publications so far in this slice
    const size_t end = last < 0 ? ops.size() : static_cast<size_t>(last);
    for (size_t i = static_cast<size_t>(first); i < end; ++i) {
      const PlanOp& op = ops[i];
      comm_.set_plan_position(j, slices_, static_cast<int>(i), static_cast<int>(ops.size()), plan_.id);
      const bool receives = op.a == Operand::kPeer || op.b == Operand::kPeer;
      const bool shared = plan_.reads_shared[me_][i] != 0;  // the publication lies in the sender's output
      const uint64_t reads = receives ? number(op.from, j, plan_.publication_read[me_][i]) : 0;
      if (receives) comm_.wait_for(op.from, &comm_.header(op.from).published.value, reads, "publish data");
      const bool in_slot = (op.to & kToSlot) != 0;
      const uint64_t writes = (op.to & (kToSlot | kShareOutput)) ? number(me_, j, ++published) : 0;
      if (in_slot) wait_slots_free(bank, op.first, op.count);
      for (int c = op.first; c < op.first + op.count; ++c) combine(op, shared, bank, j, c);
      if (receives) flag_store_release(&comm_.header(me_).consumed_from[op.from], reads);
      // Done reading the peers' memory: say so now, so that they may return while this rank
      // still writes (a direct all-gather's own chunk, copied last).
      if (j + 1 == slices_ && static_cast<int>(i) == plan_.last_in_place_read_op[me_]) comm_.say_peer_reads_done();
      if (writes) {
        for (int c = op.first; c < op.first + op.count && in_slot; ++c) {
          slot_last_[slot_index(bank, c, chunks_)] = writes;
          slot_readers_[slot_index(bank, c, chunks_)] = op.readers;
        }
        // Streaming stores are weakly ordered: what they wrote before the flag. A slot may be
        // written with them; a shared output chunk is written with ordinary stores by the op
        // that shares it, but an earlier op of the call may have streamed into that chunk (a
        // relay: received into the output, then shared onward by a copy onto itself).
        if ((in_slot && comm_.stream_slots()) || ((op.to & kShareOutput) && stream_output_)) stream_fence();
        flag_store_release(&comm_.header(me_).published.value, writes);
      }
    }
  }

  // Per bank and peer: my latest publication it reads (drain_plan_publications waits for it).
  void note_unread(UnreadPublications& unread) const {
    for (size_t s = 0; s < slot_last_.size(); ++s)
      for (int r = 0; r < comm_.world(); ++r)
        if (has_bit(slot_readers_[s], r)) {
          uint64_t& latest = unread[s / static_cast<size_t>(chunks_)][r];  // slot s lies in bank s / C
          latest = std::max(latest, slot_last_[s]);
        }
  }

 private:
  // The number of rank k's m-th publication of slice j.
  uint64_t number(int k, int64_t j, int m) const {
    return base_ + static_cast<uint64_t>(j) * static_cast<uint64_t>(plan_.publications[k]) + static_cast<uint64_t>(m);
  }

  void wait_slots_free(int bank, int first, int count) {
    for (int c = first; c < first + count; ++c) {
      const size_t s = static_cast<size_t>(slot_index(bank, c, chunks_));
      for (int r = 0; r < comm_.world(); ++r)
        if (has_bit(slot_readers_[s], r))
          comm_.wait_for(r, &comm_.header(r).consumed_from[me_], slot_last_[s], "consume data");
    }
  }

  // The elements of chunk c that belong to slice j, and where they start in a chunk.
  int64_t length(int c, int64_t j) const {
    return slice_length(chunk_length(ring_count_, chunks_, c), slice_elems_, j);
  }

  T* slot(int rank, int bank, int c) const {
    return reinterpret_cast<T*>(comm_.data(rank) + static_cast<size_t>(bank) * bank_bytes_ +
                                static_cast<size_t>(c) * slot_bytes_);
  }
  // All-gather's input is this rank's chunk only; reduce-scatter's output likewise
  // (the checker refuses plans that address any other chunk of them).
  const T* input_at(int c, int64_t j) const {
    return input_ + j * slice_elems_ + (coll_ == Collective::kAllGather ? 0 : chunk_begin(ring_count_, chunks_, c));
  }
  T* output_at(int c, int64_t j) const {
    return output_ + j * slice_elems_ + (coll_ == Collective::kReduceScatter ? 0 : chunk_begin(ring_count_, chunks_, c));
  }
  T* work_at(int c) const { return work_ + static_cast<int64_t>(c) * slice_elems_; }

  // Element `at` of an operand's chunk c in slice j; a peer's memory read where it lies (its
  // input, or a publication `shared` in its output) is the bounce buffer, which holds just
  // that piece (read_in_place's, just before).
  const T* operand(Operand which, bool shared, int from, int bank, int c, int64_t j, int64_t at) const {
    switch (which) {
      case Operand::kPeer: return shared ? bounce_ : slot(from, bank, c) + at;
      case Operand::kInput: return input_at(c, j) + at;
      case Operand::kOutput: return output_at(c, j) + at;
      case Operand::kWork: return work_at(c) + at;
      case Operand::kPeerInput: return bounce_;
      case Operand::kNone: break;
    }
    return nullptr;
  }

  // Elements [at, at + len) of chunk c of slice j of rank `from`'s input (kPeerInput) or,
  // `shared`, its output, read where they lie into `into`; all-gather's input and
  // reduce-scatter's output are the rank's own chunk, so they start at the chunk's beginning.
  void read_in_place(bool shared, int from, int c, int64_t j, int64_t at, int64_t len, T* into) {
    const Collective own_chunk_only = shared ? Collective::kReduceScatter : Collective::kAllGather;
    const int64_t begin = j * slice_elems_ + at + (coll_ == own_chunk_only ? 0 : chunk_begin(ring_count_, chunks_, c));
    comm_.read_peer(from, shared ? HostComm::PeerPlace::kOutput : HostComm::PeerPlace::kInput,
                    static_cast<size_t>(begin) * sizeof(T), into, static_cast<size_t>(len) * sizeof(T));
  }

  // `shared`: the publication the op receives lies in the sender's output (kShareOutput).
  void combine(const PlanOp& op, bool shared, int bank, int64_t j, int c) {
    const int64_t len = length(c, j);
    if (len == 0) return;
    // copy_strip and reduce_strip write two places, as the ring's steps do: the slot (its
    // stores per SlotStores, host_comm.h) or the work space first, the output (written
    // around the cache past streams_output's bound) or the work space second.
    T* const slot_place = (op.to & kToSlot) ? slot(me_, bank, c) : nullptr;
    T* const work_place = (op.to & kToWork) ? work_at(c) : nullptr;
    T* const out_place = (op.to & kToOutput) ? output_at(c, j) : nullptr;
    T* first = slot_place != nullptr ? slot_place : work_place;
    T* second = out_place != nullptr ? out_place : slot_place != nullptr ? work_place : nullptr;
    const bool stream_first = slot_place != nullptr && comm_.stream_slots();
    // An output shared with readers is written into the cache, as a slot is: they read it next
    const bool stream_second = out_place != nullptr && stream_output_ && !(op.to & kShareOutput);
    const bool in_place = op.a == Operand::kPeerInput || op.b == Operand::kPeerInput || shared;
    if (in_place && op.b == Operand::kNone && slot_place == nullptr) {  // a copy: straight into a place of mine
      T* into = first != nullptr ? first : second;
      read_in_place(shared, op.from, c, j, 0, len, into);
      if (into == first && second != nullptr) copy_strip(static_cast<T*>(nullptr), second, into, len, stream_second);
      return;
    }
    // An op of this rank's own operands runs in one piece. One that reads a peer's memory to
    // combine or publish it goes through the bounce buffer a piece at a time: each piece is
    // read, then combined while it is still in cache. (A direct plan's slice is a whole
    // chunk; read whole into a buffer made for the call, a 64 MiB reduce-scatter at P = 2
    // took 31 ms instead of 8: 32 MiB faulted in, zeroed and written to memory per call.)
    const int64_t piece = in_place ? static_cast<int64_t>(kBounceBytes / sizeof(T)) : len;
    for (int64_t at = 0; at < len; at += piece) {
      const int64_t n = std::min(piece, len - at);
      if (in_place) read_in_place(shared, op.from, c, j, at, n, bounce_);
      combine_piece(op, shared, bank, c, j, at, n, first, second, stream_first, stream_second);
    }
  }

  // Elements [at, at + n) of combine's op: a value from operands a (and b) written to
  // `first` and `second` (each may be null), past `at` in each.
  void combine_piece(const PlanOp& op, bool shared, int bank, int c, int64_t j, int64_t at, int64_t n, T* first,
                     T* second, bool stream_first, bool stream_second) {
    const T* a = operand(op.a, shared, op.from, bank, c, j, at);
    first = first != nullptr ? first + at : nullptr;
    second = second != nullptr ? second + at : nullptr;
    if (op.b == Operand::kNone) {
      if (first == a) first = nullptr;  // in place: already there
      if (second == a) second = nullptr;
      if (first != nullptr || second != nullptr) copy_strip(first, second, a, n, stream_second, stream_first);
      return;
    }
    const T* b = operand(op.b, shared, op.from, bank, c, j, at);
    if (op.final) reduce_strip<T, Op, true>(first, second, a, b, n, comm_.world(), stream_second, stream_first);
    else reduce_strip<T, Op, false>(first, second, a, b, n, comm_.world(), stream_second, stream_first);
  }

  HostComm& comm_;
  const CompiledPlan& plan_;
  Collective coll_;
  int me_, chunks_;
  int64_t ring_count_;
  const T* input_;
  T* output_;
  size_t slot_bytes_;
  size_t bank_bytes_;  // bank b's slots start at b * bank_bytes_, for every plan
  int64_t slice_elems_, slices_;
  uint64_t base_;
  int first_bank_;  // slice j fills bank (j + first_bank_) mod kBanks
  T* work_ = nullptr;
  std::vector<uint64_t>& slot_last_;     // per slot: the publication that last filled it (this call)
  std::vector<uint64_t>& slot_readers_;  // ... and its readers
  T* bounce_ = nullptr;                 // a piece of a peer's memory read where it lies, for an op that
                                        // combines or publishes it (PlanScratch::bounce, kept from call to call)
  bool stream_output_ = false;          // the output is written around the cache (streams_output)
};

}  // namespace

int64_t plan_slice_elems(const CompiledPlan& plan, size_t buffer_bytes, int64_t ring_count, size_t elem_size) {
  // A plan that neither publishes nor uses the work space (direct reads only) is not cut
  // into slices: nothing bounds its pieces but the message.
  if (!plan.uses_work && !fills_slots(plan)) return std::max<int64_t>(1, max_chunk_length(ring_count, plan.plan.chunks));
  return static_cast<int64_t>(slot_bytes_for(buffer_bytes, plan.plan.chunks, kSlotAlignment) / elem_size);
}

void run_host_plan_early_sends(HostComm& comm, const CompiledPlan& plan, const RingCall& call, const void* input,
                               uint64_t base, PlanScratch& scratch, int first_bank) {
  dispatch_call(call.descriptor, [&](auto t, auto o) {
    PlanRun<decltype(t), decltype(o)> run(comm, plan, call.collective, call.ring_count, input, nullptr, base, scratch,
                                          PlanCallStart{first_bank, 0});
    run.run_slice(0, 0, plan.early_sends[comm.rank()]);
  });
}

uint64_t run_host_plan(HostComm& comm, const CompiledPlan& plan, const RingCall& call, const void* input,
                       void* output, uint64_t base, UnreadPublications& unread, PlanScratch& scratch,
                       PlanCallStart at) {
  int64_t slices = 0;
  dispatch_call(call.descriptor, [&](auto t, auto o) {
    PlanRun<decltype(t), decltype(o)> run(comm, plan, call.collective, call.ring_count, input, output, base, scratch,
                                          at);
    slices = run.slices();
    for (int64_t j = 0; j < slices; ++j) run.run_slice(j, j == 0 ? at.early_ops_done : 0);
    run.note_unread(unread);
    // The output's streaming stores are weakly ordered: done before the caller's next access
    // (the slots' were fenced before each publication).
    if (run.output_streams()) stream_fence();
  });
  // Every rank to the same number, so the numbering stays equal on all ranks. A rank that
  // publishes most per slice is there already (its last publication has that number): it
  // neither stores nor loads its `published`, a line its peers poll.
  const int most = *std::max_element(plan.publications.begin(), plan.publications.end());
  const uint64_t taken = static_cast<uint64_t>(slices) * static_cast<uint64_t>(most);
  if (plan.publications[comm.rank()] < most && taken > 0)
    flag_store_release(&comm.header(comm.rank()).published.value, base + taken);
  return taken;
}

}  // namespace ringcoll::host
