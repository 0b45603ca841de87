"""The CUDA kernels' strip arithmetic (csrc/include/ringcoll/strip.h), compiled for the host.

The kernels divide every chunk slice among thread blocks (strips) and every strip into a
scalar head, 16-byte vectors and a scalar tail. These run on every commit, with no GPU,
through ringcoll._C.strip: the very functions the kernels call.
"""

import itertools

import pytest

from ringcoll import _C

S = _C.strip
ELEM_SIZES = (1, 2, 4, 8)
LENGTHS = sorted({*range(0, 70), 97, 127, 128, 129, 255, 256, 257, 1000, 1023, 1024, 4099, 65536, 65537,
                  (1 << 20) + 3})
BLOCKS = (1, 2, 3, 4, 7, 8, 16)


@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_strips_tile_the_slice_exactly(elem_size):
    for n, blocks in itertools.product(LENGTHS, BLOCKS):
        bounds = [S.strip_begin(n, blocks, b, elem_size) for b in range(blocks)] + [S.strip_end(n, blocks, blocks - 1, elem_size)]
        assert bounds[0] == 0 and bounds[-1] == n, (n, blocks, bounds)
        assert all(a <= b for a, b in zip(bounds, bounds[1:])), (n, blocks, bounds)
        for b in range(blocks):
            assert S.strip_end(n, blocks, b, elem_size) == S.strip_begin(n, blocks, b + 1, elem_size)


@pytest.mark.parametrize("elem_size", ELEM_SIZES)
def test_strips_start_on_16_byte_boundaries_and_are_balanced(elem_size):
    g = S.strip_granule(elem_size)
    assert g * elem_size == 16
    for n, blocks in itertools.product(LENGTHS, BLOCKS):
        sizes = []
        for b in range(blocks):
            begin, end = S.strip_begin(n, blocks, b, elem_size), S.strip_end(n, blocks, b, elem_size)
            if begin < n:
                assert (begin * elem_size) % 16 == 0, (n, blocks, b, begin)
            sizes.append(end - begin)
        # balanced to within one granule, plus the partial granule at the end of the slice
        assert max(sizes) - min(sizes) < 2 * g, (n, blocks, sizes)


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


def test_kernel_strip_then_split_covers_a_slice():
    """The kernel applies the split to each block's strip; together they cover the slice."""
    base = 0x7F0000000000
    for elem_size, n, blocks in itertools.product(ELEM_SIZES, (0, 1, 31, 1000, 4099), (1, 8)):
        seen = [0] * n
        for b in range(blocks):
            begin, end = S.strip_begin(n, blocks, b, elem_size), S.strip_end(n, blocks, b, elem_size)
            ptr = base + begin * elem_size
            head, vec, tail = _check_split(end - begin, elem_size, (ptr, ptr + 4096, 0, 0))
            for i in range(begin, end):
                seen[i] += 1
            if end - begin >= 32:
                assert vec > 0 and head == 0  # aligned slice start -> aligned strips
        assert all(c == 1 for c in seen)


def test_build_reports_cuda():
    assert isinstance(_C.built_with_cuda, bool)
