"""docs/settings.md is what the settings render (gateway/settings_doc.py): a setting added,
renamed or given another default changes the reference in the same commit."""

from __future__ import annotations

import dataclasses

from sandkernel.gateway.settings import GatewaySettings
from sandkernel.gateway.settings_doc import render

from .conftest import ROOT


def test_docs_settings_md_is_what_the_settings_render():
    written = (ROOT / "docs" / "settings.md").read_text()
    assert written == render(), (
        "docs/settings.md is stale: python -m sandkernel.gateway.settings_doc > docs/settings.md"
    )


def test_every_setting_has_its_row_with_flag_and_variable():
    rendered = render()
    for field in dataclasses.fields(GatewaySettings):
        assert f"| `{field.name}` |" in rendered, field.name
    assert "`--pool-size`" in rendered and "`SANDKERNEL_POOL_SIZE`" in rendered
