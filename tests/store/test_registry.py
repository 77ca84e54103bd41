"""Tiers by URL scheme: every URL kamera took before still opens its tier, an unknown scheme is
refused by name with the registered ones, and a third party's tier is one registration away;
every tier's numbers reach ``/metrics`` through the one wrapper, whatever the tier."""

from __future__ import annotations

import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.errors import ConfigError, StoreURLError, UnknownTierSchemeError
from kamera_agent.serve.metrics import Metrics
from kamera_agent.store import ChunkStore
from kamera_agent.store.registry import TIERS, TierRegistry
from kamera_agent.store.remote import RemoteTier
from kamera_agent.store.s3 import S3Tier
from kamera_agent.store.tier import TierContext
from kamera_agent.testing import FakeTier
from tests.store.test_chunk_store import FP, make_kv


class UrlFakeTier(FakeTier):
    """`FakeTier` opened from a ``fake://label`` URL: what a third party's tier looks like."""

    @classmethod
    def check_url(cls, url: str) -> None:
        if not url.removeprefix("fake://"):
            raise StoreURLError("fake:// needs a label: fake://name")

    @classmethod
    def from_url(cls, url: str, context: TierContext) -> UrlFakeTier:
        return cls(label=url.removeprefix("fake://"))


@pytest.mark.parametrize(
    ("url", "tier"),
    [
        ("redis://127.0.0.1:6379/0", RemoteTier),
        ("valkey://127.0.0.1", RemoteTier),
        ("rediss://user:pw@host:6380/1", RemoteTier),
        ("valkeys://host", RemoteTier),
        ("redis+cluster://h1:7000,h2:7001", RemoteTier),
        ("REDIS://host", RemoteTier),
        ("s3://bucket/prefix?endpoint=http://127.0.0.1:9000", S3Tier),
    ],
)
def test_every_url_kamera_took_opens_its_tier(url: str, tier: type) -> None:
    assert TIERS.tier_class(url) is tier
    TIERS.check(url)
    assert WindowConfig(store_url=url).store_urls == (url,)


@pytest.mark.parametrize("url", ["ftp://host/x", "host:6379", "mongodb://db"])
def test_an_unknown_scheme_names_itself_and_the_registered_ones(url: str) -> None:
    with pytest.raises(UnknownTierSchemeError, match=r"registered: .*redis.*s3") as caught:
        ChunkStore(fingerprint=FP, memory_limit=1 << 20, urls=[url])
    scheme = url.partition("://")[0] if "://" in url else "no scheme"
    assert scheme in str(caught.value) and "register" in str(caught.value)
    with pytest.raises(ConfigError, match="no tier is registered"):
        WindowConfig(store_url=url)


def test_a_bad_url_of_a_known_scheme_is_refused_before_anything_opens() -> None:
    for url in ("s3://", "s3://Bad_Bucket", "s3://bucket?speed=9", "s3://k:s@bucket", "redis://h:99999"):
        with pytest.raises(StoreURLError):
            TIERS.check(url)
    with pytest.raises(ConfigError, match="credentials"):
        WindowConfig(store_url=("redis://h", "s3://key:secret@bucket"))


def test_a_third_party_tier_is_one_registration() -> None:
    registry = TierRegistry()
    with pytest.raises(UnknownTierSchemeError):
        registry.check("fake://a")
    registry.register("fake", "tests.store.test_registry:UrlFakeTier")  # imported on first use
    assert "fake" in registry.schemes
    with ChunkStore(
        fingerprint=FP, memory_limit=1 << 20, urls=["fake://a", "fake://b"], registry=registry
    ) as store:
        store.put_canonical(make_kv("x", 4))
        assert list(store.tiers) == ["fake", "fake_2"]  # a second tier of a kind gets its own name
        stats = store.stats().tiers
    assert stats["fake"].puts == stats["fake_2"].puts == 1
    with pytest.raises(StoreURLError, match=r"not 'module\.path:ClassName'"):
        registry.register("bad", "no_colon_here")
    registry.register("gone", "tests.store.no_such_module:Tier")
    with pytest.raises(StoreURLError, match="does not import"):
        registry.check("gone://x")


def test_a_failed_url_opens_nothing() -> None:
    registry = TierRegistry()
    opened: list[UrlFakeTier] = []

    class Recorded(UrlFakeTier):
        @classmethod
        def from_url(cls, url: str, context: TierContext) -> UrlFakeTier:
            if url.endswith("boom"):
                raise StoreURLError("boom")
            opened.append(tier := cls(label="ok"))
            return tier

        def close(self) -> None:
            self.down = True

    registry.register("rec", Recorded)
    with pytest.raises(StoreURLError, match="boom"):
        ChunkStore(fingerprint=FP, memory_limit=1 << 20, urls=["rec://ok", "rec://boom"], registry=registry)
    assert [tier.down for tier in opened] == [True]  # the one opened was closed again


def test_store_urls_come_from_the_setting_or_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAMERA_STORE_URL", "redis://a:6379/0  s3://bucket/p")
    assert WindowConfig().store_urls == ("redis://a:6379/0", "s3://bucket/p")
    assert WindowConfig(store_url=["valkey://b"]).store_urls == ("valkey://b",)
    monkeypatch.delenv("KAMERA_STORE_URL")
    assert WindowConfig().store_urls == () and WindowConfig().shared_store_url is None
    with pytest.raises(ConfigError, match="empty list"):
        WindowConfig(store_url=[])


def test_every_tier_reaches_metrics_without_code_of_its_own(tmp_path: object) -> None:
    fake = FakeTier(label="x")
    with ChunkStore(
        fingerprint=FP, memory_limit=1 << 20, disk_dir=str(tmp_path), disk_limit=1 << 20, tiers=[fake]
    ) as store:
        store.put_canonical(make_kv("a", 4))
        fake.down = True
        assert store.get_canonical("missing") is None
        text = Metrics(dict, lambda: store.stats().tiers).render()
    assert 'kamera_store_tier_puts_total{tier="fake"} 1' in text
    assert 'kamera_store_tier_unavailable_total{tier="fake"} 1' in text
    assert 'kamera_store_tier_misses_total{tier="disk"} 1' in text
    assert "# TYPE kamera_store_tier_get_seconds_total counter" in text


def test_kamera_store_refuses_a_tier_that_cannot_count_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kamera_agent.cli import main

    registry = TierRegistry()
    registry.register("fake", UrlFakeTier)
    monkeypatch.setattr("kamera_agent.store.command.TIERS", registry)
    for url, said in (("fake://a", "cannot count its entries"), ("ftp://host", "registered: ")):
        assert main(["store", "stats", "--url", url]) == 2
        out = capsys.readouterr().out
        assert said in out and "Traceback" not in out


def test_what_grew_is_each_tier_change_once_per_store_in_a_process() -> None:
    from kamera_agent.engines.stores import StoreRegistry
    from kamera_agent.store.instrumented import tier_series

    registry, fake = StoreRegistry(), FakeTier(label="x")
    with ChunkStore(fingerprint=FP, memory_limit=1 << 20, tiers=[fake]) as store:
        store.put_canonical(make_kv("a", 4))
        first = registry.tier_growth(store)
        assert first["fake"]["puts"] == 1 and first["fake"]["bytes_written"] > 0
        assert registry.tier_growth(store) == {}  # a second caller of one store gets only what is new
        fake.down = True
        assert store.get_canonical("missing") is None
        grown = registry.tier_growth(store)["fake"]
    assert grown["gets"] == grown["unavailable"] == 1 and "puts" not in grown
    series = {s.name: s for s in tier_series({"fake": grown})}
    assert series["store_tier_unavailable"].values == {"fake": 1.0} and series["store_tier_puts"].values == {}
