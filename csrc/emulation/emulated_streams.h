// emulated_streams.h: a model of one CUDA device's streams, for the emulator (CI has no GPU).
//
// What made the in-process deadlock of issue 22 invisible to CI was that the emulator ran
// every call at once on the host. A GPU does not: work goes into streams, and this models
// the rules that decide when it runs.
//
//   stream          an in-order queue: an operation starts only when everything queued
//                   before it on its stream has finished. Stream 0 is the legacy default
//                   stream, shared by every thread of the process. A "blocking" stream (the
//                   CUDA default flags) is also ordered against the legacy stream both ways;
//                   a non-blocking one (cudaStreamNonBlocking, torch's pool) is not.
//   event           record(e, s) marks the point s has reached; wait(s2, e) makes s2's later
//                   work wait for that point (cudaStreamWaitEvent: on the device, not the host).
//   hardware queue  streams are spread over a fixed number of in-order queues
//                   (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default): stream i on queue i mod N.
//                   A queue dispatches its head only once the head's dependencies are done,
//                   and nothing behind a blocked head is dispatched, whatever stream it is
//                   on: two streams on one queue are falsely ordered.
//   kernel          once dispatched it runs (here: on a host thread) until it returns; a
//                   queue goes on dispatching behind a running kernel, so kernels of
//                   different streams run concurrently, as they do on a GPU with free SMs.
//   implicit sync   cudaFree / cudaMalloc (and cudaDeviceSynchronize) wait for all work
//                   already queued on the device, every stream's: synchronize_device.
//   graph capture   a capturing stream records work instead of running it; a stream that
//                   waits on an event recorded in the capture joins it (a fork); replay queues
//                   the recorded work again. An event recorded in a capture changes nothing a
//                   host can see on replay, unless recorded as external (cudaEventRecordExternal).
//                   An event last recorded in a capture (not external) is a point in the
//                   graph only: after the capture a host query, sync or stream wait on it
//                   fails (cudaErrorCapturedEvent); and a thread whose stream is capturing
//                   may not query events at all (cudaErrorStreamCaptureUnsupported: torch's
//                   graphs capture in global mode, where such calls are forbidden).
//                   Ending the capture requires every fork joined back: the origin stream
//                   must have waited (directly or through other streams) on an event recorded
//                   after the last node of every stream that joined, external records
//                   included, else cudaErrorStreamCaptureUnjoined. Tracked with vector clocks:
//                   each capturing stream knows how many nodes of each stream precede it.
//
// What it does not model: SM occupancy (every dispatched kernel runs, as if the grids of all
// ranks fit on the GPU at once: kernel_abi.h's max_blocks_for sizes them so), the memory
// model, copy engines, priorities, and which stream really lands on which hardware queue
// (the driver's assignment is not documented; round-robin by creation is the usual reading).
//
// Host waits here are bounded (a real cudaStreamSynchronize is not): a model stuck in its
// queues reports it instead of hanging CI. Thread-safe: every method may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <deque>
#include <thread>
#include <vector>

namespace ringcoll::emulation {

class Device {
 public:
  using Work = std::function<void()>;
  static constexpr int kLegacyStream = 0;

  explicit Device(int hardware_queues);
  ~Device();  // waits for the kernels that are running; drops work never dispatched
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  int hardware_queues() const { return static_cast<int>(queues_.size()); }
  int create_stream(bool blocking);  // cudaStreamCreateWithFlags
  int queue_of(int stream);          // the hardware queue `stream` is on
  // The communicators' streams, lent as CudaComm's StreamLender does (an idle one again
  // before a new one), so a long run does not spread ever more streams over the queues.
  int take_stream();
  void give_back_stream(int stream);
  int create_event();
  void destroy_event(int event);  // its number may be handed out again

  void record(int event, int stream, bool external = false);  // cudaEventRecord[WithFlags]
  void wait(int stream, int event);                           // cudaStreamWaitEvent
  void launch(int stream, Work work);                         // a kernel, or an async copy

  // Host waits: true once done, false after `timeout` seconds.
  bool synchronize_stream(int stream, double timeout);  // cudaStreamSynchronize
  bool synchronize_event(int event, double timeout);    // cudaEventSynchronize (never recorded: at once)
  // cudaEventQuery from a thread whose current stream is `calling_stream` (-1: not told, so
  // forbidden while any stream captures).
  bool query_event(int event, int calling_stream = -1);
  bool synchronize_device(double timeout);              // cudaDeviceSynchronize; what cudaFree/cudaMalloc imply

  void begin_capture(int stream);  // cudaStreamBeginCapture
  bool is_capturing(int stream);   // cudaStreamIsCapturing
  int end_capture(int stream);     // cudaStreamEndCapture: the graph's number
  void replay(int graph, int stream);  // cudaGraphLaunch

 private:
  struct Op {
    std::vector<uint64_t> after;  // operations that must finish first
    Work work;                    // empty for a record or a wait: done once dispatched
  };
  struct Node {  // one operation of a captured graph
    Work work;
    int external_event = -1;  // >= 0: an external event record, replayed as a real one
  };
  using Graph = std::vector<Node>;
  // In a capture: stream -> how many of its captured nodes come before this point.
  using CaptureClock = std::map<int, uint64_t>;
  struct Stream {
    int queue;
    bool blocking;
    uint64_t last = 0;  // the last operation queued on it (0: none)
    std::shared_ptr<Graph> capture;
    CaptureClock clock;  // while capturing: what this stream's next node comes after
  };
  struct Event {
    uint64_t op = 0;  // the record operation it stands for (0: never recorded, or done long ago)
    std::shared_ptr<Graph> captured_in;  // recorded inside this capture (for joins)
    CaptureClock clock;                  // recorded in a capture: the recording stream's clock then
    bool last_record_captured = false;   // its last record was inside a capture (cudaErrorCapturedEvent)
    bool live = true;
  };

  uint64_t enqueue_locked(int stream, std::vector<uint64_t> after, Work work);
  void capture_node_locked(int stream, Node node);
  bool done_locked(uint64_t op) const { return op == 0 || (!waiting_.count(op) && !running_.count(op)); }
  bool wait_until(double timeout, const std::function<bool()>& done);
  Stream& stream_locked(int stream);
  Event& event_locked(int event);
  void refuse_captured_locked(int event, const char* what);
  void dispatch_loop();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::deque<uint64_t>> queues_;
  std::vector<Stream> streams_;
  std::vector<int> idle_streams_;
  std::vector<Event> events_;
  std::vector<int> free_events_;
  std::vector<std::shared_ptr<Graph>> graphs_;
  std::map<uint64_t, Op> waiting_;  // queued, not dispatched
  std::set<uint64_t> running_;      // dispatched kernels still running
  std::map<uint64_t, std::thread> workers_;
  std::vector<uint64_t> finished_;  // workers to join
  uint64_t next_op_ = 1;
  bool stopping_ = false;
  std::thread dispatcher_;
};

}  // namespace ringcoll::emulation
