"""The CUDA kernels' division of work (csrc/include/ringcoll/strip.h), compiled for the host.

The kernels divide every chunk slice among thread blocks in fixed tiles, and every tile
into a scalar head, 16-byte vectors and a scalar tail. These run on every commit, with no
GPU, through ringcoll._C.strip: the very functions the kernels call.
"""

import itertools

import pytest

from ringcoll import _C

S = _C.strip
ELEM_SIZES = (1, 2, 4, 8)
LENGTHS = sorted({*range(0, 70), 97, 127, 128, 129, 255, 256, 257, 1000, 1023, 1024, 4099, 8191, 8192, 8193,
                  65536, 65537, (1 << 20) + 3})
BLOCKS = (1, 2, 3, 4, 7, 8, 16)


def block_elements(n, blocks, block, elem_size):
    """The elements of an n-element slice that `block` touches, as device_ring.h walks them."""
    out = []
    for t in range(block, S.tile_count(n, elem_size), blocks):
        out.extend(range(S.tile_begin(t, elem_size), S.tile_end(n, t, elem_size)))
    return out


@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_tiles_cover_the_slice_once(elem_size):
    for n, blocks in itertools.product(LENGTHS, BLOCKS):
        if n > 70000 and blocks not in (1, 8):
            continue
        seen = [0] * n
        for b in range(blocks):
            for i in block_elements(n, blocks, b, elem_size):
                seen[i] += 1
        assert all(c == 1 for c in seen), (n, blocks)


@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_who_touches_an_element_does_not_depend_on_the_slice_length(elem_size):
    """The invariant that makes per-block flags safe: when a slot is reused for a slice of
    another length (the last slice of a call, another call), every element of it belongs
    to the same block as before, so no block overwrites what another block's neighbour is
    still reading."""
    tile = S.tile_elems(elem_size)
    assert tile * elem_size == S.tile_bytes
    lengths = (1, tile - 1, tile, tile + 1, 3 * tile + 5, 17 * tile + 2)
    for blocks in (2, 3, 8):
        owner = {}
        for n in lengths:
            for b in range(blocks):
                for i in block_elements(n, blocks, b, elem_size):
                    assert owner.setdefault(i, b) == b, (n, blocks, i)


@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_tiles_start_on_16_byte_boundaries(elem_size):
    for t in range(40):
        assert (S.tile_begin(t, elem_size) * elem_size) % 16 == 0


def _check_split(n, elem_size, ptrs):
    head, vec, tail = S.vector_split(n, elem_size, *ptrs)
    assert head >= 0 and vec >= 0 and tail >= 0
    assert head + vec + tail == n
    assert vec % (16 // elem_size) == 0
    used = [p for p in ptrs if p]
    if vec:
        for p in used:
            assert (p + head * elem_size) % 16 == 0, (n, elem_size, ptrs, head)
        assert head < 16 // elem_size and tail < 16 // elem_size
    return head, vec, tail


@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_vector_split_covers_every_element_once(elem_size):
    base = 0x7F0000000000
    for n in LENGTHS:
        for offset in range(0, 16, elem_size):
            # All pointers share the misalignment: vectorised after a head.
            ptrs = (base + offset, base + 4096 + offset, base + 8192 + offset, 0)
            head, vec, tail = _check_split(n, elem_size, ptrs)
            if n >= 2 * 16 // elem_size:
                assert vec > 0
            # Covering: each index in exactly one of the three parts.
            parts = [0] * n
            for i in range(head):
                parts[i] += 1
            for i in range(head, head + vec):
                parts[i] += 1
            for i in range(head + vec, n):
                parts[i] += 1
            assert all(c == 1 for c in parts)


@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_vector_split_falls_back_to_scalar_when_pointers_disagree(elem_size):
    base = 0x7F0000000000
    for n in (0, 1, 5, 64, 1000):
        if elem_size < 16:
            assert S.vector_split(n, elem_size, base, base + elem_size) == (n, 0, 0)
        _check_split(n, elem_size, (base, base + 32, 0, 0))


def test_vector_split_with_no_pointers_and_aligned_pointers():
    assert S.vector_split(64, 4, 0) == (0, 64, 0)
    assert S.vector_split(67, 4, 0x1000, 0x2000) == (0, 64, 3)
    assert S.vector_split(10, 2, 0x1002, 0x2002) == (7, 0, 3)  # head 7 to the boundary, then 3 < one vector
    assert S.vector_split(3, 1, 0x1001) == (3, 0, 0)


def test_tiles_then_split_cover_a_slice():
    """The kernel applies the split to each of its tiles; together they cover the slice."""
    base = 0x7F0000000000
    for elem_size, n, blocks in itertools.product(ELEM_SIZES, (0, 1, 31, 1000, 4099, 20000), (1, 8)):
        seen = [0] * n
        for b in range(blocks):
            for t in range(b, S.tile_count(n, elem_size), blocks):
                begin, end = S.tile_begin(t, elem_size), S.tile_end(n, t, elem_size)
                ptr = base + begin * elem_size
                head, vec, tail = _check_split(end - begin, elem_size, (ptr, ptr + 4096, 0, 0))
                for i in range(begin, end):
                    seen[i] += 1
                if end - begin >= 32:
                    assert vec > 0 and head == 0  # aligned slice start -> aligned tiles
        assert all(c == 1 for c in seen)


def test_build_reports_cuda():
    assert isinstance(_C.built_with_cuda, bool)


def test_fused_grid_grows_with_the_message_up_to_the_device():
    """kernel_abi.h's fused_blocks: one block per tile of the longest slice a ring step moves,
    at most the device's SM count; every rank computes the same from the same call."""
    blocks = _C.cuda_fused_blocks
    tile = S.tile_bytes
    sms, world, slot = 132, 4, 64 << 20  # an H200, 4 ranks, a large buffer
    assert blocks(0, world, slot, 1, sms) == 1  # a zero-length call still launches one block (the check)
    assert blocks(world, world, slot, 4, sms) == 1
    assert blocks(world * tile, world, slot, 1, sms) == 1  # one tile per chunk
    assert blocks(world * tile + world, world, slot, 1, sms) == 2
    assert blocks(world * 10 * tile, world, slot, 1, sms) == 10
    assert blocks(1 << 34, world, slot, 1, sms) == sms  # large messages: one block per SM
    # The slice, not the message, bounds it: a small slot caps the grid at its tiles.
    assert blocks(1 << 34, world, 3 * tile, 1, sms) == 3
    assert blocks(1 << 34, world, 3 * tile // 4, 4, sms) == 3  # slice_elems counts elements
    previous = 0
    for n in (1, 1000, 10**5, 10**6, 10**7, 10**8, 10**9):
        b = blocks(n, 2, 1 << 26, 2, 8)
        assert previous <= b <= 8
        previous = b
    assert _C.cuda_max_blocks_for(132) == 132
    assert _C.cuda_max_blocks_for(10**6) == _C.cuda_max_blocks == 256
    assert _C.cuda_max_blocks_for(0) == 1
    # Ranks sharing a GPU share its SMs: every block of every rank must be resident at once.
    assert _C.cuda_max_blocks_for(132, 4) == 33
    assert _C.cuda_max_blocks_for(132, 200) == 1


def test_data_flags_use_device_scope_only_when_every_rank_is_on_this_gpu():
    scope = _C.cuda_flag_scope_for
    assert scope([True, True, True]) == _C.cuda_flag_scope_device  # P processes sharing one GPU
    assert scope([True, False, True]) == _C.cuda_flag_scope_system  # one peer on another GPU
    assert scope([True]) == _C.cuda_flag_scope_device


def test_a_slice_leaves_room_to_place_data_at_any_offset_modulo_16():
    """Data sits in a CUDA slot at its user pointer's offset modulo 16 (device_ring.h): a
    slice is the slot less 16 bytes, a multiple of 16 bytes, so every slice of a chunk
    starts at the same offset modulo 16 and the last byte of a placed slice stays inside."""
    for slot in (128, 256, 1 << 20):
        for elem_size in ELEM_SIZES:
            elems = _C.cuda_slice_elems_for(slot, elem_size)
            assert (elems * elem_size) % 16 == 0
            assert elems * elem_size + 15 <= slot
