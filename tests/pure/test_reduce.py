"""Tier 1: reduce.h's op x dtype functors, compiled for the host and run on raw arrays by
ringcoll._C.reduce_arrays, against torch, bit for bit.

What "bit for bit" means here: every non-NaN result has exactly torch's bits (so -0.0 vs
0.0, subnormals, overflow to inf and round-to-nearest-even ties all count), and every
element torch makes NaN is NaN in ours and vice versa. NaN *payloads and signs* are not
compared: IEEE 754 leaves them unspecified and torch's own are path dependent (its
vectorised minimum/maximum return an all-ones NaN, its bfloat16 rounding a canonical
0x7fc0/0xffff, its scalar paths keep the operand's payload), so no other implementation
could match all of them. Likewise the sign of min/max(0.0, -0.0), which torch leaves to
the code path (see reference()); reduce.h's rule, first operand wins, is pinned instead.
"""


import platform

import numpy as np
import pytest
import torch

from ringcoll._types import DTYPE_CODES, ReduceOp

from ringcoll import _C

# The Python API's own codes (ringcoll/_types.py): if they disagreed with reduce.h's enums,
# the functors below would be fed the wrong type and the comparisons with torch would fail.
SUM, PRODUCT, MIN, MAX, AVG = (int(op) for op in ReduceOp)
OPS = [SUM, PRODUCT, MIN, MAX, AVG]
OP_NAMES = {SUM: "sum", PRODUCT: "product", MIN: "min", MAX: "max", AVG: "avg"}
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
ALL = FLOATS + INTS
# Same-width integer type to view float bits through.
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}

INF, NAN = float("inf"), float("nan")


def reduce_arrays(a, b, op, final=False, world=1, path="auto"):
    assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
    out = torch.full_like(a, 0)
    _C.reduce_arrays(out.data_ptr(), a.data_ptr(), b.data_ptr(), a.numel(), DTYPE_CODES[a.dtype], op,
                     final=final, world=world, path=path)
    return out


def reference(a, b, op, world=1):
    if op == SUM:
        return a + b
    if op == PRODUCT:
        return a * b
    if op in (MIN, MAX):
        ref = torch.minimum(a, b) if op == MIN else torch.maximum(a, b)
        if a.dtype.is_floating_point:
            # min/max of 0.0 and -0.0: torch leaves the sign undefined (its vectorised loop
            # returns b, its scalar tail a, so it depends on the element's position). reduce.h
            # returns the first operand, `a` (the received partial), on any tie; pin that.
            ref = torch.where((a == b) & (torch.signbit(a) != torch.signbit(b)), a, ref)
        return ref
    # AVG, final combine. Our last combine rounds once: storage(float(a) + float(b)) / w)
    # with the sum and the division both done in the compute type (float for fp16/bf16).
    # torch's `(a + b) / w` on half tensors would round a + b to half first and then
    # round the quotient again, so the reference widens explicitly to get one rounding.
    if a.dtype in (torch.float16, torch.bfloat16):
        return ((a.float() + b.float()) / world).to(a.dtype)
    return (a + b) / world


def assert_same_bits(got, expected, a, b):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype.is_floating_point:
        got_nan, exp_nan = torch.isnan(got), torch.isnan(expected)
        bad = (got_nan != exp_nan) | (~exp_nan & (got.view(BITS[got.dtype]) != expected.view(BITS[got.dtype])))
    else:
        bad = got != expected
    if bad.any():
        idx = torch.nonzero(bad).flatten()[:8].tolist()
        rows = []
        for i in idx:
            if got.dtype.is_floating_point:
                bits = BITS[got.dtype]
                hx = lambda t: hex(t.view(bits)[i].item() & ((1 << (8 * t.element_size())) - 1))
                rows.append(f"  [{i}] a={a[i].item()!r} ({hx(a)}) b={b[i].item()!r} ({hx(b)}): "
                            f"got {got[i].item()!r} ({hx(got)}), expected {expected[i].item()!r} ({hx(expected)})")
            else:
                rows.append(f"  [{i}] a={a[i].item()} b={b[i].item()}: got {got[i].item()}, expected {expected[i].item()}")
        pytest.fail(f"{int(bad.sum())} of {bad.numel()} elements differ:\n" + "\n".join(rows))


# ---------------------------------------------------------------------------------------
# Inputs


def edge_values(dtype):
    if dtype in INTS:
        info = torch.iinfo(dtype)
        vals = {info.min, info.min + 1, info.max, info.max - 1, 0, 1, 2, 3, 15, 16, 17, 100, 127, 128, 255}
        vals |= {-1, -2, -16, -100} if info.min < 0 else set()
        vals |= {1 << 15, (1 << 16) + 1, 46341, 1 << 31, 3037000500} if info.bits >= 32 else set()
        return torch.tensor(sorted(v for v in vals if info.min <= v <= info.max), dtype=dtype)
    info = torch.finfo(dtype)
    tiny_sub = info.smallest_normal * info.eps  # the smallest subnormal
    vals = [
        0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 3.0, -3.0, 0.1, 1 / 3,
        1.0 + info.eps, 1.0 - info.eps / 2, info.eps / 2, info.eps / 4,  # ties at 1.0
        info.max, -info.max, info.max / 2, info.smallest_normal, -info.smallest_normal,
        tiny_sub, -tiny_sub, 3 * tiny_sub, info.smallest_normal - tiny_sub,  # subnormals
        INF, -INF, NAN,
    ]
    if dtype == torch.float16:
        # 65504 is the largest half; 65504 + 16 = 65520 is the tie with 65536 and rounds to
        # inf (even), 65504 + 15 stays finite; 2048 + 1 is a tie (to 2048), 2050 + 1 too (to 2052).
        vals += [65504.0, -65504.0, 65472.0, 16.0, 15.0, 8.0, 32.0, 2048.0, 2050.0, 256.0, 300.0]
    if dtype == torch.bfloat16:
        # bf16 has 8 significant bits: 256 + 1 is a tie (to 256), 258 + 1 a tie (to 260);
        # 1 + 2^-8 a tie (to 1), (1 + 2^-7) + 2^-8 a tie (to 1 + 2^-6).
        vals += [256.0, 258.0, 2.0**-8, 1.0 + 2.0**-7, 3.0 * 2.0**-9, 1e38, -1e38, 3e38]
    if dtype == torch.float32:
        vals += [16777216.0, 16777218.0, 1e38, 3e38]
    if dtype == torch.float64:
        vals += [2.0**53, 2.0**53 + 2, 1e308]
    return torch.tensor(vals, dtype=dtype)


def edge_pairs(dtype):
    """Every ordered pair of edge values: (a, b) and (b, a) both appear."""
    v = edge_values(dtype)
    a = v.repeat_interleave(len(v))
    b = v.repeat(len(v))
    return a.contiguous(), b.contiguous()


def random_pair(dtype, count=20000, seed=0):
    g = torch.Generator().manual_seed(seed * 31 + DTYPE_CODES[dtype])
    if dtype in INTS:
        info = torch.iinfo(dtype)
        hi = info.max if dtype == torch.int64 else info.max + 1
        return tuple(torch.randint(info.min, hi, (count,), dtype=dtype, generator=g) for _ in range(2))
    # Uniform random bit patterns: every exponent, incl. subnormals, inf and NaNs with
    # payloads, appears with its natural frequency...
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    a, b = (torch.randint(info.min, info.max, (count,), dtype=bits, generator=g).view(dtype) for _ in range(2))
    # ...plus ordinary magnitudes close to each other, where rounding actually matters.
    x = torch.randn(count, generator=g, dtype=torch.float64).to(dtype)
    y = (x.double() * (1 + torch.randn(count, generator=g, dtype=torch.float64) * 0.01)).to(dtype)
    return torch.cat([a, x]), torch.cat([b, y])


def supported(dtype, op):
    return op != AVG or dtype.is_floating_point


CASES = [(d, op) for d in ALL for op in OPS if supported(d, op)]
IDS = [f"{str(d).replace('torch.', '')}-{OP_NAMES[op]}" for d, op in CASES]


# ---------------------------------------------------------------------------------------
# Against torch


@pytest.mark.parametrize("dtype,op", CASES, ids=IDS)
def test_edge_values_match_torch(dtype, op):
    a, b = edge_pairs(dtype)
    if op == AVG:
        for world in (1, 2, 3, 7):
            assert_same_bits(reduce_arrays(a, b, op, final=True, world=world), reference(a, b, op, world), a, b)
    else:
        assert_same_bits(reduce_arrays(a, b, op), reference(a, b, op), a, b)


@pytest.mark.parametrize("dtype,op", CASES, ids=IDS)
def test_random_values_match_torch(dtype, op):
    a, b = random_pair(dtype)
    if op == AVG:
        for world in (2, 5, 8):
            assert_same_bits(reduce_arrays(a, b, op, final=True, world=world), reference(a, b, op, world), a, b)
    else:
        assert_same_bits(reduce_arrays(a, b, op), reference(a, b, op), a, b)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: str(d).replace("torch.", ""))
def test_avg_not_final_is_sum(dtype):
    # Only the final combine divides; the ones before it are plain sums, rounded to the
    # storage type like torch's `a + b`.
    a, b = random_pair(dtype, count=4000, seed=3)
    assert_same_bits(reduce_arrays(a, b, AVG, final=False, world=4), a + b, a, b)


@pytest.mark.parametrize("dtype,op", [c for c in CASES if c[1] != AVG], ids=[i for c, i in zip(CASES, IDS) if c[1] != AVG])
def test_final_is_identity_except_avg(dtype, op):
    a, b = edge_pairs(dtype)
    assert_same_bits(reduce_arrays(a, b, op, final=True, world=5), reduce_arrays(a, b, op), a, b)


# ---------------------------------------------------------------------------------------
# Named edge cases, spelled out (also covered by the edge grids above)


def one(dtype, op, x, y, **kw):
    a, b = torch.tensor([x], dtype=dtype), torch.tensor([y], dtype=dtype)
    return reduce_arrays(a, b, op, **kw)[0]


def bits_of(t):
    return t.reshape(1).view(BITS[t.dtype]).item() if t.dtype.is_floating_point else t.item()


def test_integer_overflow_wraps():
    assert one(torch.int8, SUM, 127, 1).item() == -128
    assert one(torch.int8, SUM, -128, -1).item() == 127
    assert one(torch.int8, PRODUCT, -128, -1).item() == -128
    assert one(torch.uint8, SUM, 255, 1).item() == 0
    assert one(torch.uint8, PRODUCT, 16, 16).item() == 0
    assert one(torch.uint8, PRODUCT, 255, 255).item() == 1
    assert one(torch.uint8, PRODUCT, 200, 3).item() == 600 % 256
    imax32 = 2**31 - 1
    assert one(torch.int32, SUM, imax32, imax32).item() == -2
    assert one(torch.int32, PRODUCT, imax32, 2).item() == -2
    assert one(torch.int32, PRODUCT, 46341, 46341).item() == 46341**2 - 2**32
    imax64 = 2**63 - 1
    assert one(torch.int64, SUM, imax64, 1).item() == -(2**63)
    assert one(torch.int64, PRODUCT, 2**32 + 1, 2**32 + 1).item() == 2**33 + 1


def test_float16_overflow_and_subnormals():
    h = torch.float16
    assert one(h, SUM, 65504.0, 16.0).item() == INF  # 65520 is the tie, rounds to even (inf)
    assert one(h, SUM, 65504.0, 15.0).item() == 65504.0
    assert one(h, SUM, -65504.0, -16.0).item() == -INF
    assert one(h, PRODUCT, 65504.0, 2.0).item() == INF
    tiny = 2.0**-24  # the smallest half subnormal
    assert one(h, SUM, tiny, tiny).item() == 2 * tiny
    assert one(h, PRODUCT, tiny, 0.5).item() == 0.0  # 2^-25 is a tie between 0 and 2^-24
    assert one(h, PRODUCT, 3 * tiny, 0.5).item() == 2 * tiny  # 1.5 * 2^-24 ties to even (2)
    assert one(h, AVG, 2.0**-14, 0.0, final=True, world=2).item() == 2.0**-15  # into subnormal
    # AVG rounds once: 65504 + 65504 overflows half but not float, so the average is finite.
    assert one(h, AVG, 65504.0, 65504.0, final=True, world=2).item() == 65504.0


def test_bfloat16_ties_round_to_even():
    bf = torch.bfloat16
    assert one(bf, SUM, 256.0, 1.0).item() == 256.0
    assert one(bf, SUM, 258.0, 1.0).item() == 260.0
    assert one(bf, SUM, 1.0, 2.0**-8).item() == 1.0
    assert one(bf, SUM, 1.0 + 2.0**-7, 2.0**-8).item() == 1.0 + 2.0**-6


def test_signed_zero_inf_nan():
    for dt in FLOATS:
        neg0 = bits_of(torch.tensor(-0.0, dtype=dt))
        pos0 = bits_of(torch.tensor(0.0, dtype=dt))
        assert bits_of(one(dt, SUM, -0.0, -0.0)) == neg0
        assert bits_of(one(dt, SUM, -0.0, 0.0)) == pos0
        assert bits_of(one(dt, PRODUCT, -1.0, 0.0)) == neg0
        assert one(dt, SUM, INF, 1.0).item() == INF
        assert np.isnan(one(dt, SUM, INF, -INF).item())
        assert np.isnan(one(dt, PRODUCT, INF, 0.0).item())
        for op in (MIN, MAX):
            # NaN wins on either side, like torch.minimum / torch.maximum.
            assert np.isnan(one(dt, op, NAN, 1.0).item())
            assert np.isnan(one(dt, op, 1.0, NAN).item())
            assert np.isnan(one(dt, op, NAN, INF).item())
        assert one(dt, MIN, -INF, 1.0).item() == -INF
        assert one(dt, MAX, INF, -1.0).item() == INF
        assert np.isnan(one(dt, AVG, NAN, 1.0, final=True, world=2).item())
        # Equal operands that differ only in the sign of zero: the first one wins.
        assert bits_of(one(dt, MIN, 0.0, -0.0)) == pos0 and bits_of(one(dt, MIN, -0.0, 0.0)) == neg0
        assert bits_of(one(dt, MAX, 0.0, -0.0)) == pos0 and bits_of(one(dt, MAX, -0.0, 0.0)) == neg0


# ---------------------------------------------------------------------------------------
# Table, errors, odd calls


def test_dtype_size():
    for dt, code in DTYPE_CODES.items():
        assert _C.dtype_size(code) == torch.empty(0, dtype=dt).element_size(), dt


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: str(d).replace("torch.", ""))
def test_avg_on_integers_is_rejected(dtype):
    a = torch.ones(4, dtype=dtype)
    out = torch.full_like(a, 7)
    with pytest.raises(ValueError):
        _C.reduce_arrays(out.data_ptr(), a.data_ptr(), a.data_ptr(), 4, DTYPE_CODES[dtype], AVG, True, 2)
    assert (out == 7).all()  # nothing written


@pytest.mark.parametrize("dtype_code,op", [(8, SUM), (-1, SUM), (0, 5), (0, -1), (100, 100)])
def test_unknown_codes_are_rejected(dtype_code, op):
    a = torch.ones(4)
    with pytest.raises(ValueError):
        _C.reduce_arrays(a.data_ptr(), a.data_ptr(), a.data_ptr(), 4, dtype_code, op)


def test_zero_count_writes_nothing():
    a = torch.ones(3)
    out = torch.full_like(a, 5.0)
    _C.reduce_arrays(out.data_ptr(), a.data_ptr(), a.data_ptr(), 0, DTYPE_CODES[torch.float32], SUM)
    assert (out == 5.0).all()


def test_in_place_and_numpy_pointers():
    # out may alias an input (the ring reduces into its own slot), and any raw buffer
    # works, not only torch's: here numpy arrays.
    a = np.arange(-5, 5, dtype=np.int32)
    b = np.full(10, 3, dtype=np.int32)
    expected = a * b
    _C.reduce_arrays(a.ctypes.data, a.ctypes.data, b.ctypes.data, a.size, DTYPE_CODES[torch.int32], PRODUCT)
    np.testing.assert_array_equal(a, expected)
    x = np.linspace(-1, 1, 9).astype(np.float16)
    y = np.linspace(3, -3, 9).astype(np.float16)
    out = np.empty_like(x)
    _C.reduce_arrays(out.ctypes.data, x.ctypes.data, y.ctypes.data, x.size, DTYPE_CODES[torch.float16], MAX)
    np.testing.assert_array_equal(out, np.maximum(x, y))


def test_unknown_path_is_rejected():
    a = torch.ones(4)
    with pytest.raises(ValueError):
        _C.reduce_arrays(a.data_ptr(), a.data_ptr(), a.data_ptr(), 4, DTYPE_CODES[torch.float32], SUM, path="avx")


# ---------------------------------------------------------------------------------------
# The vectorised 16-bit loops (csrc/host/host_vector16.h) against the scalar one, bit for
# bit, NaN bits included: path="auto" is what the ring runs (the best ISA the CPU has),
# "avx512" / "avx2" each loop on its own, path="scalar" the reference.

HALVES = [torch.float16, torch.bfloat16]
HALF_IDS = ["float16", "bfloat16"]
# (final, world): the plain combine and the last one of a chunk for every world size.
VARIANTS = [(False, 1)] + [(True, w) for w in range(1, 6)]


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_vector_path_is_selected_where_the_cpu_has_it():
    # Not a skip: on a CPU with AVX2 and F16C (and AVX-512F) the comparisons below must
    # exercise the vector loops, or they would compare the scalar loop with itself.
    flags = cpu_flags() if platform.machine() in ("x86_64", "AMD64") else set()
    has_avx2 = {"avx2", "f16c"} <= flags
    assert _C.host_vector_isa == ("avx512f" if has_avx2 and "avx512f" in flags else "avx2+f16c" if has_avx2
                                  else "none")


# Each vector loop on its own (a loop the CPU lacks runs the scalar one: the selection test
# above says which ran).
VECTOR_PATHS = ["avx512", "avx2"]


def bits16(t):
    return t.view(torch.int16)


def assert_paths_agree(a, b, op, final, world):
    expected = bits16(reduce_arrays(a, b, op, final, world, path="scalar"))
    for path in VECTOR_PATHS:
        got = bits16(reduce_arrays(a, b, op, final, world, path=path))
        bad = torch.nonzero(got != expected).flatten()
        if bad.numel():
            hx = lambda t, i: hex(bits16(t)[i].item() & 0xFFFF)
            rows = [f"  [{i}] a={hx(a, i)} b={hx(b, i)}: {path} {hx(got, i)}, scalar {hx(expected, i)}"
                    for i in bad[:8].tolist()]
            pytest.fail(f"{OP_NAMES[op]} final={final} world={world}: {bad.numel()} of {got.numel()} differ on "
                        f"{path}:\n" + "\n".join(rows))


@pytest.mark.parametrize("op", OPS, ids=[OP_NAMES[op] for op in OPS])
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_vector_matches_scalar_on_every_value(dtype, op):
    # All 65536 bit patterns of one operand (NaNs with every payload, infinities,
    # subnormals, -0), against random patterns and against themselves, in both orders.
    g = torch.Generator().manual_seed(13 + op)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    others = [torch.randint(-(1 << 15), 1 << 15, (every.numel(),), dtype=torch.int16, generator=g) for _ in range(3)]
    for other in others + [every, every.flip(0)]:
        for x, y in ((every, other), (other, every)):
            for final, world in VARIANTS:
                assert_paths_agree(x.view(dtype), y.view(dtype), op, final, world)


@pytest.mark.parametrize("op", OPS, ids=[OP_NAMES[op] for op in OPS])
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_vector_matches_scalar_on_near_values(dtype, op):
    # Ordinary magnitudes close to each other, where rounding (and ties) matter most.
    a, b = random_pair(dtype, count=50000, seed=op + 11)
    for final, world in VARIANTS:
        assert_paths_agree(a, b, op, final, world)


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_vector_lengths_offsets_and_in_place(dtype):
    # Lengths around the 8-element blocks (the scalar loop does the last len % 8), at
    # every 2-byte offset from a 32-byte boundary for each pointer, out of place and in
    # place; the elements next to the output stay untouched.
    g = torch.Generator().manual_seed(5)
    lengths = list(range(71)) + [127, 128, 129, 1000, 4099]
    pool = lambda: torch.randint(-(1 << 15), 1 << 15, (4200,), dtype=torch.int16, generator=g)
    for n in lengths:
        for off_a, off_b, off_out in ((0, 0, 0), (1, 3, 5), (7, 2, 1), (3, 3, 3)):
            for op in OPS:
                final, world = (True, 3) if op == AVG else (n % 2 == 1, 1 + n % 5)
                a, b = pool(), pool()
                x, y = a[off_a:off_a + n].view(dtype), b[off_b:off_b + n].view(dtype)
                results = []
                for path in VECTOR_PATHS + ["scalar"]:
                    out = torch.full((n + 16,), 0x1234, dtype=torch.int16)
                    o = out[off_out:off_out + n]
                    _C.reduce_arrays(o.data_ptr(), x.data_ptr(), y.data_ptr(), n, DTYPE_CODES[dtype], op,
                                     final=final, world=world, path=path)
                    assert (out[:off_out] == 0x1234).all() and (out[off_out + n:] == 0x1234).all(), (n, path)
                    own = y.clone()  # in place: the output is the own operand, as in the ring
                    _C.reduce_arrays(own.data_ptr(), x.data_ptr(), own.data_ptr(), n, DTYPE_CODES[dtype], op,
                                     final=final, world=world, path=path)
                    assert torch.equal(own.view(torch.int16), o), (n, path, op)
                    results.append(o)
                assert all(torch.equal(r, results[-1]) for r in results), (n, off_a, off_b, off_out, OP_NAMES[op])


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_two_nans_give_the_first_one(dtype):
    # IEEE leaves open which NaN `a + b` returns when both are; reduce.h pins it for the
    # 16-bit types (nan_a_wins): the received partial `a`, quieted by the rounding. That
    # is what makes the vector and scalar loops' NaN bits comparable at all.
    a_bits, b_bits = (0x7D01, 0xFE33) if dtype == torch.float16 else (0x7F81, 0xFFD3)
    quiet_a = 0x7E00 if dtype == torch.float16 else 0x7FC1  # half_from_float / bfloat16_from_float of a
    a = torch.full((24,), a_bits, dtype=torch.int16).view(dtype)
    b = torch.full((24,), b_bits - (1 << 16), dtype=torch.int16).view(dtype)
    for op in OPS:
        for final, world in VARIANTS:
            for path in VECTOR_PATHS + ["scalar"]:
                got = bits16(reduce_arrays(a, b, op, final, world, path=path))
                assert (got == quiet_a).all(), (OP_NAMES[op], final, path, hex(got[0].item() & 0xFFFF))


# ---------------------------------------------------------------------------------------
# The wider dtypes' AVX2 loop (host_vector16.h's reduce_wide_avx2: the scalar loop compiled
# for AVX2) against the scalar loop, bit for bit but for which of two NaNs a sum returns
# (IEEE leaves it open; these types do not pin it): path "avx2" and "auto" (what the ring
# runs) against "scalar", at lengths and offsets around the 32-byte vectors, in place too.

WIDE = [torch.float32, torch.float64] + INTS


@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: str(d).replace("torch.", ""))
def test_wide_vector_loop_matches_scalar(dtype):
    edges, edges_b = edge_pairs(dtype)
    near_a, near_b = random_pair(dtype, count=5000, seed=17)
    for a, b in ((edges, edges_b), (near_a, near_b)):
        for op in OPS:
            if not supported(dtype, op):
                continue
            for final, world in ([(True, 3), (True, 7)] if op == AVG else [(False, 1), (True, 4)]):
                expected = reduce_arrays(a, b, op, final, world, path="scalar")
                for path in ("avx2", "auto"):
                    got = reduce_arrays(a, b, op, final, world, path=path)
                    if dtype.is_floating_point:
                        both_nan = got.isnan() & expected.isnan()
                        same = (got.view(BITS[dtype]) == expected.view(BITS[dtype])) | both_nan
                    else:
                        same = got == expected
                    assert bool(same.all()), (OP_NAMES[op], final, path, torch.nonzero(~same)[:4].flatten().tolist())
    g = torch.Generator().manual_seed(23)
    pool = lambda: (torch.randn(700, generator=g) * 50).to(dtype)
    for n in list(range(40)) + [127, 129, 513]:
        for off_a, off_b, off_out in ((0, 0, 0), (1, 3, 5), (3, 3, 3)):
            a, b = pool(), pool()
            x, y = a[off_a:off_a + n], b[off_b:off_b + n]
            results = []
            for path in ("avx2", "scalar"):
                out = torch.full((n + 16,), 7, dtype=dtype)
                o = out[off_out:off_out + n]
                _C.reduce_arrays(o.data_ptr(), x.data_ptr(), y.data_ptr(), n, DTYPE_CODES[dtype], SUM, path=path)
                assert (out[:off_out] == 7).all() and (out[off_out + n:] == 7).all(), (n, path)
                own = y.clone()  # in place: the output is the own operand, as in the ring
                _C.reduce_arrays(own.data_ptr(), x.data_ptr(), own.data_ptr(), n, DTYPE_CODES[dtype], SUM, path=path)
                assert torch.equal(own, o), (n, path)
                results.append(o)
            assert torch.equal(results[0], results[1]), (n, off_a, off_b, off_out)
