"""The forwarding gateway's short memory of where other hosts' sessions are (gateway/cluster/forward.py)."""

from __future__ import annotations

import datetime as dt

from sandkernel.gateway.cluster import forward
from sandkernel.gateway.cluster.catalog import HostInfo
from sandkernel.gateway.cluster.forward import OwnerCache

BEAT = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


def host(name: str) -> HostInfo:
    return HostInfo(name, f"http://{name}:8888", ("runc",), 10, 0, 10, "up", BEAT)


def test_an_owner_is_remembered_briefly_then_asked_again(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(forward.time, "monotonic", lambda: now[0])
    cache = OwnerCache()
    cache.put("s:1", (host("a"), "alice"))
    assert cache.get("s:1") == (host("a"), "alice")
    now[0] += forward.OWNER_CACHE_SECONDS + 0.01
    assert cache.get("s:1") is None


def test_a_host_that_cannot_be_reached_is_forgotten_with_all_its_sessions():
    cache = OwnerCache()
    cache.put("s:1", (host("a"), "alice"))
    cache.put("k:2", (host("a"), "bob"))
    cache.put("s:3", (host("b"), "alice"))
    cache.forget_host("a")
    assert cache.get("s:1") is None and cache.get("k:2") is None
    assert cache.get("s:3") == (host("b"), "alice")


def test_the_cache_is_bounded_and_drops_the_oldest(monkeypatch):
    monkeypatch.setattr(forward, "OWNER_CACHE_ENTRIES", 3)
    cache = OwnerCache()
    for i in range(5):
        cache.put(f"s:{i}", (host("a"), "alice"))
    assert [cache.get(f"s:{i}") is not None for i in range(5)] == [False, False, True, True, True]
