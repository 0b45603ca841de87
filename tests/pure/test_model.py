"""The alpha-beta model: formulas from first principles, and fits that recover known values."""

import math

import pytest

from ringcoll import plans
from ringcoll.learning import model


def test_ring_times_match_the_textbook_formulas():
    alpha, beta, n = 5e-6, 10e9, 64 << 20
    for p in range(2, 9):
        rs = model.ring_time("reduce_scatter", p, n, alpha, beta)
        ag = model.ring_time("all_gather", p, n, alpha, beta)
        ar = model.ring_time("all_reduce", p, n, alpha, beta)
        assert rs == pytest.approx((p - 1) * alpha + (p - 1) / p * n / beta)
        assert ag == pytest.approx(rs)
        assert ar == pytest.approx(2 * (p - 1) * alpha + 2 * (p - 1) / p * n / beta)
        # All-reduce is exactly reduce-scatter + all-gather: splitting saves nothing.
        assert ar == pytest.approx(rs + ag)
    assert model.ring_time("all_reduce", 1, n, alpha, beta) == 0.0


def test_bytes_per_rank_is_below_2n_not_2pn():
    n = 1000.0
    for p in range(2, 64):
        sent = model.bytes_sent_per_rank("all_reduce", p, n)
        assert sent == pytest.approx(2 * (p - 1) / p * n)
        assert sent < 2 * n < 2 * p * n


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_fit_recovers_alpha_beta_from_exact_data(collective):
    alpha, beta, p = 7e-6, 3.5e9, 4
    sizes = [2.0 ** k for k in range(10, 27, 2)]
    times = [model.ring_time(collective, p, n, alpha, beta) for n in sizes]
    fit = model.fit(collective, p, sizes, times)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.predict(collective, p, 1e6) == pytest.approx(model.ring_time(collective, p, 1e6, alpha, beta))


def test_fit_never_returns_negative_terms():
    # Pure bandwidth data with noise that would pull alpha below zero.
    sizes = [1e3, 1e6, 1e7]
    times = [0.9e-9 * 1e3 * 0.5, 1e-3 * 0.5, 1e-2 * 0.5]
    fit = model.fit("all_gather", 2, sizes, times)
    assert fit.alpha >= 0 and fit.beta > 0


def test_amdahl_and_data_parallel_speedup():
    assert model.amdahl_speedup(0.0, 8) == pytest.approx(8)
    assert model.amdahl_speedup(0.1, 8) == pytest.approx(1 / (0.1 + 0.9 / 8))
    fit = model.Fit(alpha=10e-6, beta=10e9)
    grad = 100e6
    comm = fit.predict("all_reduce", 8, grad)
    assert model.data_parallel_step_time(0.05, grad, 8, fit) == pytest.approx(0.05 + comm)
    assert model.data_parallel_step_time(0.05, grad, 8, fit, overlap=True) == pytest.approx(max(0.05, comm))
    plain = model.data_parallel_speedup(0.05, grad, 8, fit)
    overlapped = model.data_parallel_speedup(0.05, grad, 8, fit, overlap=True)
    assert plain == pytest.approx(8 * 0.05 / (0.05 + comm))
    assert plain < overlapped <= 8
    rows = model.scaling_table(0.05, grad, [1, 2, 8], fit)
    assert rows[0]["speedup"] == pytest.approx(1.0) and math.isclose(rows[0]["comm_s"], 0.0)
    assert all(r["efficiency"] <= r["efficiency_overlap"] <= 1.0 + 1e-12 for r in rows)


def test_scaling_cli_prints_a_row_per_world(capsys):
    model.main(["--compute-ms", "50", "--grad-mb", "100", "--alpha-us", "5", "--beta-gbs", "10", "--worlds", "1,8"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[1].split()[0] == "1" and lines[2].split()[0] == "8"
    fit = model.Fit(alpha=5e-6, beta=10e9)
    assert float(lines[2].split()[1]) == pytest.approx(fit.predict("all_reduce", 8, 100e6) * 1e3, abs=1e-3)


@pytest.mark.parametrize("bad", [["--beta-gbs", "0"], ["--compute-ms", "0"], ["--worlds", "0"], ["--worlds", "1,x"],
                                 ["--alpha-us", "-1"], ["--grad-mb", "nan"]])
def test_scaling_cli_refuses_what_it_cannot_price(capsys, bad):
    """A message from argparse (status 2), where 0 divided by zero in the table and 1,x
    raised a bare ValueError."""
    args = {"--compute-ms": "50", "--grad-mb": "100", "--alpha-us": "5", "--beta-gbs": "10"}
    args[bad[0]] = bad[1]
    with pytest.raises(SystemExit) as exit_:
        model.main([item for pair in args.items() for item in pair])
    assert exit_.value.code == 2 and bad[0] in capsys.readouterr().err


def test_one_shot_time_is_one_step_and_p_minus_1_reads():
    alpha, beta, n = 5e-6, 10e9, 1 << 16
    for p in range(2, 9):
        assert model.one_shot_time("all_reduce", p, n, alpha, beta) == pytest.approx(alpha + (p - 1) * n / beta)
        for coll in ("reduce_scatter", "all_gather"):
            assert model.one_shot_time(coll, p, n, alpha, beta) == pytest.approx(alpha + (p - 1) / p * n / beta)
    assert model.one_shot_time("all_reduce", 1, n, alpha, beta) == 0.0


@pytest.mark.parametrize("p", range(3, 12))
def test_one_shot_crossover_is_where_the_times_meet(p):
    alpha, beta = 4e-6, 10e9
    x = model.one_shot_crossover("all_reduce", p, alpha, beta)
    assert x == pytest.approx((2 * p - 3) * p / ((p - 1) * (p - 2)) * alpha * beta)
    assert model.one_shot_time("all_reduce", p, x, alpha, beta) == pytest.approx(
        model.ring_time("all_reduce", p, x, alpha, beta))
    # Below it the one-shot is faster, above it the ring.
    assert model.one_shot_time("all_reduce", p, x / 2, alpha, beta) < model.ring_time("all_reduce", p, x / 2, alpha,
                                                                                        beta)
    assert model.one_shot_time("all_reduce", p, 2 * x, alpha, beta) > model.ring_time("all_reduce", p, 2 * x, alpha,
                                                                                        beta)


def test_one_shot_never_loses_where_it_reads_no_more_than_the_ring():
    # P = 2: both read n; reduce-scatter / all-gather read (P-1)/P n either way.
    assert model.one_shot_crossover("all_reduce", 2, 4e-6, 10e9) == math.inf
    for p in range(2, 9):
        for coll in ("reduce_scatter", "all_gather"):
            assert model.one_shot_crossover(coll, p, 4e-6, 10e9) == math.inf
    assert model.one_shot_crossover("all_reduce", 1, 4e-6, 10e9) == 0.0


# --- the all-gather's copies on the CPU transport ------------------------------------------

@pytest.mark.parametrize("p,ring_out,ring_in,direct_out,direct_in", [
    # n = 12 bytes. Ring out of place: own -> slot n/P, own -> output n/P, P-1 chunks left slot -> output,
    # P-2 of them left slot -> own slot; in place the own -> output copy is skipped (dst2 == src).
    (2, 6 + 6 + 6 + 0, 6 + 6 + 0, 6 + 6, 6),   # 1.5 n / n against n / 0.5 n
    (3, 4 + 4 + 8 + 4, 4 + 8 + 4, 8 + 4, 8),
    (4, 3 + 3 + 9 + 6, 3 + 9 + 6, 9 + 3, 9),
    (1, 12, 0, 12, 0),  # one rank: run_call copies input to output, nothing in place
])
def test_all_gather_copied_bytes_by_hand(p, ring_out, ring_in, direct_out, direct_in):
    got = {(path, in_place): model.all_gather_copied_bytes(p, 12, path, in_place)
           for path in ("ring", "direct") for in_place in (False, True)}
    assert got == {("ring", False): ring_out, ("ring", True): ring_in,
                   ("direct", False): direct_out, ("direct", True): direct_in}


@pytest.mark.parametrize("p", range(1, 9))
def test_all_gather_copies_match_the_closed_forms_and_the_ring_schedule(p):
    from ringcoll.learning import schedule as S

    n = 840.0  # divisible by every P here: the library's all-gather chunks are always equal
    assert model.all_gather_copied_bytes(p, n, "ring", False) == pytest.approx((2 * p - 1) / p * n)
    assert model.all_gather_copied_bytes(p, n, "ring", True) == pytest.approx(2 * (p - 1) / p * n)
    assert model.all_gather_copied_bytes(p, n, "direct", False) == pytest.approx(n)
    assert model.all_gather_copied_bytes(p, n, "direct", True) == pytest.approx((p - 1) / p * n)
    if p > 1:
        # Counted from the schedule ring_loop.h runs: the first send writes the own chunk into
        # the slot (and the output), every step writes its chunk to the output when
        # step_writes_output and to the own slot when step_forwards.
        ag, chunk = S.Collective.ALL_GATHER, n / p
        for in_place in (False, True):
            counted = chunk * (1 if in_place else 2) + sum(
                chunk * (S.step_writes_output(ag, t, p) + S.step_forwards(ag, t, p))
                for t in range(S.ring_steps(ag, p)))
            assert model.all_gather_copied_bytes(p, n, "ring", in_place) == pytest.approx(counted)


def test_all_gather_copy_time_is_handshakes_plus_copies():
    alpha, beta_copy, n = 2e-6, 8e9, 1 << 20
    for p in range(2, 9):
        for in_place in (False, True):
            assert model.all_gather_copy_time(p, n, "ring", in_place, alpha, beta_copy) == pytest.approx(
                (p - 1) * alpha + model.all_gather_copied_bytes(p, n, "ring", in_place) / beta_copy)
            assert model.all_gather_copy_time(p, n, "direct", in_place, alpha, beta_copy) == pytest.approx(
                2 * alpha + model.all_gather_copied_bytes(p, n, "direct", in_place) / beta_copy)
    # P = 2: one ring step against two handshakes, 1.5 n against n copied.
    ring, direct = (model.all_gather_copy_time(2, n, path, False, alpha, beta_copy) for path in ("ring", "direct"))
    assert ring == pytest.approx(alpha + 1.5 * n / beta_copy) and direct == pytest.approx(2 * alpha + n / beta_copy)
    assert model.all_gather_copy_time(1, n, "direct", False, alpha, beta_copy) == pytest.approx(n / beta_copy)
    assert model.all_gather_copy_time(1, n, "ring", True, alpha, beta_copy) == 0.0
    with pytest.raises(ValueError, match="path must be one of ring, direct"):
        model.all_gather_copied_bytes(2, n, "oneshot", False)
    with pytest.raises(ValueError, match="world must be >= 1"):
        model.all_gather_copy_time(0, n, "ring", False, alpha, beta_copy)


def test_link_bytes_per_host_two_levels_against_one_flat_ring():
    # The node's L ranks each carry 1/L of the message over the link, in rings of H: a host
    # sends H's bus factor of n; one flat ring numbered host by host crosses each host's
    # boundary once, with one rank's traffic: P's bus factor.
    assert model.link_bytes_per_host("all_reduce", 2, 4) == 1.0
    assert model.link_bytes_per_host("all_reduce", 2, 4, two_level=False) == 1.5
    assert model.link_bytes_per_host("reduce_scatter", 2, 4) == model.link_bytes_per_host("all_gather", 2, 4) == 0.5
    assert model.link_bytes_per_host("all_gather", 2, 4, two_level=False) == 0.75
    assert model.link_bytes_per_host("all_reduce", 4, 32) == 1.5  # 2(H-1)/H, whatever L
    assert model.link_bytes_per_host("all_reduce", 4, 32, two_level=False) == 2 * 31 / 32
    assert model.link_bytes_per_host("all_reduce", 1, 8) == 0.0  # one host: no link


# --- every algorithm priced from its plan --------------------------------------------------------

ALGORITHMS = ["ring", "oneshot", "rhd", "rd", "tree"]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_plan_costs_are_the_docstrings_table(p):
    """Rounds and bytes read off each plan, against the closed forms the docstring gives
    (P a power of two): the table a learner reads is the plans' own."""
    log2 = p.bit_length() - 1
    table = {"ring": (2 * (p - 1), 2 * (p - 1) / p), "oneshot": (1, p - 1), "rhd": (2 * log2, 2 * (p - 1) / p),
             "rd": (log2, log2), "tree": (2 * log2, log2)}
    for name, (rounds, received) in table.items():
        cost = model.plan_cost(plans.plan(name, "all_reduce", p))
        assert (cost.rounds, cost.received) == (rounds, pytest.approx(received)), name
    # Direct reads (all-gather): one round to read every peer's posted input, one to say
    # every read is done; each rank receives the (P-1)/P of the output it does not own.
    direct = model.plan_cost(plans.plan("direct", "all_gather", p))
    assert (direct.rounds, direct.received) == (2, pytest.approx((p - 1) / p))
    # The ring's plan prices as the ring's formula (ring_time) for every collective.
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        assert model.algorithm_time("ring", coll, p, 1e6, 2e-6, 3e9) == pytest.approx(
            model.ring_time(coll, p, 1e6, 2e-6, 3e9))


@pytest.mark.parametrize("p", [3, 5, 6, 7])
def test_rhd_all_reduce_off_a_power_of_two_is_the_textbook_fold(p):
    """P = C + extra, C the largest power of two below P: the extra ranks hand their input
    over and get the result back (two more rounds, n each way), and the C participants run
    Rabenseifner's on equal halves, 2(C-1)/C n. Cutting the message per rank instead (two
    chunks for a rank standing in) made the halves unequal: 2.67 n at P = 6, not 2.5 n."""
    c = 1 << (p.bit_length() - 1)
    cost = model.plan_cost(plans.plan("rhd", "all_reduce", p))
    assert (cost.rounds, cost.received) == (2 * (c.bit_length() - 1) + 2, pytest.approx(2 * (c - 1) / c + 1))


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_crossovers_are_the_lower_envelope(p):
    alpha, beta = 4e-6, 6e9
    segments = model.crossovers("all_reduce", p, alpha, beta, ALGORITHMS)
    assert segments[0][0] == 0
    bounds = [start for start, _ in segments[1:]]
    assert bounds == sorted(bounds)

    def times(n):
        return {name: model.algorithm_time(name, "all_reduce", p, n, alpha, beta) for name in ALGORITHMS}

    for i, (start, best) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else start * 4 + 1e6
        for n in (start + (end - start) * f for f in (0.01, 0.5, 0.99)):
            t = times(n)
            assert t[best] == pytest.approx(min(t.values())), (p, n, best, t)
        if i + 1 < len(segments):  # at a crossover the two algorithms take the same time
            t = times(end)
            assert t[best] == pytest.approx(t[segments[i + 1][1]])
    if p >= 4:  # one step for small messages; for large ones the ring's bytes in fewer rounds (rhd),
        # except where P is not a power of two: rhd's hand-over and hand-back cost 2n more
        assert segments[0][1] == "oneshot" and segments[-1][1] == ("rhd" if p & (p - 1) == 0 else "ring")


def test_fit_plans_recovers_one_alpha_beta_from_several_algorithms():
    alpha, beta = 3e-6, 4e9
    measured = [(name, n, model.algorithm_time(name, "all_reduce", 4, n, alpha, beta))
                for name in ALGORITHMS for n in (1e3, 1e5, 1e7)]
    f = model.fit_plans("all_reduce", 4, measured)
    assert f.alpha == pytest.approx(alpha) and f.beta == pytest.approx(beta)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_symmetric_traffic_counts_each_read_and_write_of_the_zero_copy_collectives(p):
    """Per byte of message, what run_zero_copy (csrc/host/host_symmetric.cpp) reads and writes
    on one rank, counted from its loops: the fold reads chunk k of P inputs and writes it once;
    the all-reduce then copies the P-1 other reduced chunks; the all-gather copies P chunks
    (P-1 in place). docs/symmetric.md's P = 2 table: 2.5, 1.5, 2."""
    chunk = 1.0 / p
    fold = p * chunk + chunk
    assert model.symmetric_traffic("reduce_scatter", p, True) == pytest.approx(fold)
    assert model.symmetric_traffic("all_reduce", p, True) == pytest.approx(fold + 2 * (p - 1) * chunk)
    assert model.symmetric_traffic("all_gather", p, False) == pytest.approx(2 * p * chunk)
    assert model.symmetric_traffic("all_gather", p, True) == pytest.approx(2 * (p - 1) * chunk)
    if p == 2:
        assert [model.symmetric_traffic(c, 2, c != "all_gather") for c in ("all_reduce", "reduce_scatter", "all_gather")] \
            == [2.5, 1.5, 2.0]
    with pytest.raises(ValueError, match="no model for 'broadcast'"):
        model.symmetric_traffic("broadcast", p, True)
