// emulated_streams.cpp: the stream model of emulated_streams.h (which says what it models).
#include "emulated_streams.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "ringcoll/check.h"

namespace ringcoll::emulation {

Device::Device(int hardware_queues) {
  RINGCOLL_CHECK(hardware_queues >= 1 && hardware_queues <= 32, std::invalid_argument,
                 "emulated Device: hardware_queues must be in 1..32 (CUDA_DEVICE_MAX_CONNECTIONS), got ",
                 hardware_queues);
  queues_.resize(static_cast<size_t>(hardware_queues));
  streams_.push_back({0, /*blocking=*/true, 0, nullptr});  // the legacy default stream
  dispatcher_ = std::thread([this] { dispatch_loop(); });
}

Device::~Device() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  dispatcher_.join();
  for (auto& [op, worker] : workers_) worker.join();
}

int Device::create_stream(bool blocking) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int id = static_cast<int>(streams_.size());
  streams_.push_back({id % hardware_queues(), blocking, 0, nullptr});
  return id;
}

int Device::queue_of(int stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return stream_locked(stream).queue;
}

int Device::take_stream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!idle_streams_.empty()) {
      const int stream = idle_streams_.back();
      idle_streams_.pop_back();
      return stream;
    }
  }
  return create_stream(/*blocking=*/false);
}

void Device::give_back_stream(int stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  stream_locked(stream);
  idle_streams_.push_back(stream);
}

int Device::create_event() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!free_events_.empty()) {
    const int event = free_events_.back();
    free_events_.pop_back();
    events_[event] = Event{};
    return event;
  }
  events_.emplace_back();
  return static_cast<int>(events_.size()) - 1;
}

void Device::destroy_event(int event) {
  std::lock_guard<std::mutex> lock(mutex_);
  event_locked(event).live = false;
  free_events_.push_back(event);
}

Device::Stream& Device::stream_locked(int stream) {
  RINGCOLL_CHECK(stream >= 0 && stream < static_cast<int>(streams_.size()), std::invalid_argument,
                 "emulated Device: no stream ", stream);
  return streams_[stream];
}

Device::Event& Device::event_locked(int event) {
  RINGCOLL_CHECK(event >= 0 && event < static_cast<int>(events_.size()) && events_[event].live, std::invalid_argument,
                 "emulated Device: no event ", event);
  return events_[event];
}

// Queue one operation on `stream`, after `after` and after the stream's own last operation;
// the legacy stream's rule adds the other side's last work.
uint64_t Device::enqueue_locked(int stream, std::vector<uint64_t> after, Work work) {
  Stream& s = stream_locked(stream);
  after.push_back(s.last);
  if (stream == kLegacyStream) {
    for (const Stream& other : streams_)
      if (other.blocking) after.push_back(other.last);
  } else if (s.blocking) {
    after.push_back(streams_[kLegacyStream].last);
  }
  std::vector<uint64_t> pending;
  for (uint64_t op : after)
    if (!done_locked(op)) pending.push_back(op);
  const uint64_t id = next_op_++;
  waiting_[id] = Op{std::move(pending), std::move(work)};
  queues_[s.queue].push_back(id);
  s.last = id;
  changed_.notify_all();
  return id;
}

// A node `stream` adds to its capture: one more of its nodes that a join must cover.
void Device::capture_node_locked(int stream, Node node) {
  Stream& s = stream_locked(stream);
  s.capture->push_back(std::move(node));
  ++s.clock[stream];
}

void Device::record(int event, int stream, bool external) {
  std::lock_guard<std::mutex> lock(mutex_);
  Event& e = event_locked(event);
  Stream& s = stream_locked(stream);
  if (s.capture) {
    if (external) {
      capture_node_locked(stream, Node{{}, event});  // the replay records it for real
    } else {
      e.captured_in = s.capture;  // only a point inside the graph
      e.clock = s.clock;
      e.last_record_captured = true;
    }
    return;
  }
  e.captured_in = nullptr;
  e.last_record_captured = false;
  e.op = enqueue_locked(stream, {}, {});
}

void Device::wait(int stream, int event) {
  std::lock_guard<std::mutex> lock(mutex_);
  Event& e = event_locked(event);
  Stream& s = stream_locked(stream);
  if (e.captured_in) {  // a fork (the stream joins the capture) or a join: it now comes after e
    if (s.capture != e.captured_in) s.clock.clear();
    s.capture = e.captured_in;
    for (const auto& [other, nodes] : e.clock) s.clock[other] = std::max(s.clock[other], nodes);
    return;
  }
  refuse_captured_locked(event, "a stream's wait on");
  RINGCOLL_CHECK(!s.capture, std::logic_error, "emulated Device: stream ", stream,
                 " is capturing and waits on an event recorded outside the capture "
                 "(cudaErrorStreamCaptureIsolation)");
  enqueue_locked(stream, {e.op}, {});
}

void Device::launch(int stream, Work work) {
  std::lock_guard<std::mutex> lock(mutex_);
  Stream& s = stream_locked(stream);
  if (s.capture) {
    capture_node_locked(stream, Node{std::move(work), -1});
    return;
  }
  enqueue_locked(stream, {}, std::move(work));
}

bool Device::wait_until(double timeout, const std::function<bool()>& done) {
  std::unique_lock<std::mutex> lock(mutex_);
  return changed_.wait_for(lock, std::chrono::duration<double>(timeout), done);
}

bool Device::synchronize_stream(int stream, double timeout) {
  uint64_t last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = stream_locked(stream).last;
  }
  return wait_until(timeout, [&] { return done_locked(last); });
}

// An event whose last record was inside a capture is only a point in that graph: what a host
// or another stream would wait for does not exist (cudaErrorCapturedEvent).
void Device::refuse_captured_locked(int event, const char* what) {
  RINGCOLL_CHECK(!event_locked(event).last_record_captured, std::logic_error, "emulated Device: ", what, " event ",
                 event, ", last recorded in a capturing stream (cudaErrorCapturedEvent)");
}

bool Device::synchronize_event(int event, double timeout) {
  uint64_t op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_captured_locked(event, "a host sync on");
    op = event_locked(event).op;
  }
  return wait_until(timeout, [&] { return done_locked(op); });
}

bool Device::query_event(int event, int calling_stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Told the calling thread's stream: CUDA's rule for that thread (a thread that captures
  // may not query). Not told: the strictest reading of global mode, where any capture
  // under way forbids it on every thread.
  bool forbidden = false;
  if (calling_stream >= 0) {
    forbidden = static_cast<bool>(stream_locked(calling_stream).capture);
  } else {
    for (const Stream& s : streams_) forbidden = forbidden || static_cast<bool>(s.capture);
  }
  RINGCOLL_CHECK(!forbidden, std::logic_error, "emulated Device: a query of event ", event,
                 " while a stream is capturing (cudaErrorStreamCaptureUnsupported: a capture in global mode "
                 "forbids it on the capturing thread, and any capture on every other thread in that mode)");
  refuse_captured_locked(event, "a query of");
  return done_locked(event_locked(event).op);
}

bool Device::synchronize_device(double timeout) {
  uint64_t last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = next_op_ - 1;
  }
  return wait_until(timeout, [&] {
    return (waiting_.empty() || waiting_.begin()->first > last) && (running_.empty() || *running_.begin() > last);
  });
}

void Device::begin_capture(int stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Stream& s = stream_locked(stream);
  RINGCOLL_CHECK(stream != kLegacyStream, std::logic_error, "emulated Device: the legacy stream cannot capture");
  RINGCOLL_CHECK(!s.capture, std::logic_error, "emulated Device: stream ", stream, " is already capturing");
  s.capture = std::make_shared<Graph>();
  s.clock.clear();
}

bool Device::is_capturing(int stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(stream_locked(stream).capture);
}

int Device::end_capture(int stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Stream& origin = stream_locked(stream);
  std::shared_ptr<Graph> graph = origin.capture;
  RINGCOLL_CHECK(graph, std::logic_error, "emulated Device: stream ", stream, " is not capturing");
  std::string unjoined;  // the first stream whose last nodes the origin never waited for
  for (int other = 0; other < static_cast<int>(streams_.size()) && unjoined.empty(); ++other) {
    const Stream& s = streams_[other];
    if (other == stream || s.capture != graph) continue;
    const auto own = s.clock.find(other);
    const auto seen = origin.clock.find(other);
    const uint64_t nodes = own == s.clock.end() ? 0 : own->second;
    const uint64_t joined = seen == origin.clock.end() ? 0 : seen->second;
    if (joined < nodes)
      unjoined = "stream " + std::to_string(other) + " joined the capture and added " + std::to_string(nodes) +
                 " nodes; the origin waited for " + std::to_string(joined) + " of them";
  }
  // As cudaStreamEndCapture: the capture ends whether or not it is valid.
  for (Stream& s : streams_)
    if (s.capture == graph) {  // every stream that joined leaves with it
      s.capture = nullptr;
      s.clock.clear();
    }
  for (Event& e : events_)
    if (e.captured_in == graph) e.captured_in = nullptr;
  RINGCOLL_CHECK(unjoined.empty(), std::logic_error, "emulated Device: capturing stream ", stream,
                 " has unjoined work (cudaErrorStreamCaptureUnjoined): ", unjoined);
  graphs_.push_back(graph);
  return static_cast<int>(graphs_.size()) - 1;
}

void Device::replay(int graph, int stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  RINGCOLL_CHECK(graph >= 0 && graph < static_cast<int>(graphs_.size()), std::invalid_argument,
                 "emulated Device: no graph ", graph);
  RINGCOLL_CHECK(!stream_locked(stream).capture, std::logic_error, "emulated Device: replay on a capturing stream");
  for (const Node& node : *graphs_[graph]) {
    if (node.external_event >= 0) event_locked(node.external_event).op = enqueue_locked(stream, {}, {});
    else enqueue_locked(stream, {}, node.work);
  }
}

// The hardware: each queue dispatches from its head, in order, while the head's dependencies
// are done. A record or a wait is done once dispatched; a kernel runs on a thread of its own.
void Device::dispatch_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    bool dispatched = true;
    while (dispatched) {  // a dispatched record can unblock another queue's head
      dispatched = false;
      for (auto& queue : queues_) {
        while (!queue.empty()) {
          const uint64_t id = queue.front();
          Op& op = waiting_.at(id);
          bool ready = true;
          for (uint64_t before : op.after) ready = ready && done_locked(before);
          if (!ready) break;  // and everything behind it on this queue waits too
          queue.pop_front();
          Work work = std::move(op.work);
          waiting_.erase(id);
          dispatched = true;
          if (!work) continue;
          running_.insert(id);
          workers_[id] = std::thread([this, id, work = std::move(work)]() mutable {
            {
              // Run and destroy it before reporting finished: the dispatcher joins a finished
              // worker holding mutex_, and a Python function's reference takes the GIL as it
              // goes, which a Python thread blocked on mutex_ holds (Device.launch(stream, fn)
              // deadlocked so, 3 of 3 with 4 threads).
              Work run = std::move(work);
              run();
            }
            {
              std::lock_guard<std::mutex> done(mutex_);
              running_.erase(id);
              finished_.push_back(id);
            }
            changed_.notify_all();
          });
        }
      }
    }
    changed_.notify_all();  // host waits re-check: records and waits complete here
    for (uint64_t id : finished_) {
      workers_.at(id).join();  // it has left its critical section: a join is immediate
      workers_.erase(id);
    }
    finished_.clear();
    changed_.wait(lock);
  }
}

}  // namespace ringcoll::emulation
