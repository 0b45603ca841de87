"""What every lab experiment shares: the data, the model, flat weights, and the report.

* The data: scikit-learn's handwritten digits (1797 images of 8 x 8 pixels, shipped inside
  the package: nothing is downloaded), split once into 1437 training and 360 held-out test
  images, stratified, with a fixed seed. Accuracy is always measured on the held-out split.
* The model: a multi-layer perceptron, 64 -> hidden -> ... -> 10, ReLU, cross-entropy.
* Flat weights: the model's parameters are views into one flat tensor (``FlatModel``), so
  a gradient, a weight update, an all-reduce or a point-to-point message is one tensor.
* Batches: every rank draws from its own shard of a per-epoch permutation of the training
  set (:func:`batches`), the same stream whichever way the ranks are combined, so two
  variants that process the same number of samples see the same data.
* The report: a table (printed), a JSON record holding every figure the table prints, and
  a plot (matplotlib, no display needed).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

CLASSES = 10
FEATURES = 64
TEST_FRACTION = 0.2  # 360 of 1797 images held out
SPLIT_SEED = 0


@dataclass(frozen=True)
class Digits:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


_DIGITS: Optional[Digits] = None


def digits() -> Digits:
    """The digits data set, pixels scaled to [0, 1], split into train and held-out test."""
    global _DIGITS
    if _DIGITS is None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        data = load_digits()
        x = torch.tensor(data.data / 16.0, dtype=torch.float32)
        y = torch.tensor(data.target, dtype=torch.int64)
        tr, te = train_test_split(list(range(len(y))), test_size=TEST_FRACTION, random_state=SPLIT_SEED,
                                  stratify=data.target)
        _DIGITS = Digits(x[tr], y[tr], x[te], y[te])
    return _DIGITS


def make_model(hidden: Sequence[int], seed: int) -> torch.nn.Sequential:
    """MLP 64 -> hidden[0] -> ... -> 10 with ReLU, initialised from ``seed``."""
    torch.manual_seed(seed)
    widths = [FEATURES, *hidden, CLASSES]
    layers: List[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


def parameter_count(hidden: Sequence[int]) -> int:
    """Parameters of make_model(hidden): each Linear(a, b) holds a x b weights and b biases."""
    widths = [FEATURES, *hidden, CLASSES]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """A short hash of the tensors' bytes: equal digests across ranks mean identical replicas."""
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class FlatModel:
    """A model whose parameters are views into one flat float32 tensor ``weights``.

    ``gradient(x, y)`` runs forward and backward and returns (loss, flat gradient), a new
    tensor. Writing into ``weights`` (``weights.sub_(g, alpha=lr)``, an all-reduce, a
    received message) changes the model, because its parameters are views of it.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.params = list(module.parameters())
        self.weights = torch.cat([p.detach().reshape(-1) for p in self.params]).clone()
        offset = 0
        for p in self.params:
            p.data = self.weights[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    @property
    def numel(self) -> int:
        return self.weights.numel()

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, torch.Tensor]:
        for p in self.params:
            p.grad = None
        loss = torch.nn.functional.cross_entropy(self.module(x), y)
        loss.backward()
        return float(loss.detach()), torch.cat([p.grad.reshape(-1) for p in self.params])

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return float((self.module(x).argmax(dim=1) == y).float().mean())


def batches(seed: int, rank: int, world: int, batch: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s endless stream of training batches: in epoch e, the training set is
    permuted (seeded by ``seed`` and e), rank r takes every world-th image from position r,
    and yields consecutive batches of ``batch`` images (an incomplete last one is dropped)."""
    data = digits()
    n = len(data.train_y)
    epoch = 0
    while True:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(1_000_003 * seed + epoch))
        shard = perm[rank::world]
        for start in range(0, len(shard) - batch + 1, batch):
            idx = shard[start:start + batch]
            yield data.train_x[idx], data.train_y[idx]
        epoch += 1


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


RANK_TIMEOUT_S = 120.0  # bounds every collective and message of a run (the process group's timeout)


def launch(job, world: int, cfg, timeout: float, backend: str = "gloo"):
    """Run ``job(rank, world, cfg)`` on ``world`` fresh processes (ringcoll.harness.launcher)
    and return rank 0's result. A rank that dies or hangs ends the run with an error naming
    it: a peer's collective fails within RANK_TIMEOUT_S, the whole run within ``timeout``."""
    from ringcoll.harness.launcher import spawn

    return spawn(job, world, cfg, timeout=timeout, backend=backend, env={"OMP_NUM_THREADS": "1"},
                 init_timeout=min(timeout, RANK_TIMEOUT_S))[0]


def one_thread() -> None:
    """Each rank computes on one thread: P ranks on a machine of C cores then contend as
    P processes, not P x C threads."""
    torch.set_num_threads(1)


# --- the report ---------------------------------------------------------------------------


def mean_sd(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = list(values)
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def pm(mean_and_sd: Tuple[float, float], fmt: str = ".1f") -> str:
    """'mean +- sd', as printed in the tables, from :func:`mean_sd`'s pair."""
    m, s = mean_and_sd
    return f"{m:{fmt}} +- {s:{fmt}}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table, columns right-aligned except the first."""
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def write_record(out_dir: str, name: str, record: Dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    return path


def new_figure(panels: int, width: float = 5.0, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height))
    return fig, (list(axes) if panels > 1 else [axes])


def save_figure(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def smooth(log: Sequence[Tuple[float, float]], bins: int = 60) -> Tuple[List[float], List[float]]:
    """(x, y) points, sorted by x, averaged in ``bins`` equal runs: a readable loss curve."""
    log = sorted(log)
    size = max(1, len(log) // bins)
    xs, ys = [], []
    for i in range(0, len(log), size):
        part = log[i:i + size]
        xs.append(statistics.fmean(x for x, _ in part))
        ys.append(statistics.fmean(y for _, y in part))
    return xs, ys


def progress(total: int, what: str, enabled: bool = True):
    """A progress bar over the runs of an experiment (tqdm, on stderr)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"lab {what}", unit="run", disable=not enabled, leave=False)
