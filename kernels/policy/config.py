"""The policy file (``--exec-policy FILE``, TOML; docs/exec-policy.example.toml shows every key).

    default = "warn"                     # the action of every rule not set below
    writable = ["/workspace", "/tmp"]    # where code may write (write_outside_workspace)
    checks = ["mypkg.checks:no_pickle"]  # custom checks, "module:function"
    entry_points = true                  # also the checks installed in group sandkernel.exec_policy

    [rules]
    subprocess = "deny"                  # an action alone
    [rules.shell]                        # or an action and a message for the model
    action = "deny"
    message = "..."

Any mistake refuses the file at start-up with a :class:`ConfigError` that names the file and the
LINE at fault: tomllib (Python 3.11+) reports syntax errors with their line; for the rest (an
unknown rule, a bad action, a check that does not import) the line is found here by reading the
file's keys.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandkernel.errors import ConfigError
from sandkernel.kernels.policy.findings import Action
from sandkernel.kernels.policy.policy import ExecPolicy, NamedCheck, RuleSetting
from sandkernel.kernels.policy.rules import RULE_NAMES

ENTRY_POINT_GROUP = "sandkernel.exec_policy"
TOP_KEYS = ("default", "writable", "checks", "entry_points", "rules")
RULE_KEYS = ("action", "message")
_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(?:#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")
_TOML_LINE = re.compile(r"at line (\d+)")


def _key_path(text: str) -> tuple[str, ...]:
    return tuple(part.strip().strip("\"'") for part in re.findall(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""", text))


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Where each key (and each table header) of a TOML text is, by its full dotted path: what
    tomllib does not report. Lines inside multi-line strings are skipped; a line inside a
    multi-line array is not a key line. Good enough to point at a mistake, which is its use."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    in_string: str | None = None
    depth = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if in_string is not None:
            if raw.count(in_string) % 2 == 1:
                in_string = None
            continue
        header = _HEADER.match(raw)
        if header and depth == 0:
            table = _key_path(header.group(1))
            lines.setdefault(table, number)
        else:
            key = _KEY.match(raw) if depth == 0 else None
            if key:
                path = table + _key_path(key.group(1))
                for end in range(len(table) + 1, len(path) + 1):
                    lines.setdefault(path[:end], number)
        for quote in ('"""', "'''"):
            if raw.count(quote) % 2 == 1:
                in_string = quote
        code = re.sub(r"""("([^"\\]|\\.)*"|'[^']*')""", "", raw).split("#", 1)[0]
        depth = max(0, depth + code.count("[") - code.count("]")) if not header else depth
    return lines


class _File:
    """One policy file being read: its text and how to say where a mistake is."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.text = text
        self.lines = key_lines(text)

    def line_of(self, *keys: str) -> int | None:
        for end in range(len(keys), 0, -1):
            if keys[:end] in self.lines:
                return self.lines[keys[:end]]
        return None

    def line_holding(self, needle: str, after: int | None) -> int | None:
        for number, raw in enumerate(self.text.splitlines(), start=1):
            if number >= (after or 1) and needle in raw:
                return number
        return after

    def error(self, message: str, line: int | None) -> ConfigError:
        where = f"{self.path}, line {line}" if line else str(self.path)
        return ConfigError(f"exec policy {where}: {message}")


def load_policy(path: Path) -> ExecPolicy:
    """The policy in ``path``; raises :class:`ConfigError` (naming the file and line) for a file
    that cannot be read, is not TOML, or says something this policy cannot do."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the exec policy {path}: {err}") from err
    return parse_policy(text, path)


def parse_policy(text: str, path: Path) -> ExecPolicy:
    """The policy a TOML text describes (``path`` names it in errors)."""
    file = _File(path, text)
    if sys.version_info < (3, 11):
        raise file.error("a TOML policy file needs Python 3.11+ (tomllib)", None)
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        found = _TOML_LINE.search(str(err))
        raise file.error(f"not valid TOML: {err}", int(found.group(1)) if found else None) from None
    for key in data:
        if key not in TOP_KEYS:
            raise file.error(f"unknown key {key!r}; the keys are: {', '.join(TOP_KEYS)}", file.line_of(key))
    default = _action(file, data.get("default", Action.WARN.value), ("default",))
    writable = _writable(file, data.get("writable", ["/workspace", "/tmp"]))
    rules = _rules(file, data.get("rules", {}))
    checks = _checks(file, data.get("checks", []))
    entry_points = data.get("entry_points", True)
    if not isinstance(entry_points, bool):
        raise file.error("entry_points must be true or false", file.line_of("entry_points"))
    if entry_points:
        checks += _entry_point_checks(file)
    known = set(RULE_NAMES) | {rule for named in checks for rule in _declared_rules(named.check)}
    for rule in rules:
        if rule not in known:
            raise file.error(
                f"unknown rule {rule!r}; the built-in rules are {', '.join(RULE_NAMES)} (a custom check "
                "declares its own rule names with a `rules` attribute)",
                file.line_of("rules", rule),
            )
    return ExecPolicy(default=default, rules=rules, writable=writable, checks=checks, source=str(path))


def _action(file: _File, value: Any, keys: tuple[str, ...]) -> Action:
    try:
        return Action(value)
    except ValueError:
        choices = ", ".join(repr(a.value) for a in Action)
        raise file.error(f"{'.'.join(keys)} must be one of {choices}, not {value!r}", file.line_of(*keys)) from None


def _writable(file: _File, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise file.error("writable must be a list of absolute directory paths", file.line_of("writable"))
    for item in value:
        if not item.startswith("/"):
            line = file.line_holding(item, file.line_of("writable"))
            raise file.error(f"writable paths must be absolute (inside the sandbox), not {item!r}", line)
    return tuple(value)


def _rules(file: _File, value: Any) -> dict[str, RuleSetting]:
    if not isinstance(value, dict):
        raise file.error("rules must be a table: [rules] or [rules.NAME]", file.line_of("rules"))
    rules = {}
    for name, setting in value.items():
        if isinstance(setting, str):
            rules[name] = RuleSetting(action=_action(file, setting, ("rules", name)))
            continue
        if not isinstance(setting, dict):
            raise file.error(
                f'rules.{name} must be an action ("allow", "warn", "deny") or a table with action and message',
                file.line_of("rules", name),
            )
        for key in setting:
            if key not in RULE_KEYS:
                raise file.error(
                    f"unknown key {key!r} in rules.{name}; a rule takes {', '.join(RULE_KEYS)}",
                    file.line_of("rules", name, key),
                )
        message = setting.get("message")
        if message is not None and (not isinstance(message, str) or not message.strip()):
            raise file.error(f"rules.{name}.message must be a non-empty string", file.line_of("rules", name, "message"))
        action = _action(file, setting["action"], ("rules", name, "action")) if "action" in setting else None
        rules[name] = RuleSetting(action=action, message=message)
    return rules


def _checks(file: _File, value: Any) -> list[NamedCheck]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise file.error('checks must be a list of "package.module:function" strings', file.line_of("checks"))
    checks = []
    for spec in value:
        line = file.line_holding(f"{spec}", file.line_of("checks"))
        module_name, _, attribute = spec.partition(":")
        if not module_name or not attribute:
            raise file.error(f'check {spec!r} must be written "package.module:function"', line)
        try:
            target: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                target = getattr(target, part)
        except Exception as err:  # an import runs arbitrary code: whatever it raised is the reason
            raise file.error(f"check {spec!r} cannot be loaded: {type(err).__name__}: {err}", line) from None
        if not callable(target):
            raise file.error(f"check {spec!r} is not callable", line)
        checks.append(NamedCheck(spec, target))
    return checks


def _entry_point_checks(file: _File) -> list[NamedCheck]:
    checks = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            target = entry.load()
        except Exception as err:
            raise file.error(
                f"the check of entry point {entry.name!r} ({entry.value}, group {ENTRY_POINT_GROUP}) cannot be "
                f"loaded: {type(err).__name__}: {err}; uninstall it or set entry_points = false",
                file.line_of("entry_points"),
            ) from None
        if callable(target):
            checks.append(NamedCheck(f"entry point {entry.name}", target))
    return checks


def _declared_rules(check: Callable[..., Any]) -> tuple[str, ...]:
    """The rule names a custom check emits: its ``rules`` attribute, else its own name."""
    declared = getattr(check, "rules", None)
    if isinstance(declared, str):
        return (declared,)
    if declared:
        return tuple(str(rule) for rule in declared)
    return (getattr(check, "__name__", ""),)
