"""stages.common.device_checks: the flags the kernels set on bad values, read where the caller syncs."""

import pytest

from stages.common.device_checks import BAD_BETA, BAD_GATE, BAD_SLOT, FLAG_COUNT, MESSAGES, flags_for, raise_if_flagged

torch = pytest.importorskip("torch")


def test_one_flag_tensor_per_device_whatever_its_name():
    assert flags_for("cpu") is flags_for(torch.device("cpu"))
    assert flags_for("cpu").shape == (FLAG_COUNT,) and flags_for("cpu").dtype == torch.int32


@pytest.mark.parametrize("kinds", [[BAD_GATE], [BAD_BETA], [BAD_SLOT], [BAD_GATE, BAD_SLOT]])
def test_flags_raise_once_with_each_message_and_are_cleared(kinds):
    raise_if_flagged("cpu")  # nothing flagged: no error
    flags_for("cpu")[kinds] = 1
    with pytest.raises(ValueError) as raised:
        raise_if_flagged("cpu")
    for kind in range(FLAG_COUNT):
        assert (MESSAGES[kind] in str(raised.value)) == (kind in kinds)
    assert not flags_for("cpu").any()
    raise_if_flagged("cpu")  # cleared: the next read is quiet
