"""The [cluster] section: defaults, environment, and a precise error for each mistake."""

from __future__ import annotations

import pytest

from kvd import config as kvd_config
from kvd.cluster.node import advertised_address, etcd_settings, node_name
from kvd.errors import ConfigError


def load(**overrides):
    config = kvd_config.load(env={}, overrides=overrides)
    config.validate()
    return config


def test_standalone_by_default_and_endpoints_from_the_environment():
    assert load().cluster.etcd_endpoints == []
    config = kvd_config.load(env={"KVD_CLUSTER_ETCD_ENDPOINTS": "10.0.0.1:2379,10.0.0.2:2379",
                                  "KVD_CLUSTER_NODE_NAME": "gpu-07", "KVD_CLUSTER_SECRET_FILE": "/etc/kvd/secret"})
    config.validate()
    settings = etcd_settings(config)
    assert list(settings.endpoints) == [("10.0.0.1", 2379), ("10.0.0.2", 2379)]
    assert settings.member_key("gpu-07") == b"/kvd/members/gpu-07" and node_name(config) == "gpu-07"
    assert advertised_address(config, 43210) == "127.0.0.1:43210"


E = {"cluster.etcd_endpoints": "h:1", "cluster.secret_file": "/s"}


@pytest.mark.parametrize("overrides, field", [
    ({"cluster.etcd_endpoints": "h:1"}, "cluster.secret_file"),
    ({**E, "server.tls_cert_file": "c", "server.tls_key_file": "k"}, "cluster.peer_ca_file"),
    ({**E, "cluster.peer_ca_file": "ca"}, "cluster.peer_ca_file"),
    ({**E, "cluster.peer_server_name": "kvd"}, "cluster.peer_server_name"),
    ({**E, "server.tls_cert_file": "c", "server.tls_key_file": "k", "cluster.peer_ca_file": "ca",
      "cluster.peer_cert_file": "p"}, "cluster.peer_cert_file"),
    ({**E, "cluster.rpc_timeout_s": 0}, "cluster.rpc_timeout_s"),
    ({**E, "cluster.publish_interval_ms": 0}, "cluster.publish_interval_ms"),
    ({**E, "cluster.directory_max_entries": 0}, "cluster.directory_max_entries"),
    ({**E, "cluster.directory_replicas": 9}, "cluster.directory_replicas"),
    ({**E, "cluster.transport": "rdma"}, "cluster.transport"),
    ({"cluster.etcd_endpoints": "nohost"}, "cluster.etcd_endpoints[0]"),
    ({**E, "cluster.node_name": "bad/name"}, "cluster.node_name"),
    ({**E, "cluster.advertise_address": "x"}, "cluster.advertise_address"),
    ({**E, "server.tcp_address": ""}, "cluster.advertise_address"),
    ({**E, "cluster.key_prefix": "kvd"}, "cluster.key_prefix"),
    ({**E, "cluster.lease_ttl_s": 0}, "cluster.lease_ttl_s"),
    ({**E, "cluster.etcd_cert_file": "c.pem"}, "cluster.etcd_cert_file"),
    ({**E, "cluster.etcd_cert_file": "c", "cluster.etcd_key_file": "k"},
     "cluster.etcd_ca_file"),
    ({**E, "cluster.segment_blocks": 0}, "cluster.segment_blocks"),
])
def test_each_mistake_names_its_setting(overrides, field):
    with pytest.raises(ConfigError) as caught:
        load(**overrides)
    assert caught.value.field == field, str(caught.value)
