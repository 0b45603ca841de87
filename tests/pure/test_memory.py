"""ringcoll memory: the worked examples exactly, ZeRO's arithmetic, activations, --measure."""

import pytest
import torch

from ringcoll.learning import memory
from ringcoll.learning.cli import main
from ringcoll.learning.memory import GB, TransformerShape, activation_bytes, checkpointing_recompute_bytes, ledger

SHAPE_7B = TransformerShape(batch=1, seq=2048, hidden=4096, layers=32, heads=32)


def test_worked_example_7b_is_84_gb():
    led = ledger(7e9)
    assert (led.weights, led.gradients, led.optimizer_state) == (14 * GB, 14 * GB, 56 * GB)
    assert led.model_states == 84 * GB == led.total
    assert led.precision.bytes_per_param == 12


def test_worked_example_7b_with_master_copy_is_112_gb():
    led = ledger(7e9, precision="mixed+master")
    assert led.model_states == 112 * GB
    assert led.precision.bytes_per_param == 16
    assert (led.weights, led.gradients, led.optimizer_state) == (14 * GB, 14 * GB, 84 * GB)


def test_worked_example_zero1_over_8_is_35_gb():
    led = ledger(7e9, world=8, zero_stage=1)
    assert (led.weights, led.gradients, led.optimizer_state) == (14 * GB, 14 * GB, 7 * GB)
    assert led.model_states == 35 * GB


def test_worked_example_70b_is_840_gb():
    assert ledger(70e9).model_states == 840 * GB
    assert ledger(70e9).model_states / 70e9 == 12


@pytest.mark.parametrize("precision", list(memory.PRECISIONS))
@pytest.mark.parametrize("world", [1, 2, 8, 64])
def test_each_zero_stage_divides_the_right_terms(precision, world):
    full = ledger(1e9, world, 0, precision)
    for stage in range(4):
        led = ledger(1e9, world, stage, precision)
        sharded = {"optimizer_state": stage >= 1, "gradients": stage >= 2, "weights": stage >= 3}
        for term, is_sharded in sharded.items():
            want = getattr(full, term) / world if is_sharded else getattr(full, term)
            assert getattr(led, term) == pytest.approx(want, rel=1e-12), (stage, term)


def test_zero_formulas_in_closed_form():
    n, p = 10e9, 16
    for prec in memory.PRECISIONS.values():
        w, g, o = prec.weight_bytes * n, prec.grad_bytes * n, prec.optimizer_bytes * n
        got = [ledger(n, p, s, prec).model_states for s in range(4)]
        assert got == pytest.approx([w + g + o, w + g + o / p, w + (g + o) / p, (w + g + o) / p])


def test_activations_follow_korthikanti():
    s, b, h, a, L = 2048, 1, 4096, 32, 32
    assert memory.layer_activation_bytes(SHAPE_7B) == s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes(SHAPE_7B) == L * s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes(SHAPE_7B, checkpointing=True) == L * 2 * s * b * h
    assert activation_bytes(SHAPE_7B, attention_scores=False) == L * 34 * s * b * h


def _with(**changes):
    fields = dict(batch=2, seq=512, hidden=1024, layers=8, heads=16)
    fields.update(changes)
    return TransformerShape(**fields)


def test_activations_linear_in_batch_and_layers_superlinear_in_seq():
    for ckpt in (False, True):
        base = activation_bytes(_with(), ckpt)
        assert activation_bytes(_with(batch=6), ckpt) == pytest.approx(3 * base)
        assert activation_bytes(_with(layers=24), ckpt) == pytest.approx(3 * base)
    # Linear in s for the 34sbh part and with checkpointing; s^2 for the attention scores.
    assert activation_bytes(_with(seq=1024), True) == pytest.approx(2 * activation_bytes(_with(), True))
    assert activation_bytes(_with(seq=1024), attention_scores=False) == pytest.approx(
        2 * activation_bytes(_with(), attention_scores=False))
    assert activation_bytes(_with(seq=1024)) > 2 * activation_bytes(_with())
    sizes = [activation_bytes(_with(seq=s)) for s in (128, 256, 512, 1024, 4096)]
    assert sizes == sorted(sizes)


def test_checkpointing_is_smaller_and_zero_does_not_shard_activations():
    for shape in (SHAPE_7B, _with()):
        assert activation_bytes(shape, True) < activation_bytes(shape, False)
        assert activation_bytes(shape, True) + memory.checkpointing_recompute_bytes(shape) < \
            activation_bytes(shape, False)
    for stage in range(4):
        led = ledger(7e9, 8, stage, shape=SHAPE_7B)
        assert led.activations == activation_bytes(SHAPE_7B)
        assert led.total == led.model_states + led.activations


def test_bad_arguments():
    with pytest.raises(ValueError, match="zero_stage"):
        ledger(1e9, zero_stage=4)
    with pytest.raises(ValueError, match="precision"):
        ledger(1e9, precision="fp8")


def test_measure_agrees_with_the_fp32_prediction():
    m = memory.measure(width=64, depth=2, batch=4, device="cpu")
    n = m["params"]
    assert n == 2 * (64 * 256 + 256 + 256 * 64 + 64)
    for term in ("weights", "gradients", "optimizer_state"):
        assert m["measured"][term] == pytest.approx(m["predicted"][term], rel=0.02)
    # Counted from tensors, they are exact: 4N, 4N and 8N bytes.
    assert m["measured"]["weights"] == m["measured"]["gradients"] == 4 * n
    assert m["measured"]["optimizer_state"] == 8 * n
    assert m["measured"]["step_counters"] <= 8 * m["param_tensors"]


def test_cli_memory_prints_the_worked_examples(capsys):
    assert main(["memory", "--params", "7e9"]) == 0
    out = capsys.readouterr().out
    assert "GB = 1e9 bytes" in out
    assert "14.00    14.00    14.00" in out and "56.00     7.00" in out
    assert "84.00    35.00" in out and "112.00" in out
    assert main(["memory", "--params", "70e9", "--world", "1", "--precision", "mixed"]) == 0
    assert "840.00" in capsys.readouterr().out
    for bad, why in ((["--params", "-5"], "at least 1"), (["--params", "0"], "at least 1"),
                     (["--params", "0.4"], "at least 1"),  # it printed N = 0 and a table of zeros
                     (["--params", "inf"], "finite"), (["--params", "1e400"], "finite"),  # OverflowError
                     (["--params", "7e9", "--world", "0"], "above 0"),
                     (["--params", "7e9", "--hidden", "-1", "--layers", "2", "--heads", "2"], "above 0")):
        with pytest.raises(SystemExit) as exit_:  # it printed a table of -0.00 for --params -5
            main(["memory", *bad])
        assert exit_.value.code == 2 and why in capsys.readouterr().err, bad


def test_cli_memory_activations_and_measure(capsys):
    assert main(["memory", "--params", "7e9", "--hidden", "4096", "--layers", "32", "--heads", "32",
                 "--measure", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"{activation_bytes(SHAPE_7B) / GB:.2f} GB" in out
    assert f"{activation_bytes(SHAPE_7B, True) / GB:.2f} GB" in out
    # the checkpointed total, and at its recompute peak: one layer's full activations more (it left them out)
    checkpointed = ledger(7e9, 8, 0, shape=SHAPE_7B, checkpointing=True).total
    peak = checkpointed + checkpointing_recompute_bytes(SHAPE_7B)
    assert f"+ activations, checkpointed         {checkpointed / GB:.2f}" in out
    assert f"  at the recompute peak             {peak / GB:.2f}" in out and f"{peak / GB:.2f}" == "85.49"
    assert "predicted" in out and "measured" in out and "1.0000" in out


@pytest.mark.parametrize("args, why", [
    (["--hidden", "4096"], "need --hidden, --layers and --heads together"),  # exited 1, the others 2
    (["--no-attention-scores"], "--no-attention-scores changes the activations"),  # ignored
    (["--measure", "--device", "bogus"], "--device must be cpu or cuda"),  # a traceback after the table
    (["--measure", "--device", "cuda"] if not torch.cuda.is_available() else ["--measure", "--device", "tpu"],
     "--device"),  # AttributeError from torch._C on a CPU-only torch
    (["--device", "cpu"], "give --measure too"),  # ignored
])
def test_cli_memory_refuses_what_it_cannot_honour_before_printing(capsys, args, why):
    assert main(["memory", "--params", "7e9", *args]) == 2
    captured = capsys.readouterr()
    assert why in captured.err and captured.out == ""
