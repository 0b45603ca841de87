"""ringcoll's runtime errors. They are defined by the extension so C++ can raise them.

    RingcollError            base of every ringcoll runtime error (a RuntimeError)
      RingcollTimeoutError   a wait outlasted the communicator's timeout (also a TimeoutError)
      RingcollPeerError      a peer is gone (exited, or its communicator broke) while we waited
      RingcollMismatchError  ranks made different calls (collective, dtype, op or size) at the
                             same point; raised on every rank before any data moves

Argument errors are plain ValueError / TypeError raised before any data moves. After a
RingcollTimeoutError, RingcollPeerError or RingcollMismatchError the communicator is broken: every later call on
it raises RingcollError at once; build a new one (on a new process group if a rank died).
"""

from ringcoll._C import RingcollError, RingcollMismatchError, RingcollPeerError, RingcollTimeoutError

__all__ = ["RingcollError", "RingcollTimeoutError", "RingcollPeerError", "RingcollMismatchError"]
