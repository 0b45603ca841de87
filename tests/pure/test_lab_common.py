"""The lab's derived figures stay tied to what they describe (ringcoll/learning/lab/common.py)."""

import pytest

from ringcoll.learning.lab import common


@pytest.mark.parametrize("hidden", [(), (32,), (256, 128), (1024, 1024, 512)])
def test_parameter_count_is_the_built_models(hidden):
    # parameter_count derives the count from the layer widths instead of building the model;
    # it must still be what make_model builds, whatever make_model comes to hold.
    model = common.make_model(hidden, 0)
    assert common.parameter_count(hidden) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("args", [["straggler", "--local-every", "0"], ["straggler", "--seeds", "0"],
                                  ["straggler", "--epochs", "0"], ["straggler", "--staleness", "-1"],
                                  ["straggler", "--slow", "-0.1"], ["straggler", "--slow", "nan"],
                                  ["memory", "--steps", "0"], ["overlap", "--steps", "-2"]])
def test_lab_refuses_bad_options_before_it_starts_a_rank(capsys, args):
    """argparse's message and status 2, where --local-every 0 started three processes and
    ended in a rank's ZeroDivisionError, 79 lines of traceback."""
    from ringcoll.learning.lab import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main([*args, "--quick"])
    assert exit_.value.code == 2 and args[1] in capsys.readouterr().err
