// check.h: ringcoll's error types and the one macro that raises them.
//
// Errors are C++ exceptions (never exit(), never abort()); the bindings translate them to
// Python: Error -> ringcoll.RingcollError, TimeoutError -> ringcoll.RingcollTimeoutError,
// PeerError -> ringcoll.RingcollPeerError, MismatchError -> ringcoll.RingcollMismatchError,
// std::invalid_argument -> ValueError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace ringcoll {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A bounded wait ran past the communicator's timeout.
struct TimeoutError : Error {
  using Error::Error;
};
// A peer is known to be gone (its process exited) while we waited for it.
struct PeerError : Error {
  using Error::Error;
};
// Ranks called different collectives (or with different dtype, op or size) at the same
// point; raised before any data moved.
struct MismatchError : Error {
  using Error::Error;
};

namespace detail {
template <typename E, typename... Parts>
[[noreturn]] inline void raise(const char* file, int line, const char* expr, Parts&&... parts) {
  std::ostringstream msg;
  (msg << ... << parts);
  msg << " [" << expr << " at " << file << ":" << line << "]";
  throw E(msg.str());
}
}  // namespace detail

// RINGCOLL_CHECK(cond, ErrorType, message parts...): throw ErrorType with the message, the
// failed condition and file:line when cond is false.
#define RINGCOLL_CHECK(cond, ErrorType, ...)                                            \
  do {                                                                                  \
    if (!(cond)) ::ringcoll::detail::raise<ErrorType>(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)

}  // namespace ringcoll

#if defined(__CUDACC__) || defined(RINGCOLL_WITH_CUDA)
#include <cuda_runtime_api.h>
// RINGCOLL_CUDA_CHECK(call): throw ringcoll::Error naming the call, the CUDA error and file:line.
// The thread's last error is cleared first: raised here, it must not come back at the next
// launch's cudaGetLastError (a failed cudaMalloc or cudaIpcOpenMemHandle that the caller
// survives would fail a later, good launch). A sticky error (a kernel's fault) stays.
#define RINGCOLL_CUDA_CHECK(call)                                                         \
  do {                                                                                    \
    cudaError_t rc_err_ = (call);                                                         \
    if (rc_err_ != cudaSuccess) {                                                         \
      (void)cudaGetLastError();                                                           \
      ::ringcoll::detail::raise<::ringcoll::Error>(__FILE__, __LINE__, #call, "CUDA error: ", \
                                                   cudaGetErrorString(rc_err_));          \
    }                                                                                     \
  } while (0)
#endif
