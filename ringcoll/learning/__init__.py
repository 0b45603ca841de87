"""ringcoll for learning: the ring schedule mirrored in Python (schedule.py, tied to ring.h
by tests), step-by-step traces (trace.py), the memory ledger of training (memory.py), the
alpha-beta cost model (model.py) and the ``ringcoll`` command that shows them (cli.py).
Nothing here moves data between processes."""
