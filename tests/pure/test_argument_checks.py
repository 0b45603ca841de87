"""The pair checks on their own (ArgumentChecks, ringcoll/communicator.py), at world sizes no
test machine runs: sizes are compared in integers, so every world size is exact."""

import pytest
import torch

from ringcoll._types import CPU
from ringcoll.communicator import EQUAL, GATHER, SCATTER, ArgumentChecks


class Checks(ArgumentChecks):
    def __init__(self, world_size: int, rank: int = 0):
        self.device, self.world_size, self.rank = CPU, world_size, rank


@pytest.mark.parametrize("world", [3, 49, 98, 127])
def test_reduce_scatter_and_all_gather_sizes_are_exact_at_any_world_size(world):
    checks = Checks(world)
    for m in (1, 2, 7, 13):  # 49 * (1/49) != 1 in floating point: a float ratio refused these
        whole, part = torch.zeros(world * m), torch.zeros(m)
        dtype, src, src_count, dst, dst_count = checks._check_pair("rs", part, whole, SCATTER)
        assert (src, src_count, dst, dst_count) == (whole.data_ptr(), world * m, part.data_ptr(), m)
        dtype, src, src_count, dst, dst_count = checks._check_pair("ag", whole, part, GATHER)
        assert (src, src_count, dst, dst_count) == (part.data_ptr(), m, whole.data_ptr(), world * m)
        with pytest.raises(ValueError, match=rf"rs: output has {m + 1} elements, expected input size "
                                             rf"\({world * m}\) / world_size \({world}\)"):
            checks._check_pair("rs", torch.zeros(m + 1), whole, SCATTER)


def test_the_messages_say_the_expected_size():
    checks = Checks(4)
    with pytest.raises(ValueError, match=r"^ag: output has 7 elements, expected world_size \(4\) x input size "
                                         r"\(2\) = 8$"):
        checks._check_pair("ag", torch.zeros(7), torch.zeros(2), GATHER)
    with pytest.raises(ValueError, match=r"^ar: output has 3 elements, expected input size \(2\)$"):
        checks._check_pair("ar", torch.zeros(3), torch.zeros(2), EQUAL)


def test_in_place_is_exactly_this_ranks_chunk():
    buf = torch.zeros(8)
    assert Checks(4, rank=2)._check_pair("rs", buf[4:6], buf, SCATTER)[0] == 0
    with pytest.raises(ValueError, match="rs: output and input overlap"):
        Checks(4, rank=1)._check_pair("rs", buf[4:6], buf, SCATTER)


def test_the_hierarchical_communicator_takes_every_communicator_call_as_written():
    """ringcoll.* hands a call to whichever communicator serves the group, one machine's or
    several machines' (HierarchicalCommunicator), with the same keywords (algorithm= among
    them): so every collective method of the Communicator must exist on both with the same
    parameters, names, kinds and defaults. (The CuPy *_array forms and the CUDA stream's
    synchronize are one-machine features, not reached through ringcoll.*; so is symmetric
    memory, memory every rank maps, which ringcoll.empty refuses for a group across machines.)"""
    import inspect

    from ringcoll.communicator import Communicator
    from ringcoll.training.hierarchical import HierarchicalCommunicator

    one_machine_only = {"all_reduce_array", "reduce_scatter_array", "all_gather_array", "synchronize",
                        "transport_class", "empty", "zeros", "is_symmetric"}
    for name, method in inspect.getmembers(Communicator, inspect.isfunction):
        if name.startswith("_") or name in one_machine_only:
            continue
        theirs = getattr(HierarchicalCommunicator, name, None)
        assert theirs is not None, f"HierarchicalCommunicator has no {name}"
        ours = [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]
        assert [(p.name, p.kind, p.default) for p in inspect.signature(theirs).parameters.values()] == ours, name
