"""Pre-execution policy: a static review of each cell on the host, before it reaches the kernel.

The operator writes a policy file (``--exec-policy FILE``, TOML, see config.py and
docs/exec-policy.example.toml); without one there is no review (the default). Each built-in rule
(rules.py) and each custom check gives findings; the operator's action for the rule decides:
``allow`` (nothing said), ``warn`` (the code runs; the result and its transcript cell carry the
finding) or ``deny`` (the code does not run: the execution is ``refused`` with the rule, the line
and a message written for a model, so an agent rewrites the code instead of retrying it).

The review is ADVISORY. The sandbox (the container, its seccomp profile, gVisor, the egress
proxy) is the security boundary; a review of source text catches an agent's mistakes (a write to
/etc, a ``../`` path, a stray ``!rm``), never a determined attacker, who can build any call at
run time. That is also why a check that raises fails open.

The gate (gate.py) runs the review on every door (session API, shell endpoint, websocket, MCP,
agent, replay) through the session's execution gates.
"""

from __future__ import annotations

from sandkernel.kernels.policy.config import ENTRY_POINT_GROUP, load_policy, parse_policy
from sandkernel.kernels.policy.findings import Action, Check, Finding, PolicyContext
from sandkernel.kernels.policy.gate import PolicyGate
from sandkernel.kernels.policy.policy import ExecPolicy, RuleSetting
from sandkernel.kernels.policy.rules import RULE_NAMES

__all__ = [
    "ENTRY_POINT_GROUP",
    "RULE_NAMES",
    "Action",
    "Check",
    "ExecPolicy",
    "Finding",
    "PolicyContext",
    "PolicyGate",
    "RuleSetting",
    "load_policy",
    "parse_policy",
]
