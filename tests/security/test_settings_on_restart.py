"""Settings that escape the operator (issue 30, item 9): a session that starts again (resume,
rewind, fork, take-over) gets the operator's current settings, not the ones its snapshot
recorded. Here the check itself (pure); the resume that refuses is in
tests/security/test_tenant_limits.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sandkernel.errors import ConfigError, SettingNotPermittedError, UnknownProfileError
from sandkernel.kernels.egress.policy import EgressNotPermitted, EgressPolicy
from sandkernel.kernels.lifecycle.catalog import ProfileCatalog
from sandkernel.kernels.model.profiles import Runtime

pytestmark = pytest.mark.security

OPEN = {"default": {"ceilings": {"memory_mb": 2048, "runtimes": ["runc", "runsc"]}}}
EGRESS = {"allow": ["pypi.org", "files.pythonhosted.org"], "ports": [443]}


def catalog_from(tmp_path, entries, egress=None) -> ProfileCatalog:
    path = tmp_path / f"profiles-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(entries))
    return ProfileCatalog.load(path, Runtime.RUNC, EgressPolicy.from_config(egress) if egress else None)


def test_a_profile_that_still_fits_comes_back_with_the_operators_current_settings(tmp_path):
    then = catalog_from(tmp_path, OPEN, EGRESS)
    recorded = then.for_tenant("default", {"memory_mb": 1536, "runtime": "runsc", "network": {"allow": ["pypi.org"]}})
    now = catalog_from(tmp_path, {"default": {**OPEN["default"], "env": {"PIP_INDEX_URL": "http://mirror"}}}, EGRESS)
    again = now.recheck(recorded)
    assert (again.memory_mb, again.runtime, again.network.allow) == (1536, Runtime.RUNSC, ("pypi.org",))
    assert dict(again.env) == {"PIP_INDEX_URL": "http://mirror"}  # the operator's, as of now
    assert now.recheck(now.profile("default")) == now.profile("default")


@pytest.mark.parametrize(
    ("now", "egress", "error", "words"),
    [
        ({"default": {"ceilings": {"memory_mb": 1024}}}, EGRESS, ConfigError, "over profile 'default''s ceiling"),
        (
            {"default": {"ceilings": {"memory_mb": 2048, "runtimes": ["runc"]}}},
            EGRESS,
            SettingNotPermittedError,
            "runtime runsc is not offered",
        ),
        (OPEN, {"allow": ["files.pythonhosted.org"], "ports": [443]}, EgressNotPermitted, "pypi.org"),
        (OPEN, None, EgressNotPermitted, "grants no network"),
    ],
    ids=["memory-ceiling-lowered", "runtime-withdrawn", "host-dropped-from-the-allowlist", "network-withdrawn"],
)
def test_a_profile_past_the_operators_current_settings_is_refused(tmp_path, now, egress, error, words):
    then = catalog_from(tmp_path, OPEN, EGRESS)
    recorded = then.for_tenant("default", {"memory_mb": 1536, "runtime": "runsc", "network": {"allow": ["pypi.org"]}})
    with pytest.raises(error) as caught:
        catalog_from(tmp_path, now, egress).recheck(recorded)
    assert words in str(caught.value)


def test_a_profile_the_operator_removed_is_refused(tmp_path):
    recorded = dataclasses.replace(ProfileCatalog.load().profile("default"), name="gone")
    with pytest.raises(UnknownProfileError, match="unknown profile 'gone'"):
        ProfileCatalog.load().recheck(recorded)
