"""spawn() for P processes sharing this one GPU: each rank gets the driver's default number of
hardware queues (CUDA_DEVICE_MAX_CONNECTIONS unset), whatever this process was given.

Why: under MPS every client's queues come out of one pool that the server's clients share
(NVIDIA's MPS guide, CUDA_DEVICE_MAX_CONNECTIONS), and a client owns its share. The
in-process mode wants 32 for P threads x 2 streams (ringcoll.run_in_process; the device
check exports it), but 32 for each of 4 processes exhausted the pool on an H200: P = 2 and 3
ran, P = 4 failed in torch.cuda.set_device with "CUDA error: out of memory" (2026-12-04,
bench/results/2026-12-04-h200-device-check.txt). A rank of the multi-process mode uses two
streams, so the default 8 is plenty.
"""

from ringcoll.harness.launcher import spawn as _spawn


def spawn(fn, world_size, *args, env=None, **kwargs):
    return _spawn(fn, world_size, *args, env={"CUDA_DEVICE_MAX_CONNECTIONS": None, **(env or {})}, **kwargs)
