#include "shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

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
  return name + "-" + std::to_string(getpid()) + "-" + std::to_string(own_pid_namespace());
}

uint64_t own_pid_namespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

bool process_alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat_file("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat_file, line)) return true;  // cannot tell: assume alive
  const size_t close_paren = line.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= line.size()) return true;
  const char state = line[close_paren + 2];
  return state != 'Z' && state != 'X';
}

namespace {
// The maker's pid of a name random_segment_name drew in pid namespace `ns` (after an
// arena's "-arena<i>" too; with or without the leading '/'), or 0 for any other name.
int64_t maker_in(const std::string& full_name, uint64_t ns) {
  const std::string name = full_name.empty() || full_name[0] != '/' ? full_name : full_name.substr(1);
  const std::string prefix = "ringcoll-";
  if (name.compare(0, prefix.size(), prefix) != 0 || name.size() < prefix.size() + 32 + 4) return 0;
  const char* p = name.c_str() + prefix.size() + 32;
  if (*p != '-') return 0;
  char* end = nullptr;
  const long long pid = std::strtoll(p + 1, &end, 10);
  if (end == p + 1 || *end != '-' || pid <= 0) return 0;
  const char* ns_begin = end + 1;
  const unsigned long long made_in = std::strtoull(ns_begin, &end, 10);
  if (end == ns_begin || made_in != ns || (*end != '\0' && std::strncmp(end, "-arena", 6) != 0)) return 0;
  return pid;
}
}  // namespace

int64_t segment_maker(const std::string& name) {
  const uint64_t ns = own_pid_namespace();
  return ns == 0 ? 0 : maker_in(name, ns);
}

int remove_segments_of_exited_makers() {
  const uint64_t ns = own_pid_namespace();
  DIR* dir = ns == 0 ? nullptr : opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    const int64_t maker = maker_in(name, ns);
    struct stat st {};
    if (maker == 0 || process_alive(maker)) continue;
    if (fstatat(dirfd(dir), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid())
      continue;  // only this user's own segments
    removed += shm_unlink(("/" + name).c_str()) == 0;
  }
  closedir(dir);
  return removed;
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
  remove_segments_of_exited_makers();  // a job killed whole while making its segments (the header)
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
