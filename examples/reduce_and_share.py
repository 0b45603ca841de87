"""An all-reduce in which one rank adds everything up and the others read its result where it
lies (docs/algorithms.md, "Sharing an output").

Every rank but 0 publishes its input to rank 0; rank 0 adds the P inputs, in rank order,
into its output, and shares that output with the others (SHARE_OUTPUT): instead of copying
the result into a slot for them, it tells them it is there, and each copies it straight
out of rank 0's output into its own. Rank 0 receives (P-1) n bytes, so this loses to the
ring beyond a few ranks; what it shows is the two ways a value can travel: through a slot
(the inputs) and where it lies (the result).

    ringcoll trace all_reduce -P 3 -n 6 --plans examples/reduce_and_share.py --algorithm share
    ringcoll-bench --plans examples/reduce_and_share.py --algorithm auto,ring,share --collectives all_reduce
"""

import ringcoll
from ringcoll.plans import INPUT, PEER, SHARE_OUTPUT, TO_OUTPUT, TO_SLOT, TO_WORK, WORK, op


def reduce_and_share(world, rank):
    """This rank's ops: the whole message is one chunk (chunk 0)."""
    others = range(1, world)
    if rank != 0:  # my input to rank 0, then rank 0's result, read out of its output
        return [op(INPUT, 0, TO_SLOT, readers=[0]), op(PEER, 0, TO_OUTPUT, frm=0)]
    ops = []
    value = INPUT  # rank 0's input first, then each peer's in rank order: one order for all
    for peer in others:
        last = peer == world - 1
        place = TO_OUTPUT | SHARE_OUTPUT if last else TO_WORK  # the sum, once complete, shared
        ops.append(op(value, 0, place, b=PEER, frm=peer, readers=others if last else [], final=last))
        value = WORK
    return ops


ringcoll.register_algorithm("share", reduce_and_share)
