"""The pair checks on their own (ArgumentChecks, ringcoll/communicator.py), at world sizes no
test machine runs: sizes are compared in integers, so every world size is exact."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringcoll._types import CPU, DTYPE_CODES
from ringcoll.communicator import EQUAL, GATHER, SCATTER, ArgumentChecks


class Checks(ArgumentChecks):
    def __init__(self, world_size: int, rank: int = 0):
        self.device, self.world_size, self.rank = CPU, world_size, rank


@pytest.mark.parametrize("world", [3, 49, 98, 127])
def test_reduce_scatter_and_all_gather_sizes_are_exact_at_any_world_size(world):
    checks = Checks(world)
    for m in (1, 2, 7, 13):  # 49 * (1/49) != 1 in floating point: a float ratio refused these
        whole, part = torch.zeros(world * m), torch.zeros(m)
        dtype, src, src_count, dst, dst_count, in_place = checks._check_pair("rs", part, whole, SCATTER)
        assert (src, src_count, dst, dst_count, in_place) == (whole.data_ptr(), world * m, part.data_ptr(), m, False)
        dtype, src, src_count, dst, dst_count, in_place = checks._check_pair("ag", whole, part, GATHER)
        assert (src, src_count, dst, dst_count, in_place) == (part.data_ptr(), m, whole.data_ptr(), world * m, False)
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
    assert Checks(4, rank=2)._check_pair("rs", buf[4:6], buf, SCATTER)[::5] == (0, True)  # dtype, in place
    assert Checks(4, rank=2)._check_pair("ag", buf, buf[4:6], GATHER)[5]
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


# --- the fast read (csrc/bindings/dlpack_exchange.h) ---------------------------------------
#
# Where torch.Tensor carries DLPack's C exchange table, the checks read a tensor's dtype,
# address and element count in one C call instead of five attribute reads. It must say
# exactly what the attribute reads say, for every tensor it vouches for, and vouch for no
# other (those fall back to the attribute reads, which word the errors).

HAS_EXCHANGE_TABLE = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) is not None


def attribute_facts(t):
    """What the attribute reads say of `t`, where the fast read must vouch for it (a strided,
    contiguous CPU tensor of exactly torch.Tensor or nn.Parameter, of a dtype ringcoll has);
    None where it must not."""
    vouched = (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and t.is_cpu
               and t.is_contiguous() and t.dtype in DTYPE_CODES)
    return (DTYPE_CODES[t.dtype], t.data_ptr(), t.numel()) if vouched else None


class Subclass(torch.Tensor):  # may define its own data_ptr: only the attribute reads honour it
    pass


def odd_tensors():
    base = torch.arange(24.0)
    yield "plain", base
    yield "a view at an offset", base[5:11]
    yield "2-d", base.view(4, 6)
    yield "a row of 2-d", base.view(4, 6)[2]
    yield "a column of 2-d", base.view(4, 6)[:, 2]
    yield "transposed", base.view(4, 6).t()
    yield "size-1 dimensions", base[:6].view(1, 6, 1)
    yield "size-1 dimension of any stride", base.as_strided((1, 6), (100, 1))
    yield "expanded", torch.ones(1).expand(4)
    yield "0-d", torch.tensor(3.0)
    yield "empty", torch.empty(0)
    yield "empty, odd strides", torch.empty(0, 3).t()
    yield "channels_last", torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    yield "parameter", torch.nn.Parameter(torch.ones(3))
    yield "requires grad, not a leaf", torch.ones(3, requires_grad=True) * 2
    yield "subclass", torch.ones(3).as_subclass(Subclass)
    yield "bool", torch.ones(3, dtype=torch.bool)
    yield "complex", torch.ones(3, dtype=torch.complex64)
    yield "meta", torch.empty(3, device="meta")
    yield "sparse", torch.ones(3).to_sparse()
    for dtype in DTYPE_CODES:
        yield f"{dtype}", torch.ones(5, dtype=dtype)
        yield f"{dtype}, offset view", torch.ones(9, dtype=dtype)[3:7]


def test_the_fast_read_says_what_the_attribute_reads_say():
    from ringcoll import _C

    vouched = 0
    for label, t in odd_tensors():
        expected = attribute_facts(t) if HAS_EXCHANGE_TABLE else None
        assert _C.read_tensor_facts(t) == expected, label
        vouched += expected is not None
    # Where this torch has the table (2.13 does) the fast read must be taken, not silently lost.
    assert (vouched > 0) == HAS_EXCHANGE_TABLE


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_fast_read_matches_on_any_strided_view(data):
    """Random shapes, strides and offsets over a buffer: where the fast read vouches, its facts
    are the attribute reads'; where they say contiguous, it vouches (torch's rule: only
    dimensions of size other than 1 count, an empty tensor is contiguous)."""
    from ringcoll import _C

    dtype = data.draw(st.sampled_from(sorted(DTYPE_CODES, key=str)))
    shape = data.draw(st.lists(st.integers(0, 4), max_size=4))
    strides = data.draw(st.lists(st.integers(0, 12), min_size=len(shape), max_size=len(shape)))
    offset = data.draw(st.integers(0, 7))
    reach = offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1 if all(shape) else offset
    t = torch.zeros(reach + 1, dtype=dtype).as_strided(shape, strides, offset)
    assert _C.read_tensor_facts(t) == (attribute_facts(t) if HAS_EXCHANGE_TABLE else None)


def test_the_checks_accept_and_refuse_alike_with_and_without_the_table():
    """check_tensor and check_pair through the fast read and through the attribute reads alone
    (the checks configured without the table, as on a torch that lacks it): the same facts,
    or the same error word for word, for every kind of tensor."""
    from ringcoll import _C, _types

    def outcome(call):
        try:
            return call()
        except (TypeError, ValueError) as e:
            return type(e), str(e)

    tensors = [t for _, t in odd_tensors()]
    whole = torch.arange(8.0)
    pairs = [(whole, whole[2:4]), (whole, torch.ones(2)), (whole, torch.ones(3)), (whole.view(2, 4).t(), whole[:2])]

    def outcomes():
        return ([outcome(lambda t=t: _C.check_tensor("op", "tensor", t, CPU)) for t in tensors]
                + [outcome(lambda o=o, i=i: _C.check_pair("ag", o, i, GATHER, CPU, 1, 4)) for o, i in pairs])

    with_table = outcomes()
    try:
        _C.configure_tensor_checks(torch.Tensor, CPU, _types.reduce_op, list(DTYPE_CODES.items()),
                                   [(ours, int(ours)) for ours in _types.ReduceOp])
        assert _C.read_tensor_facts(torch.ones(3)) is None
        assert outcomes() == with_table
    finally:
        _types._configure_tensor_checks()
    assert (_C.read_tensor_facts(torch.ones(3)) is not None) == HAS_EXCHANGE_TABLE


def test_settings_from_the_environment_are_refused_by_name(monkeypatch):
    """A value the setting does not take is an error naming it, not a float's complaint
    ("could not convert string to float") nor, for RINGCOLL_CHECK, silently on."""
    from ringcoll.communicator import _resolve_check, resolve_timeout

    monkeypatch.setenv("RINGCOLL_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="timeout= / RINGCOLL_TIMEOUT must be a number of seconds, got 'abc'"):
        resolve_timeout(None)
    with pytest.raises(ValueError, match="must be a number of seconds, got True"):  # float(True): 1 s
        resolve_timeout(True)
    for value, on in (("0", False), ("off", False), (" Yes ", True), ("1", True)):
        monkeypatch.setenv("RINGCOLL_CHECK", value)
        assert _resolve_check(None) is on
    monkeypatch.setenv("RINGCOLL_CHECK", "2")
    with pytest.raises(ValueError, match="RINGCOLL_CHECK must be 1/true/on/yes or 0/false/off/no, got '2'"):
        _resolve_check(None)


def _list_forms_into_autograd_tensors(group):
    import ringcoll

    comm = ringcoll.Communicator(group=group)
    rank, world = comm.rank, comm.world_size
    with torch.inference_mode():
        made_in_inference, also_in_inference = torch.zeros(3), torch.ones(2)
    outputs = [torch.zeros(3), torch.zeros(3, requires_grad=True)][:world]
    if world > 2:
        outputs.append(made_in_inference)
    comm.all_gather(outputs, torch.full((3,), float(rank)))
    gathered = [t.detach().clone() for t in outputs]
    coalesced = [torch.zeros(2, requires_grad=True), also_in_inference]
    comm.all_reduce_coalesced(coalesced)  # coalesced in place: the inputs are the outputs
    comm.close()
    return gathered, [t.detach().clone() for t in coalesced]


def test_the_list_forms_write_outputs_as_memory_as_the_tensor_forms_do():
    """An output that is a leaf requiring grad, or made in inference mode: autograd refused
    the list forms' copy into it after the outputs before it were written (a RuntimeError
    on a half-written list); the tensor forms, and gloo, write it as memory."""
    import ringcoll

    world = 3
    for gathered, coalesced in ringcoll.run_in_process(world, _list_forms_into_autograd_tensors):
        assert [t.tolist() for t in gathered] == [[float(r)] * 3 for r in range(world)]
        assert [t.tolist() for t in coalesced] == [[0.0, 0.0], [float(world)] * 2]
