"""An operator's execution policy: which rules warn or deny, with which message, where code may
write, and which custom checks run beside the built-in review.

``ExecPolicy.review`` is pure and synchronous (the gate runs it in a worker thread); it never
raises for the code it is given: a cell that does not parse has no findings (the kernel reports
the SyntaxError), and a custom check that raises is logged and skipped (fail open: the review is
advisory, the sandbox is the boundary).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from sandkernel.kernels.policy import paths
from sandkernel.kernels.policy.findings import Action, Check, Finding, PolicyContext
from sandkernel.kernels.policy.python_review import review_tree, transform
from sandkernel.kernels.policy.rules import MESSAGES, SHELL, UNREVIEWED
from sandkernel.kernels.policy.shell_review import review_shell

log = logging.getLogger(__name__)

# Cells longer than this (characters) are not read by the built-in review: IPython's transform,
# the parse and the walk cost about 10 ms per KiB, and agents' cells are a few KiB. Such a cell
# runs unreviewed (logged): the review is advisory, fail open, and the sandbox is the boundary.
MAX_REVIEW_CHARS = 64 * 1024


@dataclasses.dataclass(frozen=True)
class RuleSetting:
    """The operator's choice for one rule; None fields fall back (action: the policy's default;
    message: the rule's built-in message, or the finding's own for a custom rule)."""

    action: Action | None = None
    message: str | None = None


@dataclasses.dataclass(frozen=True)
class NamedCheck:
    """A custom check and where it came from ("package.module:function", or "entry point NAME")."""

    name: str
    check: Check


class ExecPolicy:
    """The review an operator configured; see kernels/policy/__init__.py for the whole story."""

    def __init__(
        self,
        *,
        default: Action = Action.WARN,
        rules: Mapping[str, RuleSetting] | None = None,
        writable: Sequence[str] = paths.DEFAULT_WRITABLE,
        checks: Sequence[NamedCheck] = (),
        source: str = "<policy>",
    ) -> None:
        self.default = default
        self.rules = dict(rules or {})
        self.writable = tuple(p.rstrip("/") or "/" for p in writable)
        self.checks = tuple(checks)
        self.source = source

    def action_of(self, rule: str, proposed: Action | None = None) -> Action:
        """The operator's action for ``rule``; else what a custom check proposed; else the default."""
        setting = self.rules.get(rule)
        if setting is not None and setting.action is not None:
            return setting.action
        return proposed or self.default

    def message_of(self, rule: str) -> str | None:
        setting = self.rules.get(rule)
        message = setting.message if setting is not None and setting.message else MESSAGES.get(rule)
        return message.replace("{writable}", paths.describe(self.writable)) if message else None

    def context(self, code: str, shell: str | None = None) -> PolicyContext:
        if shell is not None:  # the code is sandkernel's own wrapper: the command is what to review
            return PolicyContext(code, code, None, shell, self.writable)
        if len(code) > MAX_REVIEW_CHARS:
            return PolicyContext(code, code, None, None, self.writable)
        transformed, tree = transform(code)
        return PolicyContext(code, transformed, tree, None, self.writable)

    def review(self, code: str, shell: str | None = None) -> list[Finding]:
        """The findings for one execution, in line order, each with its action and whole message;
        rules the operator set to ``allow`` are left out. ``shell`` is the command when the
        execution came through the shell door (reviewed as a shell line, under the ``shell`` rule
        too)."""
        context = self.context(code, shell)
        reviewed = shell if shell is not None else code
        if len(reviewed) > MAX_REVIEW_CHARS:
            # Not read (too slow), but never silently: padding a cell must not get it past every
            # rule unnoticed. The operator decides what an unreviewed cell gets (default: the
            # policy's default action).
            log.info("a cell of %d characters was not reviewed (over %d)", len(reviewed), MAX_REVIEW_CHARS)
            too_long = f"the cell is {len(reviewed)} characters long, over the {MAX_REVIEW_CHARS} the review reads"
            raw = [Finding(UNREVIEWED, too_long, None)]
        elif shell is not None:
            raw = [Finding(SHELL, "the shell endpoint runs a shell command", 1), *review_shell(shell, 1, self.writable)]
        elif context.tree is not None:
            raw = review_tree(context.tree, self.writable)
        else:
            raw = []
        for named in self.checks:
            try:
                raw.extend(_checked(named, code, context))
            except Exception:
                log.exception("exec policy check %s failed; skipped (the review is advisory)", named.name)
        return self._judged(raw)

    def _judged(self, raw: list[Finding]) -> list[Finding]:
        seen: set[tuple[str, int | None]] = set()
        judged = []
        for finding in sorted(raw, key=lambda f: f.line or 0):
            action = self.action_of(finding.rule, finding.action)
            if action is Action.ALLOW or (finding.rule, finding.line) in seen:
                continue
            seen.add((finding.rule, finding.line))
            what = finding.message.strip().rstrip(".")
            detail = f"{what[:1].upper()}{what[1:]}."
            advice = self.message_of(finding.rule) or ""
            message = f"{detail} {advice}" if advice else detail
            judged.append(dataclasses.replace(finding, action=action, message=message, detail=detail, advice=advice))
        return judged


def _checked(named: NamedCheck, code: str, context: PolicyContext) -> list[Finding]:
    """A custom check's findings, each checked to be a Finding (a check returning something else
    is a bug to log, not a reason to stop the review)."""
    found = list(named.check(code, context) or ())
    bad = [item for item in found if not isinstance(item, Finding)]
    if bad:
        raise TypeError(f"check {named.name} returned {type(bad[0]).__name__}, not Finding")
    return found
