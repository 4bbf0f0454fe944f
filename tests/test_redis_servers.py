"""The Redis test harness (tests/redis_servers.py) against real redis-server binaries.

Checked with redis-py, independently of the harness's own RESP client: password and ACL-user
servers accept the right credentials and refuse wrong ones, kill + restart keeps the port,
the unix socket answers, maxmemory is enforced, a bad config fails with the server's own
words, and a three-master cluster spreads keys over all nodes.

Missing binaries or redis-py fail these tests (with the install command) instead of skipping:
CI installs the [test] extra, so their absence is a broken environment.
"""

from __future__ import annotations

import os
import socket
import stat

import pytest

from redis_servers import INSTALL_HINT, RedisCluster, RedisServer, redis_binaries

try:
    import redis
    import redis.cluster
except ImportError:  # reported by the fixture below, per test, rather than at collection
    redis = None

PASSWORD = "s3cret pass"  # a space, to exercise config quoting


@pytest.fixture(autouse=True)
def _require_redis():
    if redis is None:
        pytest.fail("redis-py is not installed: " + INSTALL_HINT.split(": ", 1)[1], pytrace=False)
    if redis_binaries() is None:
        pytest.fail(INSTALL_HINT, pytrace=False)


def test_binaries_found():
    server, cli = redis_binaries()
    assert os.access(server, os.X_OK) and os.access(cli, os.X_OK)


def test_password_server():
    with RedisServer(password=PASSWORD) as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url, password=PASSWORD)
        assert client.ping()
        client.set("k", b"v")
        assert client.get("k") == b"v"
        assert redis.Redis.from_url(server.url_with_credentials).get("k") == b"v"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, password="wrong").ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).get("k")
        # private folder, log inside it; closing removes both and ends the process
        folder, pid = server.directory, server.pid
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert "Ready to accept connections" in server.log_path.read_text()
    assert not folder.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_acl_user():
    with RedisServer(username="kv", password=PASSWORD) as server:
        client = redis.Redis.from_url(server.url, username="kv", password=PASSWORD)
        assert client.acl_whoami() in ("kv", b"kv")  # redis-py decodes this reply
        client.set("k", 1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, username="kv", password="wrong").ping()
        with pytest.raises(redis.AuthenticationError):  # the default user is off
            redis.Redis.from_url(server.url).ping()
        assert redis.Redis.from_url(server.url_with_credentials).get("k") == b"1"


def test_kill_and_restart_same_port():
    with RedisServer(password=PASSWORD) as server:
        client = redis.Redis.from_url(server.url, password=PASSWORD)
        client.set("k", 1)
        port, pid = server.port, server.pid
        server.kill()
        assert not server.is_running()
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url, password=PASSWORD).ping()
        server.restart()
        assert server.port == port and server.pid != pid and server.is_running()
        # same address and password, empty (no persistence); the old client reconnects
        assert client.get("k") is None
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, password="wrong").ping()
        server.stop()
        assert not server.is_running()
        server.restart()
        assert client.ping()


def test_unix_socket():
    with RedisServer(password=PASSWORD, unix_socket=True) as server:
        assert server.url == f"unix://{server.socket_path}?db=0"
        assert stat.S_ISSOCK(os.stat(server.socket_path).st_mode)
        client = redis.Redis.from_url(server.url, password=PASSWORD)
        client.set("k", b"via socket")
        assert client.connection_pool.connection_class is redis.UnixDomainSocketConnection
        tcp = redis.Redis.from_url(server.tcp_url, password=PASSWORD)
        assert tcp.get("k") == b"via socket"


def test_maxmemory_enforced():
    with RedisServer(maxmemory="2mb", maxmemory_policy="noeviction") as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory") == {"maxmemory": str(2 * 1024 * 1024)}
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(64):
                client.set(f"k{i}", b"x" * 100_000)


def test_bad_config_reports_log_tail():
    with pytest.raises(RuntimeError, match="Bad directive"):
        RedisServer(extra_config={"no-such-directive": "1"})


def test_port_in_use_is_reported():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="could not bind port"):
            RedisServer(port=taken.getsockname()[1])


def test_cluster_spreads_keys_over_three_masters():
    with RedisCluster(password=PASSWORD) as cluster:
        assert len(cluster.startup_nodes) == 3 and cluster.url == cluster.urls[0]
        client = redis.cluster.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in cluster.startup_nodes],
            password=PASSWORD)
        keys = [f"key:{i}" for i in range(100)]
        for i, key in enumerate(keys):
            client.set(key, i)
        assert [int(client.get(key)) for key in keys] == list(range(100))
        # each key sits on the node the client routes it to, and every master got some
        per_node = {port: 0 for _, port in cluster.startup_nodes}
        for key in keys:
            per_node[client.get_node_from_key(key).port] += 1
        for node in cluster.nodes:
            direct = redis.Redis.from_url(node.url, password=PASSWORD)
            assert direct.dbsize() == per_node[node.port] > 0
        assert sum(per_node.values()) == 100
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(cluster.url, password="wrong").ping()
