"""ringcoll in training: the torch.distributed backend (backend.py), the DDP communication
hook (ddp.py), ZeRO-1/2 sharded optimizer (zero/) and the two-level ring for several
machines (hierarchical.py). Built on the library (ringcoll.api, ringcoll.communicator)."""
