import os

import pytest

from netns_cluster import netns_available


@pytest.fixture(scope="session")
def netns_ok():
    """Multi-node tests need root and ``ip netns``. Outside CI they skip with the reason; in CI
    (``RLFW_REQUIRE_NETNS=1``, set by ``.ci/run``) a missing capability is a failure, not a skip."""
    why = netns_available()
    if why:
        if os.environ.get("RLFW_REQUIRE_NETNS") == "1":
            pytest.fail(f"RLFW_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)
