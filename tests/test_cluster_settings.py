"""The cluster settings (issue 18) belong together, and the catalog URL's password never shows."""

from __future__ import annotations

import pytest

from sandkernel.errors import ConfigError
from sandkernel.gateway.settings import GatewaySettings

URL = "postgresql://sk:s3cr3t-pw@db.internal/sandkernel"


def test_single_host_is_the_default():
    settings = GatewaySettings()
    assert not settings.cluster and settings.catalog_url is None


def test_a_cluster_needs_the_shared_secret_and_names_the_flag():
    with pytest.raises(ConfigError, match="--cluster-secret-file") as caught:
        GatewaySettings(catalog_url=URL)
    assert "s3cr3t-pw" not in str(caught.value)


@pytest.mark.parametrize("url", ["mysql://sk:s3cr3t-pw@db/x", "s3cr3t-pw", "sqlite:///tmp/x"])
def test_only_a_postgresql_catalog_is_accepted_and_the_url_is_not_echoed(url, tmp_path):
    with pytest.raises(ConfigError, match="postgresql://") as caught:
        GatewaySettings(catalog_url=url, cluster_secret_file=tmp_path / "secret")
    assert "s3cr3t-pw" not in str(caught.value)


def test_the_catalog_url_is_not_in_the_settings_repr(tmp_path):
    settings = GatewaySettings(catalog_url=URL, cluster_secret_file=tmp_path / "secret")
    assert settings.cluster and "s3cr3t-pw" not in repr(settings)


@pytest.mark.parametrize("host_id", ["", "a b", "-lead", "x" * 64, "h/1", "h;rm"])
def test_a_host_id_is_a_plain_name(host_id):
    with pytest.raises(ConfigError, match="host_id"):
        GatewaySettings(host_id=host_id)


def test_defaults_come_from_the_machine_and_the_port():
    settings = GatewaySettings(port=9123, host_id="node-2.lab", advertise_url="http://10.213.0.2:9123/")
    assert settings.cluster_host_id == "node-2.lab"
    assert settings.cluster_url == "http://10.213.0.2:9123"
    assert GatewaySettings(port=9123).cluster_url.endswith(":9123")


def test_an_advertised_url_is_http():
    with pytest.raises(ConfigError, match="advertise_url"):
        GatewaySettings(advertise_url="file:///etc/passwd")
