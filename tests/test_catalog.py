"""The operator's profiles file and the check of every tenant request (pure logic, no Docker)."""

from __future__ import annotations

import json

import pytest

from sandkernel.errors import ConfigError, SettingNotPermittedError, UnknownProfileError
from sandkernel.kernels.egress.policy import EgressPolicy
from sandkernel.kernels.lifecycle.catalog import DEFAULT_CEILINGS, OPERATOR_SETTINGS, ProfileCatalog
from sandkernel.kernels.model.profiles import PROFILES, Runtime


def catalog_from(tmp_path, entries, runtime=Runtime.RUNC, egress=None) -> ProfileCatalog:
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(entries))
    return ProfileCatalog.load(path, runtime, egress)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("wheelhouse", "/"),
        ("image", "busybox:latest"),
        ("env", {"LD_PRELOAD": "/workspace/x.so"}),
        ("name", "large"),
    ],
)
def test_operator_owned_settings_are_refused_by_name(setting, value):
    catalog = ProfileCatalog.load()
    with pytest.raises(SettingNotPermittedError, match=f"{setting} can only be set by the operator"):
        catalog.for_tenant("default", {setting: value})


def test_every_profile_setting_has_exactly_one_owner():
    from sandkernel.kernels.lifecycle.catalog import TENANT_SETTINGS

    fields = set(PROFILES["default"].to_dict()) - {"name"}
    assert fields == OPERATOR_SETTINGS | TENANT_SETTINGS
    assert not OPERATOR_SETTINGS & TENANT_SETTINGS


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"memory_mb": 65536}, "memory_mb=65536 is over profile 'default''s ceiling; use 64 to 4096"),
        ({"pids": 32768}, "pids=32768 is over profile 'default''s ceiling; use 16 to 1024"),
        ({"cpus": 64}, "cpus=64 is over profile 'default''s ceiling; use 0.05 to 2"),
        ({"execute_timeout": 86400}, "execute_timeout=86400 is over profile 'default''s ceiling; use 0.1 to 3600"),
        ({"memory_mb": 10}, "memory_mb=10 is out of range; use 64 to 65536"),
        ({"colour": "red"}, "unknown setting 'colour'"),
    ],
)
def test_limits_over_a_ceiling_name_the_range(limits, message):
    with pytest.raises(ConfigError) as err:
        ProfileCatalog.load().for_tenant("default", limits)
    assert message in str(err.value)
    assert not isinstance(err.value, SettingNotPermittedError)


def test_tenants_may_narrow_and_raise_up_to_the_ceiling():
    profile = ProfileCatalog.load().for_tenant("small", {"memory_mb": 4096, "cpus": 0.25, "execute_timeout": 5})
    assert (profile.name, profile.memory_mb, profile.cpus, profile.execute_timeout) == ("small", 4096, 0.25, 5.0)
    assert profile.pids == PROFILES["small"].pids


def test_runtime_downgrade_is_the_operators_choice():
    gvisor = ProfileCatalog.load(default_runtime=Runtime.RUNSC)
    assert gvisor.profile("default").runtime is Runtime.RUNSC
    with pytest.raises(SettingNotPermittedError, match=r"runtime runc is not offered by profile 'default'"):
        gvisor.for_tenant("default", {"runtime": "runc"})
    runc = ProfileCatalog.load(default_runtime=Runtime.RUNC)
    assert runc.for_tenant("default", {"runtime": "runsc"}).runtime is Runtime.RUNSC  # an upgrade is fine


def test_profiles_file_sets_operator_settings_and_ceilings(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    catalog = catalog_from(
        tmp_path,
        {
            "default": {"memory_mb": 768, "ceilings": {"memory_mb": 1024, "runtimes": ["runsc", "runc"]}},
            "analyst": {"extends": "large", "wheelhouse": str(wheels), "env": {"TZ": "UTC"}, "cpus": 1.5},
            "small": None,
        },
        runtime=Runtime.RUNSC,
    )
    assert sorted(catalog.profiles) == ["analyst", "default", "large"]
    analyst = catalog.for_tenant("analyst", {"memory_mb": 2048})
    assert (analyst.wheelhouse, dict(analyst.env), analyst.cpus, analyst.memory_mb) == (str(wheels), {"TZ": "UTC"}, 1.5, 2048)
    assert analyst.runtime is Runtime.RUNSC and analyst.workspace_mb == PROFILES["large"].workspace_mb
    assert catalog.for_tenant("default", {"runtime": "runc"}).runtime is Runtime.RUNC  # listed by the operator
    with pytest.raises(ConfigError, match="use 64 to 1024"):
        catalog.for_tenant("default", {"memory_mb": 1025})
    with pytest.raises(UnknownProfileError, match=r"choose one of \['analyst', 'default', 'large'\]"):
        catalog.for_tenant("small", {})
    described = catalog.describe()
    assert "wheelhouse" not in described["analyst"]["defaults"] and "env" not in described["analyst"]["defaults"]
    assert described["default"]["ceilings"]["memory_mb"] == 1024


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"default": {"memory_mb": 10**9}}, "profile 'default': profile setting memory_mb=1000000000 is out of range"),
        ({"x": {"extends": "nowhere"}}, "profile 'x': extends unknown profile 'nowhere'"),
        ({"a": {"extends": "b"}, "b": {"extends": "a"}}, "makes a cycle"),
        ({"default": {"ceilings": {"memory_mb": 100}}}, "ceiling memory_mb=100 is below the profile's own value 1024"),
        ({"default": {"ceilings": {"runtimes": ["runsc"]}}}, "must include the profile's own runtime runc"),
        ({"default": {"ceilings": {"disk": 1}}}, "unknown ceilings ['disk']"),
        ({"default": None}, 'must include one named "default"'),
        ({"default": {"wheelhouse": "/no/such/dir"}}, "does not exist on the host"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_profiles_files_name_the_fault(tmp_path, entries, message):
    with pytest.raises(ConfigError) as err:
        catalog_from(tmp_path, entries)
    assert message in str(err.value)


def test_network_is_only_ever_narrowed():
    egress = EgressPolicy.from_config({"allow": ["pypi.org", "files.pythonhosted.org"], "ports": [443]})
    closed = ProfileCatalog.load()
    assert closed.for_tenant("default", {"network": "none"}).network is None
    with pytest.raises(SettingNotPermittedError, match="grants no network"):
        closed.for_tenant("default", {"network": "operator"})
    opened = ProfileCatalog.load(egress_policy=egress)
    assert opened.for_tenant("default", {"network": {"allow": ["pypi.org"]}}).network.allow == ("pypi.org",)
    with pytest.raises(SettingNotPermittedError, match="beyond what this gateway permits"):
        opened.for_tenant("default", {"network": {"allow": ["evil.example.com"]}})
    with pytest.raises(SettingNotPermittedError, match="can only be set by the operator"):
        opened.for_tenant("default", {"network": {"allow": ["pypi.org"], "allow_addresses": ["10.0.0.0/8"]}})


def test_default_ceilings_cover_every_limit():
    catalog = ProfileCatalog.load()
    for name, profile in catalog.profiles.items():
        for setting, ceiling in catalog.ceilings[name].limits.items():
            assert ceiling >= getattr(profile, setting)
            assert ceiling == max(DEFAULT_CEILINGS[setting], getattr(profile, setting))
