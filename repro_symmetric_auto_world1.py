"""Defect: on the CUDA transport (run here by the emulator), a 1-rank communicator that has
symmetric memory (comm.empty) raises ValueError on every auto call of the ring's three
collectives, where the CPU transport runs them.

Communicator._plan sends auto over symmetric memory on CUDA to _symmetric_auto, which builds
_C.plan_with_fallback(direct, ring). At P = 1 the direct plan reads no peer's memory (there
is no peer), so plan_with_fallback refuses it: "the primary plan must read peers' memory
where it lies and the fallback must not" (plan.h:138). The call never reaches the kernels.
(Found by ringcoll/harness/fuzz_cuda.py, seed 1, first example.)

    PYTHONPATH=. python repro_symmetric_auto_world1.py
"""
import torch

import ringcoll
from ringcoll.transports.emulated import EmulatedCudaTransport


class EmulatedCudaCommunicator(ringcoll.Communicator):
    @staticmethod
    def transport_class(device):
        return EmulatedCudaTransport


def body(group, cls, collective):
    with cls(group=group, timeout=20) as comm:
        x = comm.empty(8, dtype=torch.float32).fill_(1.0)
        out = comm.empty(8 * group.world_size, dtype=torch.float32)
        try:
            if collective == "all_reduce":
                comm.all_reduce(x)
            elif collective == "all_gather":
                comm.all_gather_into_tensor(out, x)
            else:
                comm.reduce_scatter_tensor(x[:8 // group.world_size], out[:8].fill_(1.0))
            return "ok"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"


for world in (1, 2):
    for collective in ("all_reduce", "all_gather", "reduce_scatter"):
        for name, cls in (("cpu", ringcoll.Communicator), ("emulated cuda", EmulatedCudaCommunicator)):
            print(f"P={world} {collective:14} {name:13}:", ringcoll.run_in_process(world, body, cls, collective,
                                                                                 timeout=60)[0])
