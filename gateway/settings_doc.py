"""docs/settings.md, generated from the gateway's settings (gateway/settings.py), so the reference
an operator reads is the one ``sandkernel serve --help`` prints and cannot drift from it.

``python -m sandkernel.gateway.settings_doc > docs/settings.md`` writes it again;
tests/test_settings_doc.py fails when the file differs from what this renders.
"""

from __future__ import annotations

import dataclasses
import sys

from sandkernel.gateway.settings import CONFIG_ENV, GatewaySettings, env_name, flag_name, shown_default

HEADER = f"""# Gateway settings

Generated from `gateway/settings.py` by `python -m sandkernel.gateway.settings_doc > docs/settings.md`
(tests/test_settings_doc.py keeps it in sync); `sandkernel serve --help` prints the same.

Each setting comes from, highest first: its command-line flag, its environment variable, a
settings file (`--config FILE` or `${CONFIG_ENV}`: TOML when the name ends in `.toml`, else JSON,
keys as in the first column; an unknown key is refused), then the default. Everything here is
the operator's: a tenant never reaches these settings (what a tenant may narrow per session is
in the profiles file, `--profiles`).

| setting | flag | environment | default | what it does |
|---|---|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole of docs/settings.md."""
    rows = [
        f"| `{f.name}` | `{flag_name(f)}` | `{env_name(f)}` | {_cell(shown_default(f))} | {_cell(f.metadata['help'])} |"
        for f in dataclasses.fields(GatewaySettings)
    ]
    return HEADER + "\n".join(rows) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
