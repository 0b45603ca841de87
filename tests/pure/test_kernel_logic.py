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


def test_flag_scope_can_be_forced_to_system_scope():
    """RINGCOLL_CUDA_FLAG_SCOPE=system (issue 22, defect 5): every data flag at .sys, even
    where every rank runs on this GPU; auto (the default, and an unset or empty variable)
    keeps the narrowest correct scope. Read once, when the communicator is built."""
    setting = _C.cuda_flag_scope_setting
    auto, system = setting("auto"), setting("system")
    assert setting("") == setting(None) == auto  # unset: the default
    assert setting(" System ") == system  # as RINGCOLL_CUDA_KERNEL is read: trimmed, any case
    scope = _C.cuda_flag_scope_for
    assert scope([True, True], auto) == _C.cuda_flag_scope_device
    assert scope([True, True], system) == _C.cuda_flag_scope_system
    assert scope([True, False], auto) == scope([True, False], system) == _C.cuda_flag_scope_system
    assert scope([True], system) == _C.cuda_flag_scope_system


@pytest.mark.parametrize("bad", ["device", "gpu", "sys", "0", "auto,system"])
def test_a_bad_flag_scope_names_the_variable_and_the_allowed_values(bad):
    """`device` is refused too: forcing .gpu where a peer runs on another GPU would leave its
    data unordered, and where every rank shares this GPU auto already chooses it."""
    with pytest.raises(ValueError) as err:
        _C.cuda_flag_scope_setting(bad)
    message = str(err.value)
    assert "RINGCOLL_CUDA_FLAG_SCOPE" in message and repr(bad) in message, message
    assert "auto" in message and "system" in message, message


@pytest.mark.skipif(not getattr(_C, "built_with_cuda", False), reason="built without the CUDA backend")
def test_the_communicator_reads_the_flag_scope_when_it_is_built(monkeypatch):
    """CudaComm's constructor reads RINGCOLL_CUDA_FLAG_SCOPE before it touches the GPU, so a
    bad value is refused by name even on a machine without one (this one)."""
    monkeypatch.setenv("RINGCOLL_CUDA_FLAG_SCOPE", "everywhere")
    with pytest.raises(ValueError, match="RINGCOLL_CUDA_FLAG_SCOPE='everywhere'; expected one of auto"):
        _C.CudaComm(0, 1, 0, 1 << 20, 10.0)


def test_ranks_must_agree_on_the_flag_scope_setting():
    """A ring where some ranks force .sys and others keep .gpu would still pair every
    release with an acquire whose scope covers it, but would not be what RINGCOLL_CUDA_FLAG_SCOPE
    =system promises (every flag at system scope): so, like RINGCOLL_CUDA_KERNEL, the ranks
    must agree, checked where each rank reads every rank's handle (map_peers), on every rank."""
    setting = _C.cuda_flag_scope_setting
    auto, system = setting("auto"), setting("system")
    check = _C.cuda_check_flag_scope_settings
    check([auto, auto, auto])
    check([system, system])
    with pytest.raises(ValueError) as err:
        check([auto, system, auto])
    message = str(err.value)
    assert "RINGCOLL_CUDA_FLAG_SCOPE differs between ranks" in message, message
    assert "rank 0: auto" in message and "rank 1: system" in message and "rank 2: auto" in message, message


def test_a_slice_is_the_whole_slot():
    """Data sits in a CUDA slot at its user pointer's offset modulo 16 (device_ring.h), and
    what of a full slice passes the slot's end wraps round to its start: so a slice is the
    whole slot, a multiple of 16 bytes (every slice of a chunk starts at the same offset
    modulo 16), the same on every rank whatever their pointers."""
    for slot in (128, 256, 1 << 20, 3 << 20):
        for elem_size in ELEM_SIZES:
            elems = _C.cuda_slice_elems_for(slot, elem_size)
            assert elems * elem_size == slot and slot % 16 == 0


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_power_of_two_messages_take_no_extra_slice(world, elem_size):
    """Issue 22, defect 6: with the slot less a 16-byte slack as the slice, a message of a
    power-of-two size through a power-of-two buffer took one more slice than it fills (a few
    bytes per chunk; 2P-1 more hand-offs: 7 at P = 4, 64 MiB). Now exactly bytes / (P x slot)."""
    from ringcoll.learning import schedule as sched

    for buffer_bytes in (4 << 20, 64 << 20, 2 * world * (1 << 20)):
        slot = _C.cuda_slot_bytes_for(buffer_bytes, world)
        slice_elems = _C.cuda_slice_elems_for(slot, elem_size)
        for message in (world * slot, 4 * world * slot, 64 << 20, 1 << 30):
            if message % (world * slot):
                continue
            n = message // elem_size
            assert sched.num_slices(n, world, slice_elems) == message // (world * slot), (buffer_bytes, message)
    # The case: P = 4, a 64 MiB float32 all-reduce through a 64 MiB buffer: 2 slices, not 3.
    slot = _C.cuda_slot_bytes_for(64 << 20, 4)
    assert sched.num_slices((64 << 20) // 4, 4, _C.cuda_slice_elems_for(slot, 4)) == 2


def default_cuda_buffer(world):
    from ringcoll.communicator import default_buffer_bytes

    return default_buffer_bytes("cuda", world)


H200_SMS = 132


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_the_default_cuda_buffer_gives_a_large_message_a_block_per_sm(world, elem_size):
    """Issue 22, defect 6: a large message's grid is the whole bound max_blocks_for allows on
    a 132-SM GPU (an H100/H200): SM count / P blocks a rank when the P ranks share the GPU
    (66, 33, 16: every SM, but for 132 mod 8 = 4 at P = 8), 132 when each rank has its own;
    never above kMaxBlocks (256). With the old 4 MiB default it was 32, 16 and 8 (a slice of
    1 MiB, 512 KiB, 256 KiB: one block per 32 KiB tile)."""
    buffer_bytes = default_cuda_buffer(world)
    slot = _C.cuda_slot_bytes_for(buffer_bytes, world)
    slice_elems = _C.cuda_slice_elems_for(slot, elem_size)
    n = (1 << 31) // elem_size  # 2 GiB: every chunk many slots long
    for ranks_per_gpu in (world, 1):
        bound = _C.cuda_max_blocks_for(H200_SMS, ranks_per_gpu)
        assert bound == min(H200_SMS // ranks_per_gpu, _C.cuda_max_blocks)
        assert _C.cuda_fused_blocks(n, world, slice_elems, elem_size, bound) == bound, (ranks_per_gpu, slot)
    # On any GPU the flag area supports (up to kMaxBlocks SMs), too: a slot has a tile per block.
    assert _C.cuda_fused_blocks(n, world, slice_elems, elem_size, _C.cuda_max_blocks) == _C.cuda_max_blocks
    assert [_C.cuda_max_blocks_for(H200_SMS, p) for p in (2, 4, 8)] == [66, 33, 16]


def test_the_default_buffer_follows_the_environment_and_the_device(monkeypatch):
    """RINGCOLL_BUFFER_BYTES, when set, is the buffer on every device; unset, the CPU keeps
    4 MiB (the shared-memory ring's own trade-off) and CUDA takes a slot of kMaxBlocks tiles
    per bank and rank (16 MiB x P): the same on every rank, from the world size alone."""
    from ringcoll.communicator import DEFAULT_BUFFER_BYTES, resolve_buffer_bytes

    monkeypatch.delenv("RINGCOLL_BUFFER_BYTES", raising=False)
    assert resolve_buffer_bytes(None, "cpu", 4) == DEFAULT_BUFFER_BYTES == 4 << 20
    for world in (1, 2, 4, 8):
        assert resolve_buffer_bytes(None, "cuda", world) == default_cuda_buffer(world) == \
            2 * world * _C.cuda_max_blocks * _C.strip.tile_bytes
    assert resolve_buffer_bytes(1 << 20, "cuda", 4) == 1 << 20  # an explicit value wins
    monkeypatch.setenv("RINGCOLL_BUFFER_BYTES", "8M")
    assert resolve_buffer_bytes(None, "cuda", 4) == resolve_buffer_bytes(None, "cpu", 4) == 8 << 20
