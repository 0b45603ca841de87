"""The lab's derived figures stay tied to what they describe (ringcoll/learning/lab/common.py)."""

import pytest

from ringcoll.learning.lab import common


@pytest.mark.parametrize("hidden", [(), (32,), (256, 128), (1024, 1024, 512)])
def test_parameter_count_is_the_built_models(hidden):
    # parameter_count derives the count from the layer widths instead of building the model;
    # it must still be what make_model builds, whatever make_model comes to hold.
    model = common.make_model(hidden, 0)
    assert common.parameter_count(hidden) == sum(p.numel() for p in model.parameters())
