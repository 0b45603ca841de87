"""A bidirectional ring all-reduce written as a plan (docs/algorithms.md walks through it).

The message is cut into 2P chunks: chunks 0..P-1 go round the ring to the right, chunks
P..2P-1 to the left, at the same time, so each link carries traffic both ways. Each half
is the ring of ring.h: P-1 reduce-scatter steps (receive a partial, add my input's copy,
pass it on), then P-1 all-gather steps (receive a finished chunk, keep it, pass it on).

    ringcoll trace all_reduce -P 3 -n 12 --plans examples/bidirectional_ring.py --algorithm bidir
    ringcoll-bench --plans examples/bidirectional_ring.py --algorithm auto,ring,bidir --collectives all_reduce
"""

import ringcoll
from ringcoll.plans import INPUT, PEER, TO_OUTPUT, TO_SLOT, Operand, op


def bidirectional_ring(world, rank):
    """This rank's ops: for every step, one op per direction."""
    ops = []
    for step in range(-1, 2 * (world - 1)):  # step -1: the first publication, before any receive
        for d, base in ((+1, 0), (-1, world)):  # to the right with chunks 0..P-1, to the left with P..2P-1
            nxt, prv = (rank + d) % world, (rank - d) % world

            def chunk(i):  # the chunk this rank handles i steps after its first send (the ring's k - i)
                return base + (rank - d * i) % world

            if step == -1:
                ops.append(op(INPUT, chunk(1), TO_SLOT, readers=[nxt]))
                continue
            reduces = step < world - 1  # the reduce-scatter half: add my input's copy
            final = step >= world - 2  # from the last add on, the chunk is finished: to the output
            last = step == 2 * (world - 1) - 1  # nobody needs the last chunk passed on
            ops.append(op(PEER, chunk(step + 2), (TO_OUTPUT if final else 0) | (0 if last else TO_SLOT),
                          b=INPUT if reduces else Operand.NONE, frm=prv, readers=[] if last else [nxt],
                          final=final))
    return ops


ringcoll.register_algorithm("bidir", bidirectional_ring)
