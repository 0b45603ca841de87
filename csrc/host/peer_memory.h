// peer_memory.h: reading another process's memory directly (Linux cross-memory attach).
//
// process_vm_readv copies from a peer's address space into ours in one pass, inside the
// kernel, with no shared buffer in between: this is what Open MPI's shared-memory
// transport calls CMA (single copy). The host all-gather uses it for large messages
// (host_comm.cpp, "The direct-read all-gather"): a rank reads each peer's input straight
// into its own output instead of the peer first copying it into a shared slot.
//
// The kernel allows it only where the reader could ptrace the peer: same user (or
// CAP_SYS_PTRACE), the peer dumpable, and under Yama's ptrace_scope = 1 the peer must have
// named its readers (allow_peer_reads). A rank therefore *probes* every peer once at
// bootstrap and all ranks use direct reads only if every probe worked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ringcoll::host {

// Let processes of the same user read this one (Yama's PR_SET_PTRACER, as Open MPI does);
// a no-op where Yama is absent. Only called when direct reads are enabled.
void allow_peer_reads();

// Copy `bytes` from address `remote` of process `pid` to `local`. Returns "" on success,
// else why not (the system's error text); a short read counts as a failure.
std::string read_peer_memory(int64_t pid, uint64_t remote, void* local, size_t bytes);

}  // namespace ringcoll::host
