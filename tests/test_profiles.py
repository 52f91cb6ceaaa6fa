"""Profile validation: pure logic, so no containers needed."""

import pytest

from sandkernel.errors import ConfigError, UnknownProfileError
from sandkernel.kernels.model.profiles import PROFILES, Runtime, resolve_profile


def test_default_profile_is_bounded():
    p = resolve_profile()
    assert p.name == "default" and p.runtime is Runtime.RUNC
    assert p.memory_mb > 0 and p.pids > 0 and p.cpus > 0 and p.execute_timeout is not None


def test_overrides_apply_and_named_profiles_exist():
    p = resolve_profile("small", {"memory_mb": 300, "runtime": "runsc", "cpus": 0.25})
    assert (p.name, p.memory_mb, p.runtime, p.cpus) == ("small", 300, Runtime.RUNSC, 0.25)
    assert PROFILES["small"].memory_mb == 512  # the shared definition is untouched


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"memory_mb": 10}, "memory_mb=10 is out of range; use 64 to 65536"),
        ({"memory_mb": "lots"}, "memory_mb must be a whole number"),
        ({"pids": 1.5}, "pids must be a whole number"),
        ({"cpus": True}, "cpus must be a number"),
        ({"runtime": "kata"}, "runtime must be one of ['runc', 'runsc']"),
        ({"image": ""}, "image must be a non-empty image reference"),
        ({"wheelhouse": "relative/dir"}, "wheelhouse must be an absolute host directory path"),
        ({"wheelhouse": "/no/such/dir"}, "does not exist on the host"),
        ({"env": {"A": 1}}, "env must be a mapping of strings to strings"),
        ({"network": "all"}, 'network must be "none" or {"allow"'),
        ({"network": {"allow": ["*"]}}, "would allow any host"),
    ],
)
def test_bad_overrides_name_the_fix(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolve_profile("default", overrides)
    assert message in str(err.value)


def test_unknown_profile_lists_the_choices():
    with pytest.raises(
        UnknownProfileError, match=r"unknown profile 'huge'; choose one of \['default', 'large', 'small'\]"
    ):
        resolve_profile("huge")


def test_environment_selects_runtime(monkeypatch):
    monkeypatch.setenv("SANDKERNEL_RUNTIME", "runsc")
    assert resolve_profile().runtime is Runtime.RUNSC
    monkeypatch.setenv("SANDKERNEL_RUNTIME", "nope")
    with pytest.raises(ConfigError, match="runtime must be one of"):
        resolve_profile()
