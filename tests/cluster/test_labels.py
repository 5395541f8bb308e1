import pytest

from rlfw.cluster.labels import parse_labels


def test_labels_parse_as_ray_start_writes_them_or_with_colons():
    assert parse_labels("") == {}
    assert parse_labels("role=train") == {"role": "train"}
    assert parse_labels("role:train, zone=us-1") == {"role": "train", "zone": "us-1"}
    assert parse_labels("zone=in(a,b),gpu=!h100") == {"zone": "in(a,b)", "gpu": "!h100"}


@pytest.mark.parametrize("bad", ["role", "=train", "role=", "a=1,,b=2"])
def test_a_malformed_label_is_refused(bad):
    with pytest.raises(ValueError, match="is not key=value"):
        parse_labels(bad)
