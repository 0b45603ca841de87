"""The lab: the seed chapter's claims about training, run on this machine.

    ringcoll lab straggler [--quick]   sync vs async training under one slow rank (seed 2.3)
    ringcoll lab overlap [--quick]     communication share, overlap and bucket size (seed 2.2, 2.4)
    ringcoll lab memory [--quick]      the memory ledger against DDP and ZeRO-1/2 runs (seed 1)

(also ``python -m ringcoll.learning.lab NAME``). Each experiment is a real training run of
P CPU ranks on scikit-learn's handwritten digits; it prints a table, writes NAME.json
(every figure the table prints) and NAME.png into ``--out`` (default ./lab-results).
``--quick`` is a small size that finishes in well under a minute (the tests run it); the
default size shows the effect. No figure is asserted anywhere: each run reports what it
measured, as ratios within the run. Reading order: common.py (data, model, report), then
one file per experiment.
"""

from .cli import EXPERIMENTS, main  # noqa: F401

__all__ = ["EXPERIMENTS", "main"]
