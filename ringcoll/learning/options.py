"""argparse types the teaching tools' commands share (ringcoll, ringcoll lab, the model's)."""

from __future__ import annotations

import argparse
import math
from typing import Optional


def number(kind: type, least: Optional[float] = None, above: Optional[float] = 0):
    """An argparse type for the teaching tools' options: a finite number of `kind`, above
    `above` and at least `least` where given (--params 0.4 counted no parameter, --params inf
    overflowed, --local-every 0 divided by zero in a rank)."""
    def parse(text: str):
        value = kind(text)
        bounds = []  # the bounds it misses
        if above is not None and not value > above:
            bounds.append(f"above {above:g}")
        if least is not None and not value >= least:
            bounds.append(f"at least {least:g}")
        if bounds or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {' and '.join(bounds) or 'within range'}, "
                                             f"got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse
