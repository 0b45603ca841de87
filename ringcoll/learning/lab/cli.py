"""``ringcoll lab NAME``: parse the options of one experiment and run it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import List, Optional

from ringcoll.learning.options import number

from . import memory, overlap, straggler

EXPERIMENTS = {"straggler": straggler, "overlap": overlap, "memory": memory}


def add_parser(sub) -> None:
    """``lab`` as a subcommand of ``ringcoll`` (learning/cli.py)."""
    p = sub.add_parser("lab", help="run one of the training experiments (straggler, overlap, memory)",
                       description=__import__("ringcoll.learning.lab", fromlist=["x"]).__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(p)
    p.set_defaults(func=run_args)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=list(EXPERIMENTS))
    p.add_argument("--quick", action="store_true", help="the small size (under a minute; what the tests run)")
    p.add_argument("--out", default="lab-results", help="folder for NAME.json and NAME.png (default lab-results)")
    p.add_argument("--world", "-P", type=_worlds,
                   help="ranks (straggler: workers, one number; overlap, memory: one or a list, e.g. 2,4)")
    p.add_argument("--seeds", type=number(int), help="straggler: seeds to average over")
    p.add_argument("--slow", type=number(float, least=0, above=None),
                   help="straggler: how much slower the slow rank is (0.1 = 10%%)")
    p.add_argument("--epochs", type=number(float), help="straggler: passes over the training set per run")
    p.add_argument("--staleness", type=number(int, least=0, above=None),
                   help="straggler: S, the most steps a worker may run ahead (bounded)")
    p.add_argument("--local-every", type=number(int), help="straggler: H, steps between model averages (local SGD)")
    p.add_argument("--steps", type=number(int),
                   help="overlap: timed steps per configuration; memory: Adam steps before the count")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _worlds(text: str):
    try:
        worlds = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or a list like 2,4, got {text!r}") from None
    if any(w < 2 for w in worlds):
        raise argparse.ArgumentTypeError(f"every world size must be at least 2, got {text!r}")
    return worlds


def _config(args: argparse.Namespace):
    module = EXPERIMENTS[args.name]
    cfg = module.QUICK if args.quick else module.Config()
    given = {"seeds": args.seeds, "slow_fraction": args.slow, "epochs": args.epochs, "staleness": args.staleness,
             "local_every": args.local_every, "steps": args.steps}
    fields = {f.name for f in dataclasses.fields(cfg)}
    changes = {k: v for k, v in given.items() if v is not None}
    wrong = sorted(set(changes) - fields)
    if wrong:
        raise ValueError(f"lab {args.name}: --{wrong[0].replace('_', '-')} does not apply to this experiment")
    if args.world is not None:
        if "world" in fields:
            if len(args.world) != 1:
                raise ValueError(f"lab {args.name}: --world takes one number here, got {list(args.world)}")
            changes["world"] = args.world[0]
        else:
            changes["worlds"] = args.world
    if args.no_progress:
        changes["progress"] = False
    return dataclasses.replace(cfg, **changes)


def run_args(args: argparse.Namespace) -> int:
    EXPERIMENTS[args.name].run(_config(args), out_dir=args.out)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringcoll.learning.lab",
                                description=__import__("ringcoll.learning.lab", fromlist=["x"]).__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(p)
    args = p.parse_args(argv)
    try:
        return run_args(args)
    except ValueError as err:
        print(f"ringcoll lab: {err}", file=sys.stderr)
        return 2
