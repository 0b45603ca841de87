"""The ``ringcoll`` command: teaching tools.

    ringcoll trace COLLECTIVE --world P --n N [--png FILE] [--algorithm ring|oneshot|direct|symmetric]
        a ring collective step by step (ringcoll.learning.trace), from the real schedule;
        --algorithm oneshot shows the small-message path instead, --algorithm direct the
        peers' inputs read where they lie (the CPU transport's direct-read all-gather, the
        direct reduce-scatter and all-reduce plans), --algorithm symmetric a call over
        symmetric memory, read in place
    ringcoll memory --params N [--world P] [--batch B --seq S --hidden H --layers L --heads A]
                    [--no-attention-scores] [--measure [--device D]]
        per-GPU memory of Adam training, ZeRO stages 0-3 (ringcoll.learning.memory)

    ringcoll lab NAME [--quick] [--out DIR] ...
        the training experiments (ringcoll.learning.lab): straggler, overlap, memory

The benchmark is a separate command, ``ringcoll-bench``.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ringcoll._types import ROOTED_COLLECTIVES
from ringcoll.learning import memory, trace
from ringcoll.learning.options import number


def _run_trace(args: argparse.Namespace) -> int:
    if args.plans:
        from ringcoll import plans

        plans.load_plans(args.plans)
    text = trace.trace(args.collective, args.world, args.n, algorithm=args.algorithm)
    print(text, end="")
    if trace.MISMATCH in text or trace.REFUSED in text:  # said above, in the trace's last lines
        return 1
    if args.png and args.algorithm != "ring":
        why = {"oneshot": "the one-shot path has a single step", "direct": "the direct read takes no ring steps",
               "symmetric": "reading symmetric memory in place takes no ring steps"}
        raise ValueError(f"--png draws the ring's steps; "
                         f"{why.get(args.algorithm, f'{args.algorithm} is not a ring')}, shown above")
    if args.png:
        fig = trace.draw(args.collective, args.world, args.n, path=args.png)
        print(f"wrote {args.png} ({fig.ringcoll_panels} panels, one per ring step)")
    return 0


def _shape(args: argparse.Namespace) -> Optional[memory.TransformerShape]:
    given = [args.hidden, args.layers, args.heads]
    if all(v is None for v in given):
        return None
    if any(v is None for v in given):
        raise ValueError("memory: activations need --hidden, --layers and --heads together")
    return memory.TransformerShape(batch=args.batch, seq=args.seq, hidden=args.hidden,
                                   layers=args.layers, heads=args.heads)


def _run_memory(args: argparse.Namespace) -> int:
    precisions = ("mixed", "mixed+master") if args.precision == "both" else (args.precision,)
    shape = _shape(args)
    if args.no_attention_scores and shape is None:
        raise ValueError("memory: --no-attention-scores changes the activations, which need --hidden, --layers "
                         "and --heads")
    if args.device is not None and not args.measure:
        raise ValueError("memory: --device is where --measure runs; give --measure too")
    if args.measure:  # before the table, so a bad device is an error, not a traceback after it
        memory.check_measure_device(args.device)
    print(memory.format_ledgers(args.params, args.world, shape, not args.no_attention_scores,
                                precisions), end="")
    if args.measure:
        print()
        print(memory.format_measurement(memory.measure(device=args.device)), end="")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringcoll", description="ringcoll's teaching tools: ring traces and "
                                "the memory ledger of data-parallel training (the benchmark is ringcoll-bench)")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("trace", help="print (and draw) a ring collective step by step",
                       description="Run a ring collective on small integers with ringcoll.learning.schedule.simulate "
                                   "and print, step by step, the chunk each rank sends, receives and reduces, "
                                   "and what every rank holds.")
    t.add_argument("collective", choices=[*trace.COLLECTIVES, *sorted(ROOTED_COLLECTIVES)])
    t.add_argument("--world", "-P", type=int, default=4, help="ranks (default 4)")
    t.add_argument("--n", "-n", type=int, default=8, help="elements in the message (default 8)")
    t.add_argument("--png", metavar="FILE", help="also draw the ring's steps (one panel per step) into FILE "
                                                 "(the ring only: other algorithms are traced as text)")
    t.add_argument("--algorithm", default="ring",
                   help="ring (default); oneshot: the CPU transport's small-message path; direct: its "
                        "direct-read path: peers' inputs read where they lie (all_gather, reduce_scatter, all_reduce); "
                        "symmetric: tensors in "
                        "symmetric memory (ringcoll.empty), read in place; any other algorithm "
                        "(rhd, rd, tree: ringcoll.algorithms()) round by round from its plan")
    t.add_argument("--plans", metavar="FILE.py", default=None,
                   help="a Python file that registers plans (ringcoll.register_algorithm): its names are then "
                        "--algorithm names")
    t.set_defaults(func=_run_trace)

    m = sub.add_parser("memory", help="per-GPU memory of Adam training, ZeRO stages 0-3",
                       description="Weights, gradients, Adam state and activations per GPU, in decimal GB "
                                   "(1e9 bytes), for ZeRO stages 0-3 over --world ranks.")
    m.add_argument("--params", "-N", type=number(float, least=1), required=True, help="parameters, e.g. 7e9")
    m.add_argument("--world", "-P", type=number(int), default=8, help="data-parallel ranks (default 8)")
    m.add_argument("--precision", choices=["both", *memory.PRECISIONS], default="both",
                   help="which convention(s) to print (default: mixed and mixed+master)")
    m.add_argument("--batch", type=number(int), default=1, help="micro-batch per GPU, for activations (default 1)")
    m.add_argument("--seq", type=number(int), default=2048, help="sequence length (default 2048)")
    m.add_argument("--hidden", type=number(int), help="hidden size h (activations are shown when h, L, a are given)")
    m.add_argument("--layers", type=number(int), help="transformer layers L")
    m.add_argument("--heads", type=number(int), help="attention heads a")
    m.add_argument("--no-attention-scores", action="store_true",
                   help="drop the 5*a*s/h term (kernels such as FlashAttention never store the s x s scores)")
    m.add_argument("--measure", action="store_true",
                   help="also build a small fp32 model, run one Adam step, and print measured beside predicted")
    m.add_argument("--device", default=None, help="for --measure: cpu or cuda (default: cuda if available)")
    m.set_defaults(func=_run_memory)

    from ringcoll.learning.lab import cli as lab_cli

    lab_cli.add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # bad values argparse cannot see (e.g. --world 1 with --png)
        print(f"ringcoll: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file it cannot write (--png into a missing directory)
        print(f"ringcoll: {err.strerror}: {err.filename}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
