// shm_segment.h: POSIX shared-memory segments, the host transport's registered buffers.
//
// Life of a segment (see HostComm's constructor for the choreography across ranks):
//   1. its name is drawn at random (128 bits from the kernel: unguessable), followed by its
//      maker's pid and pid namespace, and sent to every peer through the process group
//      *before* the segment exists;
//   2. the owner creates it with O_CREAT | O_EXCL and mode 0600 and maps it;
//   3. every peer maps it by name;
//   4. once all ranks have mapped all segments, every rank unlinks every name. From then on
//      nothing is left in /dev/shm: the memory lives exactly as long as the mappings, so
//      even a SIGKILL leaks nothing.
// Between 2 and 4 a name is in /dev/shm; if every rank dies there (a whole job killed while
// a communicator or a symmetric arena was being made: posix_fallocate of a large arena takes
// long enough to be hit), nobody is left to unlink it. So each segment made removes first
// the ones whose maker, in this pid namespace and by this user, has exited.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ringcoll::host {

// A fresh, unguessable segment name: "/ringcoll-<32 hex digits>-<pid>-<pid namespace>".
std::string random_segment_name();

// The inode of this process's pid namespace (0 where /proc cannot say).
uint64_t own_pid_namespace();
// False once `pid` has exited, including as a zombie its parent has not reaped yet.
bool process_alive(int64_t pid);
// The pid that drew `name` (random_segment_name's, or an arena's made from one) where it
// ran in this process's pid namespace; 0 for any other name.
int64_t segment_maker(const std::string& name);
// Unlink every segment in /dev/shm named by random_segment_name (or an arena's name made
// from one) whose maker ran in this pid namespace, as this user, and has exited; returns
// how many. A maker's pid reused since only keeps a name, never removes a live one.
int remove_segments_of_exited_makers();

// One mapping of a segment into this process. Move-only; unmaps on destruction.
class SegmentMapping {
 public:
  SegmentMapping() = default;
  // Create the segment (exclusively, mode 0600), size it and map it. Errors name the
  // owner's rank, never the segment name (names stay out of logs).
  static SegmentMapping create(const std::string& name, size_t bytes, int owner_rank);
  // Map an existing segment of at least `bytes`; returns an empty mapping if it does not
  // exist (yet). Throws on any other failure.
  static SegmentMapping try_open(const std::string& name, size_t bytes, int owner_rank);

  SegmentMapping(SegmentMapping&& other) noexcept { *this = std::move(other); }
  SegmentMapping& operator=(SegmentMapping&& other) noexcept;
  SegmentMapping(const SegmentMapping&) = delete;
  SegmentMapping& operator=(const SegmentMapping&) = delete;
  ~SegmentMapping() { unmap(); }

  void unmap();
  bool mapped() const { return base_ != nullptr; }
  char* base() const { return static_cast<char*>(base_); }
  size_t bytes() const { return bytes_; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

// Remove a name from /dev/shm; a name already gone is fine.
void unlink_segment(const std::string& name);

}  // namespace ringcoll::host
