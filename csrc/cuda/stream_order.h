// stream_order.h: how one collective is put on CUDA streams, and what closing waits for.
// One place for both users: CudaComm (cuda_comm.cu, over the CUDA runtime) and the
// emulator (csrc/emulation/emulated_ring.cpp, over the stream model of emulated_streams.h),
// so CI runs the very order a GPU runs.
//
// `Streams` is an adapter with: types Stream and Event; record(event, stream);
// record_for_replays(event, stream) (an event a graph replay records: cudaEventRecordExternal);
// wait(stream, event); capturing(stream); synchronize_stream(stream) and
// synchronize_event(event), each returning whether it succeeded.
#pragma once

namespace ringcoll::cuda {

// The events a communicator keeps for its calls. `done` follows its latest call on its own
// stream; inside a CUDA graph capture that record is only a point in the graph (a replay
// does not record it for the host), so `replayed` is recorded as external there, just
// before `done`: a replay records it, and closing can wait for a replay still running.
template <class Event>
struct CallEvents {
  Event ready, done, replayed;
};

// A collective, on the communicator's stream `own`: after everything the caller queued on
// `user` so far (the inputs are ready), in order with its earlier collectives whatever
// streams their callers used; `queue_work()` queues the call's copies and kernels on
// `own`. With `join`, the caller's later work on `user` waits for the collective (a
// synchronous call: the host is never blocked). In the in-process mode `user` must not be
// a stream other ranks' threads share (the legacy default stream): this rank's
// wait for its kernel would sit in front of the next rank's `ready` record, whose kernel
// this rank's kernel waits for (ringcoll/transports/cuda.py refuses it).
template <class Streams, class QueueWork>
void queue_collective(Streams& s, typename Streams::Stream user, typename Streams::Stream own,
                      const CallEvents<typename Streams::Event>& events, bool join, QueueWork&& queue_work) {
  s.record(events.ready, user);
  s.wait(own, events.ready);
  queue_work();
  // `replayed` before `done`: in a capture the external record is a node of the graph, and
  // the caller's wait for `done` (or a later one) must come after every node `own` added,
  // else the capture cannot end (cudaErrorStreamCaptureUnjoined, seen on an H200).
  if (s.capturing(own)) s.record_for_replays(events.replayed, own);
  s.record(events.done, own);
  if (join) s.wait(user, events.done);
}

// Step 1 of closing (cuda_comm.cu): every launch that uses our memory has finished: those
// on our stream, and a graph replay of one (it may run on any stream). Only those: a
// device-wide synchronisation would also wait for unrelated work, in the in-process mode a
// peer thread's ring that is waiting for us. Not `done`: the stream's sync covers it, and
// after a captured call it was last recorded in the capture, where a host sync on it fails
// (cudaErrorCapturedEvent; the emulator's model of it showed this). Returns whether every
// wait succeeded.
template <class Streams>
bool wait_for_own_work(Streams& s, typename Streams::Stream own, const CallEvents<typename Streams::Event>& events) {
  const bool stream_done = s.synchronize_stream(own);
  const bool replays_done = s.synchronize_event(events.replayed);
  return stream_done && replays_done;
}

}  // namespace ringcoll::cuda
