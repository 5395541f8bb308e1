"""The Lighthouses of a run: the policy's on ft.lighthouse_port (or an external one), the PPO critic's its own."""

import socket

from omegaconf import OmegaConf

from rlfw.config.schema import RLConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fixed_lighthouse_port_is_the_policys_and_the_critic_gets_another():
    from rlfw.ft.lighthouse import start_lighthouse

    cfg = OmegaConf.structured(RLConfig)
    cfg.ft.lighthouse_port = free_port()
    actor, actor_address = start_lighthouse(cfg, "actor")
    try:
        critic, critic_address = start_lighthouse(cfg, "critic")
        try:
            assert actor_address == f"http://127.0.0.1:{cfg.ft.lighthouse_port}"
            assert critic_address.startswith("http://127.0.0.1:") and critic_address != actor_address
        finally:
            critic.shutdown()
    finally:
        actor.shutdown()


def test_an_external_lighthouse_serves_the_policy_only():
    from rlfw.ft.lighthouse import start_lighthouse

    cfg = OmegaConf.structured(RLConfig)
    cfg.ft.lighthouse_address = "http://127.0.0.1:1"
    assert start_lighthouse(cfg, "actor") == (None, "http://127.0.0.1:1")
    critic, address = start_lighthouse(cfg, "critic")
    critic.shutdown()
    assert address != "http://127.0.0.1:1"



def test_heartbeat_ages_read_what_the_lighthouse_heard():
    """rlfw reads heartbeats off the Lighthouse's /status page (torchft has no other accessor): pinned here
    against a real Lighthouse, so a torchft upgrade that changes the page fails this test, not a run."""
    import time
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    from rlfw.ft.lighthouse import Lighthouse, heartbeat_ages

    lighthouse = Lighthouse("127.0.0.1", 0, 1, 0.5, 2.0)
    try:
        assert heartbeat_ages(lighthouse.address) == {}
        client = LighthouseClient(lighthouse.address, connect_timeout=timedelta(seconds=10))
        client.heartbeat("cell_3:0f1e")
        time.sleep(0.5)
        [(replica, age)] = heartbeat_ages(lighthouse.address).items()
        assert replica == "cell_3:0f1e" and 0.4 < age < 30
    finally:
        lighthouse.shutdown()
