"""Defect: on the CUDA transport (run here by the emulator), Communicator._plan's buffer
check accepts a plan that the kernels' launch then refuses.

_plan checks  buffer_bytes >= plan.chunks * 2 * 128  (two banks of one slot per chunk), but
the kernels cut the plan's slots out of the ring's data area, kBanks x P slots of
buffer_bytes / (2 P) rounded DOWN to 128 bytes (kernel_abi.h, plan_slot_bytes). At P = 3,
buffer_bytes = 4096: ring slot 640, data area 3840 < 16 x 256 = 4096, so a 16-chunk plan
(the rooted ring / star pipelines) passes Python's check and the launch raises ValueError on
every rank, where the CPU transport runs the same call. `native` broadcast / reduce fail
too above small_bytes (64 KiB): native falls back to the one-shot only where Python's check
says the pipeline does not fit. The communicator stays usable (the next call runs).
(Found while sizing ringcoll/harness/fuzz_cuda.py's buffers, whose draw now leaves these out:
EmulatedSpace.plan_fits.)

    PYTHONPATH=. python repro_plan_buffer_check.py
"""
import torch

import ringcoll
from ringcoll.transports.emulated import EmulatedCudaTransport


class EmulatedCudaCommunicator(ringcoll.Communicator):
    @staticmethod
    def transport_class(device):
        return EmulatedCudaTransport


def body(group, cls, algorithm, collective):
    with cls(group=group, buffer_bytes=4096, timeout=20) as comm:
        x = torch.full((300_000,), float(group.rank + 1))  # 1.2 MB: over small_bytes
        try:
            if collective == "broadcast":
                comm.broadcast(x, 0, algorithm=algorithm)
            else:
                comm.reduce(x, 0, algorithm=algorithm)
            result = "ok"
        except Exception as e:  # noqa: BLE001
            result = f"{type(e).__name__}: {e}"
        usable = torch.ones(4)
        comm.all_reduce(usable)  # is the communicator still usable?
        return result, "usable after" if bool((usable == group.world_size).all()) else "WRONG after"


for collective, algorithm in (("broadcast", "ring"), ("broadcast", "star"), ("broadcast", "native"),
                              ("reduce", "native")):
    for name, cls in (("cpu", ringcoll.Communicator), ("emulated cuda", EmulatedCudaCommunicator)):
        print(f"{collective} {algorithm:6} {name:13}: ", ringcoll.run_in_process(3, body, cls, algorithm, collective,
                                                                            timeout=60)[0])
