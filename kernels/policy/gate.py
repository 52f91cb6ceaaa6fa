"""The policy as an execution gate: asked by the session before any code reaches its kernel.

The gateway attaches one :class:`PolicyGate` to every session it holds (gateway/controls.py), so
every door (session API, shell endpoint, websocket, MCP, agent, replay) is reviewed the same way.
The review is pure CPU work on an untrusted, possibly large cell: it runs in a worker thread,
never on the event loop.
"""

from __future__ import annotations

import asyncio

from sandkernel.kernels.execution.events import ExecutionRequest, Verdict
from sandkernel.kernels.policy.findings import Action, Finding
from sandkernel.kernels.policy.policy import ExecPolicy

BY = "policy"


class PolicyGate:
    """An :class:`~sandkernel.kernels.execution.events.ExecutionGate` for one :class:`ExecPolicy`
    (one per session, sharing the policy: the policy holds no per-session state)."""

    def __init__(self, policy: ExecPolicy) -> None:
        self.policy = policy

    async def admit(self, request: ExecutionRequest) -> Verdict:
        findings = await asyncio.to_thread(self.policy.review, request.code, request.shell)
        return verdict(findings)


def verdict(findings: list[Finding]) -> Verdict:
    """Warnings ride on the result; any ``deny`` refuses the execution with one message that
    names every denied rule and line, so a model can fix them all in one rewrite."""
    dicts = tuple(finding.to_dict() for finding in findings)
    denied = [finding for finding in findings if finding.action is Action.DENY]
    if not denied:
        return Verdict(findings=dicts)
    return Verdict(findings=dicts, refusal={"by": BY, "rule": denied[0].rule, "message": refusal_message(denied)})


def refusal_message(denied: list[Finding]) -> str:
    """The text a model (or a person in JupyterLab) reads instead of outputs."""
    head = "The sandbox's code policy refused this code before it ran (nothing was executed)"
    if len(denied) == 1:
        return f"{head}: rule {denied[0].rule}{_at(denied[0])}. {denied[0].message}"
    by_rule: dict[str, list[Finding]] = {}
    for finding in denied:
        by_rule.setdefault(finding.rule, []).append(finding)
    items = []
    for rule, found in by_rule.items():
        spots = " ".join(
            (f"Line {f.line}: {f.detail or f.message}" if i else f.detail or f.message) for i, f in enumerate(found)
        )
        advice = found[0].advice
        items.append(f"- rule {rule}{_at(found[0])}: {spots}" + (f" {advice}" if advice else ""))
    return f"{head}. Fix all of these, then send the rewritten code:\n" + "\n".join(items)


def _at(finding: Finding) -> str:
    return f", line {finding.line}" if finding.line is not None else ""
