"""The CUDA kernels' slicing and data placement, run by the emulator (csrc/emulation/) on the CPU.

A slice is the whole slot (kernel_abi.h's slice_elems_for): a power-of-two message through a
power-of-two buffer takes no extra slice. A rank still puts chunk c in its slot at the
offset modulo 16 of chunk c of its user memory (device_ring.h, placement), so misaligned
user pointers keep their 16-byte vectors; the last bytes of a full slice placed at a
nonzero offset wrap round to the start of the slot. These cases fill every slot to the
last byte at every offset, with pointers that differ from rank to rank and from call to
call, and compare exact results; the ThreadSanitizer program
(tests/pure/sanitize/placement_races.cpp) checks that when the offsets change between
calls the kernel orders the refill of every slot byte after its last read (it drains, as
for a changed grid). The arithmetic itself (slices, grids) is tests/pure/test_kernel_logic.py's.
"""


import pytest
import torch

from ringcoll import _C
from ringcoll._types import DTYPE_CODES
from ringcoll.learning import schedule as S
from ringcoll.learning.schedule import Collective

E = _C.emulation
FUSED, NAIVE = 0, 1
AR, RS, AG = int(Collective.ALL_REDUCE), int(Collective.REDUCE_SCATTER), int(Collective.ALL_GATHER)
TILE = _C.strip.tile_bytes
TIMEOUT = 30.0


def small_ints(rank, n, dtype, salt=0):
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 3 + 1).to(dtype)


def shifted(values, shift, extra):
    """`values` copied into a fresh tensor `shift` elements into its storage."""
    storage = torch.zeros(values.numel() + extra, dtype=values.dtype)
    view = storage[shift:shift + values.numel()]
    view.copy_(values)
    return storage, view


@pytest.mark.parametrize("variant", [FUSED, NAIVE])
def test_a_power_of_two_message_takes_no_extra_slice(variant):
    """64 KiB slots, chunks of exactly four slots: four slices, each filling its slot. The
    naive variant launches once per unit (the first send and every ring step of a slice),
    so its launch count is the slice count; a slice one placement slack short of the slot
    would add a fifth slice of 16 bytes per chunk (issue 22, defect 6)."""
    world, slot = 4, 64 << 10
    r = E.Ring(world, 2 * world * slot, TIMEOUT, variant, 2, True, 8)
    assert r.slot_bytes == slot
    n = world * 4 * slot // 4  # float32: 4 slots per chunk
    xs = [small_ints(k, n, torch.float32) for k in range(world)]
    outs = [torch.zeros(n) for _ in range(world)]
    assert r.run([(k, AR, DTYPE_CODES[torch.float32], 0, xs[k].data_ptr(), outs[k].data_ptr(), n)
                  for k in range(world)]) == [("", "")] * world
    assert all(torch.equal(o, sum(xs)) for o in outs)
    units = 4 * (S.ring_steps(Collective.ALL_REDUCE, world) + 1)
    assert r.launches == world * (1 if variant == FUSED else units)
    if variant == FUSED:
        assert r.blocks_launched == world * min(8, slot // TILE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.uint8])
@pytest.mark.parametrize("coll", [AR, RS, AG])
def test_misaligned_pointers_fill_whole_slots_exactly(coll, dtype):
    """Every chunk exactly two slots long and every rank's pointers misaligned (by a
    different number of elements on each rank, inputs and outputs apart): every slice fills
    its slot, so at a nonzero offset its last bytes wrap round to the slot's start. Results
    are exact and nothing outside the outputs is written."""
    world, slot, code = 3, 2 * TILE, DTYPE_CODES[dtype]
    per16 = 16 // dtype.itemsize
    r = E.Ring(world, 2 * world * slot, TIMEOUT, FUSED, 3, True, 8)
    m = 2 * slot // dtype.itemsize  # a chunk: the RS output, the AG input; AR's tensor is P chunks
    in_n = {AR: m * world, RS: m * world, AG: m}[coll]
    out_n = {AR: m * world, RS: m, AG: m * world}[coll]
    count = m * world if coll == AR else m
    ins, outs, keep = [], [], []
    for k in range(world):
        storage, view = shifted(small_ints(k, in_n, dtype), (k + 1) % per16, per16)
        out_storage, out_view = shifted(torch.zeros(out_n, dtype=dtype), (2 * k + 3) % per16, per16)
        keep += [storage, out_storage]
        ins.append(view)
        outs.append((out_storage, out_view, (2 * k + 3) % per16))
    calls = [(k, coll, code, 0, ins[k].data_ptr(), outs[k][1].data_ptr(), count) for k in range(world)]
    assert r.run(calls) == [("", "")] * world
    if coll == AG:
        want = [torch.cat(ins)] * world
    else:
        full = torch.stack([x.to(torch.int64) for x in ins]).sum(0).to(dtype)
        want = [full] * world if coll == AR else [full[k * m:(k + 1) * m] for k in range(world)]
    for k, (storage, view, shift) in enumerate(outs):
        assert torch.equal(view, want[k]), k
        assert torch.count_nonzero(storage[:shift]) == 0 and torch.count_nonzero(storage[shift + out_n:]) == 0


def test_offsets_that_change_between_calls_on_a_fixed_grid():
    """The same grid in every call (two blocks: two tiles a slot, every slice full), the
    ranks' offsets changing from call to call, all three collectives, each rank running
    ahead: exact (the drain on a changed placement keeps a refill behind the last read)."""
    world, slot, f32 = 3, 2 * TILE, DTYPE_CODES[torch.float32]
    r = E.Ring(world, 2 * world * slot, TIMEOUT, FUSED, 2, True, 8)
    chunk = slot // 4
    calls, checks, keep = [], [], []
    for call in range(9):
        coll = (AR, AG, RS)[call % 3]
        in_n = {AR: chunk * world, RS: chunk * world, AG: chunk}[coll]
        out_n = {AR: chunk * world, RS: chunk, AG: chunk * world}[coll]
        count = chunk * world if coll == AR else chunk
        ins, outs = [], []
        for k in range(world):
            storage, view = shifted(small_ints(k, in_n, torch.float32, call), (k + call) % 4, 4)
            out_storage, out_view = shifted(torch.zeros(out_n), (call * 3 + k) % 4, 4)
            keep += [storage, out_storage]
            ins.append(view)
            outs.append(out_view)
        calls += [(k, coll, f32, 0, ins[k].data_ptr(), outs[k].data_ptr(), count) for k in range(world)]
        if coll == AG:
            want = [torch.cat(ins)] * world
        else:
            full = sum(ins)
            want = [full] * world if coll == AR else [full[k * chunk:(k + 1) * chunk] for k in range(world)]
        checks.append((outs, want))
    assert r.run(calls) == [("", "")] * len(calls)
    for call, (outs, want) in enumerate(checks):
        for k in range(world):
            assert torch.equal(outs[k], want[k]), (call, k)
    assert r.blocks_launched == len(calls) * 2


def test_placement_changes_have_no_data_races(tmp_path):
    """tests/pure/sanitize/placement_races.cpp under ThreadSanitizer: offsets that change
    between calls on a fixed grid move the bytes near a tile boundary (and the wrapped ones)
    from one block to another; without the drain, TSan reports a slot byte refilled while
    unordered with the right neighbour's last read of it."""
    from tsan_build import run_under_tsan

    for out in run_under_tsan(tmp_path, "placement_races.cpp", runs=2):  # a race shows in most runs
        assert out.count("wrong 0") == 2, out
