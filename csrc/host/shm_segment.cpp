#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ringcoll/check.h"

namespace ringcoll::host {

std::string random_segment_name() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    RINGCOLL_CHECK(n > 0 || errno == EINTR, Error, "getrandom failed: ", std::strerror(errno));
    if (n > 0) got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string name = "/ringcoll-";
  for (unsigned char b : bytes) {
    name += kHex[b >> 4];
    name += kHex[b & 15];
  }
  return name;
}

namespace {
// Map `bytes` of an open descriptor, then close the descriptor: the mapping keeps the
// memory alive, so no file descriptor stays open per segment.
void* map_and_close(int fd, size_t bytes, int owner_rank) {
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int saved = errno;
  close(fd);
  RINGCOLL_CHECK(base != MAP_FAILED, Error, "mmap of rank ", owner_rank, "'s shared-memory segment (", bytes,
                 " bytes) failed: ", std::strerror(saved));
  return base;
}

// What /dev/shm has room for, for the message of a segment that did not fit.
std::string shm_space() {
  struct statvfs fs {};
  if (statvfs("/dev/shm", &fs) != 0) return "";
  const auto mib = [&](fsblkcnt_t blocks) { return std::to_string(blocks * fs.f_frsize >> 20); };
  return " (/dev/shm has " + mib(fs.f_bavail) + " of " + mib(fs.f_blocks) +
         " MiB free; a container's is 64 MiB unless raised, e.g. docker run --shm-size=1g; "
         "RINGCOLL_BUFFER_BYTES sets the transport's own segment)";
}
}  // namespace

SegmentMapping SegmentMapping::create(const std::string& name, size_t bytes, int owner_rank) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR);
  RINGCOLL_CHECK(fd >= 0, Error, "creating rank ", owner_rank, "'s shared-memory segment failed: ",
                 std::strerror(errno));
  // fchmod: the umask may have narrowed the mode, never widened it, but say 0600 exactly.
  // posix_fallocate, not ftruncate: it gives the segment its pages now, so a /dev/shm too
  // small for it is an error here; a segment only sized had no pages behind it, and the
  // first write to one the tmpfs could not supply killed the process with SIGBUS.
  int failure = fchmod(fd, S_IRUSR | S_IWUSR) != 0 ? errno : 0;
  if (failure == 0) {
    do failure = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    while (failure == EINTR);
  }
  if (failure != 0) {
    close(fd);
    shm_unlink(name.c_str());
    RINGCOLL_CHECK(false, Error, "sizing rank ", owner_rank, "'s shared-memory segment to ", bytes,
                   " bytes failed: ", std::strerror(failure), failure == ENOSPC ? shm_space() : "");
  }
  SegmentMapping m;
  try {
    m.base_ = map_and_close(fd, bytes, owner_rank);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
  m.bytes_ = bytes;
  return m;
}

SegmentMapping SegmentMapping::try_open(const std::string& name, size_t bytes, int owner_rank) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0 && errno == ENOENT) return {};
  RINGCOLL_CHECK(fd >= 0, Error, "opening rank ", owner_rank, "'s shared-memory segment failed: ",
                 std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    // The owner has created but not yet sized it: treat as not there yet.
    close(fd);
    return {};
  }
  SegmentMapping m;
  m.base_ = map_and_close(fd, bytes, owner_rank);
  m.bytes_ = bytes;
  return m;
}

SegmentMapping& SegmentMapping::operator=(SegmentMapping&& other) noexcept {
  if (this != &other) {
    unmap();
    base_ = other.base_;
    bytes_ = other.bytes_;
    other.base_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void SegmentMapping::unmap() {
  if (base_ != nullptr) munmap(base_, bytes_);
  base_ = nullptr;
  bytes_ = 0;
}

void unlink_segment(const std::string& name) { shm_unlink(name.c_str()); }

}  // namespace ringcoll::host
