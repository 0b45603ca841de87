"""Finding (the emulator's model of a GPU; a limitation ringcoll does not check): two ranks of
an in-process ring whose streams land on one hardware queue stop each other until the timeout,
and nothing refuses or names the cause, once the process has more streams than
CUDA_DEVICE_MAX_CONNECTIONS queues (32 under run_in_process).

check_hardware_queues (transports/cuda.py) only asks for P + 1 queues, but the device spreads
ALL of the process's streams over the queues (stream i on queue i mod 32): other communicators'
streams count too. Here 32 one-rank communicators hold streams 1..32; the one holding stream 1
closes (its stream goes idle); a 2-rank ring then takes stream 1 (queue 1) for one rank and a
new stream 33 (queue 1) for the other. Its calls time out. (The fuzzer, which keeps a few
communicators per world size open, met it as a flaky "timed out waiting for rank 4 to announce
its call" at P = 5.)

    PYTHONPATH=. python repro_shared_hardware_queue.py
"""
import threading

import torch

import ringcoll
from ringcoll.transports import emulated
from ringcoll.transports.emulated import EmulatedCudaTransport


class EmulatedCudaCommunicator(ringcoll.Communicator):
    @staticmethod
    def transport_class(device):
        return EmulatedCudaTransport


emulated.reset_device(32)
held, ready, release = [], threading.Event(), threading.Event()


def hold_streams(group):
    for _ in range(32):
        held.append(EmulatedCudaCommunicator(group=group, timeout=5))
    held.pop(0).close()  # stream 1 idle again
    ready.set()
    release.wait()
    for comm in held:
        comm.close()


def ring(group):
    with EmulatedCudaCommunicator(group=group, timeout=3) as comm:
        t = comm.transport
        where = f"rank {group.rank}: stream {t._own} on queue {t.device.queue_of(t._own)}"
        x = torch.ones(1000)
        try:
            for _ in range(3):
                comm.all_reduce(x, async_op=True).wait()
            return where + ": ok"
        except ringcoll.RingcollError as e:
            return where + f": {type(e).__name__}: {str(e)[:160]}"


holder = threading.Thread(target=ringcoll.run_in_process, args=(1, hold_streams), kwargs={"timeout": 60})
holder.start()
ready.wait(60)
try:
    for line in ringcoll.run_in_process(2, ring, timeout=60):
        print(line)
finally:
    release.set()
    holder.join(60)
