"""The execution policy without Docker: each built-in rule allowing, warning and denying, IPython
syntax (``!cmd``, ``%magic``, ``%%magic``) seen for what it runs, the shell door, the policy file's
mistakes named with their line, custom checks (by "module:function" and by entry point), and the
gate's verdict. The same rules through real doors (session API, websocket, agent) are in
tests/test_policy_doors.py.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from sandkernel.agent.tools import code_for
from sandkernel.errors import ConfigError
from sandkernel.kernels.execution.events import ExecutionRequest
from sandkernel.kernels.policy import (
    RULE_NAMES,
    Action,
    ExecPolicy,
    Finding,
    PolicyGate,
    RuleSetting,
    load_policy,
    parse_policy,
)
from sandkernel.kernels.policy.config import ENTRY_POINT_GROUP, key_lines

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "exec-policy.example.toml"

# Per rule: a cell that breaks it (and the line it breaks it on), and a cell doing the same job the
# way the rule's message asks (which must not be flagged by any rule).
CASES: dict[str, tuple[str, int, str]] = {
    "subprocess": (
        "import json\nimport subprocess\nout = subprocess.run(['ls', '-l'], capture_output=True)",
        2,
        "import os\nentries = sorted(os.listdir('.'))",
    ),
    "os_system": ("import os\nos.system('ls -l > listing.txt')", 2, "import os\nprint(os.listdir('.'))"),
    "raw_socket": (
        "x = 1\nimport socket\nsocket.create_connection(('example.com', 80))",
        2,
        "import json\njson.dumps({'a': 1})",
    ),
    "ctypes": ("import ctypes\nlibc = ctypes.CDLL('libc.so.6')", 1, "import math\nmath.sqrt(2)"),
    "write_outside_workspace": (
        "import pandas as pd\ndf = pd.DataFrame({'a': [1]})\ndf.to_csv('/etc/report.csv')",
        3,
        "import pandas as pd\ndf = pd.DataFrame({'a': [1]})\ndf.to_csv('out/report.csv')",
    ),
    "path_traversal": (
        "data = open('../secrets/keys.txt').read()",
        1,
        "data = open('/workspace/secrets/keys.txt').read()",
    ),
    "shell": ("print('listing')\n!ls -la", 2, "import os\nprint(os.listdir('.'))"),
    "dynamic_code": ("source = 'print(1)'\nexec(source)", 2, "print(1)"),
    "package_install": ("%pip install requests", 1, "import json\nprint(json.__name__)"),
}


def only(rule: str, action: Action, **kw: object) -> ExecPolicy:
    """A policy where ``rule`` has ``action`` and every other rule is allowed."""
    return ExecPolicy(default=Action.ALLOW, rules={rule: RuleSetting(action=action)}, **kw)  # type: ignore[arg-type]


def rules_of(findings: list[Finding]) -> set[str]:
    return {finding.rule for finding in findings}


def test_every_built_in_rule_has_a_case() -> None:
    # ``unreviewed`` is about a cell's length, not a line of it: its own test is below.
    assert set(CASES) == set(RULE_NAMES) - {"unreviewed"}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_rule_allows_warns_and_denies(rule: str) -> None:
    bad, line, good = CASES[rule]
    assert only(rule, Action.ALLOW).review(bad) == []
    # Every spot is reported (an import and the calls after it), the first on ``line``.
    warned = only(rule, Action.WARN).review(bad)
    assert {(f.rule, f.action) for f in warned} == {(rule, Action.WARN)} and warned[0].line == line
    denied = only(rule, Action.DENY).review(bad)
    assert {(f.rule, f.action) for f in denied} == {(rule, Action.DENY)} and denied[0].line == line
    # The message says what was found, then what to do: written for a model to rewrite the code.
    assert "Rewrite" in denied[0].message
    # The rewritten cell passes every rule, even all denied.
    assert ExecPolicy(default=Action.DENY).review(good) == []


@pytest.mark.parametrize("rule", sorted(CASES))
async def test_the_gate_refuses_a_denied_rule_naming_it_and_its_line(rule: str) -> None:
    bad, line, _ = CASES[rule]
    request = ExecutionRequest(bad, "session_api", "", 10.0)
    verdict = await PolicyGate(only(rule, Action.DENY)).admit(request)
    assert verdict.refusal is not None
    assert verdict.refusal["by"] == "policy" and verdict.refusal["rule"] == rule
    assert f"rule {rule}, line {line}" in verdict.refusal["message"]
    assert "nothing was executed" in verdict.refusal["message"]
    assert {f["rule"] for f in verdict.findings} == {rule}
    warned = await PolicyGate(only(rule, Action.WARN)).admit(request)
    assert warned.refusal is None
    first = warned.findings[0]
    assert first == {"rule": rule, "action": "warn", "message": first["message"], "line": line}


async def test_several_denials_are_listed_in_one_refusal() -> None:
    code = "import subprocess\nopen('/etc/motd', 'w').write('hi')\n!rm -rf /srv/data"
    verdict = await PolicyGate(ExecPolicy(default=Action.DENY)).admit(ExecutionRequest(code, "api", "", 5.0))
    assert verdict.refusal is not None
    message = verdict.refusal["message"]
    for expected in (
        "rule subprocess, line 1",
        "rule write_outside_workspace, line 2",
        "rule shell, line 3",
        "Line 3: The shell command writes '/srv/data'",
    ):
        assert expected in message, message
    # One rule's advice is given once, after all its spots.
    assert message.count("Writing outside the workspace is against") == 1


# -- IPython syntax: the review sees what the kernel runs -------------------------------------


@pytest.mark.parametrize(
    "cell",
    ["!ls", "!!ls", "files = !ls", "%system ls", "%sx ls", "%%bash\nls", "%%sh\nls", "%%script bash\nls", "%rm x.txt"],
)
def test_shell_syntax_is_the_shell_rule(cell: str) -> None:
    assert rules_of(only("shell", Action.DENY).review(cell)) == {"shell"}


def test_script_magics_with_another_interpreter_are_shell_too() -> None:
    findings = only("shell", Action.WARN).review("%%script perl\nprint 1;")
    assert [(f.rule, f.line) for f in findings] == [("shell", 1)]


def test_shell_lines_inside_a_cell_magic_keep_their_own_line() -> None:
    cell = "%%bash\necho start\nrm -rf /opt/tool\ncat ../notes.txt\npip install requests"
    found = {(f.rule, f.line) for f in ExecPolicy(default=Action.WARN).review(cell)}
    assert found == {("shell", 1), ("write_outside_workspace", 3), ("path_traversal", 4), ("package_install", 5)}


@pytest.mark.parametrize(
    ("cell", "where"),
    [
        ("!echo hello > /etc/motd", "/etc/motd"),
        ("!cp data.csv /usr/local/data.csv", "/usr/local/data.csv"),
        ("!mv /opt/a.txt kept.txt", "/opt/a.txt"),
        ("!sudo touch /root/flag", "/root/flag"),
        ("!dd if=/dev/zero of=/var/blob bs=1M count=1", "/var/blob"),
        ("!ls | tee /etc/listing", "/etc/listing"),
        ("%%writefile /etc/cron.d/job\n* * * * * root true", "/etc/cron.d/job"),
        ("!rm ../../etc/passwd", "/etc/passwd"),
    ],
)
def test_shell_and_magic_writes_outside_the_workspace(cell: str, where: str) -> None:
    findings = only("write_outside_workspace", Action.DENY).review(cell)
    assert rules_of(findings) == {"write_outside_workspace"}
    assert where in findings[0].message


@pytest.mark.parametrize(
    "cell",
    [
        "!ls > listing.txt 2>&1",
        "!grep x data.csv > /dev/null",
        "!cp data.csv /tmp/copy.csv",
        "!mkdir -p out/plots && touch out/plots/.keep",
        "!echo $HOME > ~/where.txt",
        "%%writefile helper.py\nprint('hi')",
        "!chmod 600 /workspace/key.pem",
    ],
)
def test_shell_writes_inside_the_writable_places_pass(cell: str) -> None:
    assert only("write_outside_workspace", Action.DENY).review(cell) == []


@pytest.mark.parametrize(
    "cell",
    [
        "open('/etc/hosts', 'a').write('x')",
        "open(file='/etc/hosts', mode='w')",
        "from pathlib import Path\nPath('/root/.bashrc').write_text('x')",
        "import pathlib\n(pathlib.Path('/opt') / 'tool' / 'conf').touch()",
        "import os\nos.remove('/var/log/syslog')",
        "import os\nos.makedirs(os.path.join('/srv', 'data'))",
        "import shutil\nshutil.rmtree('/usr/share/doc')",
        "import shutil\nshutil.copy('data.csv', '/etc/data.csv')",
        "import os\nfd = os.open('/etc/x', os.O_WRONLY | os.O_CREAT)",
        "out = '/srv/report.png'\nimport matplotlib.pyplot as plt\nplt.savefig(out)",
        "import numpy as np\nnp.save('/opt/array.npy', [1, 2])",
        "__import__('pathlib').Path('/etc/x').write_text('x')",
        "open('../../etc/passwd', 'w')",
    ],
)
def test_python_writes_outside_the_workspace(cell: str) -> None:
    assert rules_of(only("write_outside_workspace", Action.DENY).review(cell)) == {"write_outside_workspace"}


@pytest.mark.parametrize(
    "cell",
    [
        "open('/etc/hosts').read()",
        "open('/etc/hosts', 'rb').read()",
        "open('result.csv', 'w').write('x')",
        "open('/tmp/scratch', 'w')",
        "from pathlib import Path\nPath('out').mkdir(exist_ok=True)",
        "import shutil\nshutil.copy('/etc/hosts', 'hosts.txt')",
        "name = input_name()\nopen(name, 'w')",  # computed at run time: not judged
        "import os\nos.makedirs('/workspace/out', exist_ok=True)",
    ],
)
def test_reads_and_writes_inside_the_workspace_pass(cell: str) -> None:
    assert only("write_outside_workspace", Action.DENY).review(cell) == []


def test_writable_places_are_configurable() -> None:
    policy = only("write_outside_workspace", Action.DENY, writable=("/workspace", "/data"))
    assert policy.review("open('/data/x.csv', 'w')") == []
    findings = policy.review("open('/tmp/x.csv', 'w')")
    assert rules_of(findings) == {"write_outside_workspace"}
    assert "/workspace, /data" in findings[0].message


@pytest.mark.parametrize(
    ("cell", "rule"),
    [
        ("import subprocess as sp\nsp.check_output(['id'])", "subprocess"),
        ("from subprocess import run\nrun(['id'])", "subprocess"),
        ("import os\nos.popen('id')", "subprocess"),
        ("import os\nos.execv('/bin/sh', ['sh'])", "subprocess"),
        ("import asyncio\nawait asyncio.create_subprocess_exec('id')", "subprocess"),
        ("from os import system\nsystem('id')", "os_system"),
        ("__import__('os').system('id')", "os_system"),
        ("from socket import socket\nsocket()", "raw_socket"),
        ("import cffi", "ctypes"),
        ("name = 'o' + 's'\nmodule = __import__(name)", "dynamic_code"),
        ("import importlib\nimportlib.import_module(name)", "dynamic_code"),
        ("get_ipython().run_cell(code)", "dynamic_code"),
        ("!python -m pip install requests", "package_install"),
        ("%conda install numpy", "package_install"),
        ("%cd ../..", "path_traversal"),
        ("path = f'../{name}'", "path_traversal"),
    ],
)
def test_the_usual_spellings_are_recognised(cell: str, rule: str) -> None:
    assert rule in rules_of(ExecPolicy(default=Action.WARN).review(cell))


@pytest.mark.parametrize(
    "cell",
    [
        "import pandas as pd\nsales = pd.read_csv('sales.csv')\nsales.describe()",
        "print('range 1..2', '...')",
        '"""A docstring that mentions ../ paths."""\nx = 1',
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.savefig('plot.png')",
        "%pip list",
        "import importlib\njson = importlib.import_module('json')",
        "def f(:",  # does not parse: the kernel reports it, nothing to review
        "x = '\\x00'",
        "",
    ],
)
def test_ordinary_cells_have_no_findings(cell: str) -> None:
    assert ExecPolicy(default=Action.DENY).review(cell) == []


@pytest.mark.parametrize(
    ("tool", "tool_input"),
    [
        ("list_files", {"path": "."}),
        ("read_file", {"path": "sales.csv"}),
        ("write_file", {"path": "out/summary.md", "content": "# Summary\n"}),
    ],
)
def test_the_agents_own_tool_code_passes_a_strict_policy(tool: str, tool_input: dict[str, str]) -> None:
    """The agent's file tools run as short Python cells: a strict policy must not refuse them."""
    assert ExecPolicy(default=Action.DENY).review(code_for(tool, tool_input)) == []


def test_the_agents_write_file_outside_the_workspace_is_seen() -> None:
    code = code_for("write_file", {"path": "/etc/profile.d/x.sh", "content": "echo hi"})
    assert rules_of(ExecPolicy(default=Action.DENY).review(code)) == {"write_outside_workspace"}


def test_a_deeply_nested_cell_does_not_break_the_review() -> None:
    cell = "x = " + "(" * 5000 + "1" + ")" * 5000
    assert ExecPolicy(default=Action.DENY).review(cell) == []


def test_a_cell_too_long_to_review_is_never_passed_silently() -> None:
    """Review cost grows with the cell (about 10 ms per KiB): past MAX_REVIEW_CHARS it is not read,
    but padding a cell must not get it past every rule unnoticed: it gets the ``unreviewed``
    finding, with the policy's default action unless the operator sets one."""
    from sandkernel.kernels.policy.policy import MAX_REVIEW_CHARS, RuleSetting

    cell = "import subprocess\n" + "x = 1\n" * (MAX_REVIEW_CHARS // 6 + 1)
    [finding] = ExecPolicy(default=Action.DENY).review(cell)
    assert (finding.rule, finding.action, finding.line) == ("unreviewed", Action.DENY, None)
    assert "characters long" in finding.message and "Rewrite it as shorter cells" in finding.message
    [shell] = ExecPolicy(default=Action.DENY).review("generated", shell="echo x > /etc/y " + " " * MAX_REVIEW_CHARS)
    assert shell.rule == "unreviewed"
    lenient = ExecPolicy(default=Action.DENY, rules={"unreviewed": RuleSetting(Action.ALLOW)})
    assert lenient.review(cell) == []
    assert rules_of(ExecPolicy(default=Action.DENY).review(cell[: MAX_REVIEW_CHARS // 2])) == {"subprocess"}


# -- the shell door: the command is reviewed, not the cell generated for it --------------------


def test_the_shell_door_reviews_the_command() -> None:
    policy = ExecPolicy(default=Action.DENY, rules={"shell": RuleSetting(action=Action.ALLOW)})
    generated = "import subprocess\nsubprocess.run(['/bin/sh', '-c', cmd])"  # what sandkernel wraps it in
    assert policy.review(generated, shell="ls -la && wc -l data.csv") == []
    findings = policy.review(generated, shell="echo ok\nrm -rf /etc/nginx")
    assert [(f.rule, f.line) for f in findings] == [("write_outside_workspace", 2)]


def test_the_shell_rule_covers_the_shell_door() -> None:
    findings = only("shell", Action.DENY).review("generated", shell="ls")
    assert [(f.rule, f.action) for f in findings] == [("shell", Action.DENY)]


# -- messages ----------------------------------------------------------------------------------


def test_an_operator_message_replaces_the_built_in_one() -> None:
    policy = ExecPolicy(
        default=Action.ALLOW,
        rules={"write_outside_workspace": RuleSetting(Action.DENY, "Only {writable} are yours. Write there.")},
    )
    (finding,) = policy.review("open('/etc/x', 'w')")
    assert finding.message.endswith("Only /workspace, /tmp are yours. Write there.")
    assert "'/etc/x'" in finding.message


def test_a_rule_without_an_action_takes_the_default() -> None:
    policy = ExecPolicy(default=Action.DENY, rules={"shell": RuleSetting(message="No shell here.")})
    (finding,) = policy.review("!ls")
    assert finding.action is Action.DENY and finding.message.endswith("No shell here.")


# -- the policy file ---------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def test_the_documented_example_loads_and_names_every_rule() -> None:
    policy = load_policy(EXAMPLE)
    assert set(policy.rules) == set(RULE_NAMES)
    assert policy.writable == ("/workspace", "/tmp")
    text = EXAMPLE.read_text()
    for rule in RULE_NAMES:
        assert f"[rules.{rule}]" in text
    assert policy.review("import subprocess")[0].action is Action.DENY


def test_a_policy_file_sets_actions_messages_and_paths(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        default = "allow"
        writable = ["/workspace", "/scratch/"]

        [rules]
        shell = "deny"
        subprocess = { action = "warn", message = "Prefer Python." }
        """,
    )
    policy = load_policy(path)
    assert policy.default is Action.ALLOW
    assert policy.writable == ("/workspace", "/scratch")
    assert [(f.rule, f.action) for f in policy.review("!ls")] == [("shell", Action.DENY)]
    (warned,) = policy.review("import subprocess")
    assert warned.action is Action.WARN and warned.message.endswith("Prefer Python.")
    assert policy.review("eval('1')") == []  # default allow


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ('default = "warn"\n[rules]\nshell = "deny"\nsubproces = "deny"\n', 4, "unknown rule 'subproces'"),
        ('default = "warn"\n\n[rules.shell]\naction = "block"\n', 4, "'allow', 'warn', 'deny'"),
        ('default = "never"\n', 1, "default must be one of"),
        ('default = "warn"\n[rules.shell]\naction = "deny"\nreason = "x"\n', 4, "unknown key 'reason'"),
        ('default = "warn"\nwritable = ["/workspace",\n  "tmp"]\n', 3, "must be absolute"),
        ('default = "warn"\n\nrule = 3\n', 3, "unknown key 'rule'"),
        ('default = "warn"\n[rules]\nshell = "deny"\nshell = "warn"\n', 4, "not valid TOML"),
        ('default = "warn"\n[rules]\nshell = deny\n', 3, "not valid TOML"),
        ('default = "warn"\nchecks = [\n  "json:dumps",\n  "no_such_module_here:check",\n]\n', 4, "cannot be loaded"),
        ('checks = ["json"]\n', 1, '"package.module:function"'),
        ('checks = ["json:no_such_function"]\n', 1, "AttributeError"),
        ('[rules.shell]\nmessage = ""\n', 2, "non-empty"),
        ('# a comment\n[rules.subprocess]\naction = "deny"\n[rules.nope]\naction = "deny"\n', 4, "unknown rule 'nope'"),
        ('entry_points = "yes"\n', 1, "true or false"),
        ("[rules]\nshell = 3\n", 2, "must be an action"),
    ],
)
def test_a_policy_file_with_a_mistake_names_the_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_policy(path)
    message = str(caught.value)
    assert f"{path}, line {line}:" in message, message
    assert words in message, message


def test_an_unreadable_policy_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the exec policy"):
        load_policy(tmp_path / "missing.toml")


def test_key_lines_skip_multi_line_strings_and_arrays() -> None:
    text = (
        'default = "warn"\nchecks = [\n  "a:b",\n]\n[rules.shell]\nmessage = """\nnot = a key\n"""\naction = "deny"\n'
    )
    lines = key_lines(text)
    assert lines[("rules", "shell", "action")] == 9
    assert ("rules", "shell", "not") not in lines and ("not",) not in lines


# -- custom checks -----------------------------------------------------------------------------

CHECKS_MODULE = '''
from sandkernel.kernels.policy import Finding

def no_pickle(code, context):
    """Flags pickle.load: the data may come from anywhere."""
    if context.tree is None:
        return []
    return [Finding("no_pickle", "`pickle.load` reads untrusted data", 1)] if "pickle.load" in context.transformed else []

def shell_words(code, context):
    if context.shell and "curl" in context.shell:
        yield Finding("no_curl", "curl fetches from the network", 1, action=Action.DENY)
shell_words.rules = ("no_curl",)

from sandkernel.kernels.policy import Action

def broken(code, context):
    raise RuntimeError("this check has a bug")
'''


@pytest.fixture
def checks_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"policy_checks_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(CHECKS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_custom_checks_by_module_and_function(tmp_path: Path, checks_module: str) -> None:
    path = write(
        tmp_path,
        f"""
        default = "warn"
        checks = ["{checks_module}:no_pickle", "{checks_module}:shell_words"]
        entry_points = false
        [rules.no_pickle]
        action = "deny"
        message = "Load JSON or CSV instead."
        """,
    )
    policy = load_policy(path)
    (finding,) = policy.review("import pickle\ndata = pickle.load(open('x.pkl', 'rb'))")
    assert (finding.rule, finding.action) == ("no_pickle", Action.DENY)
    assert finding.message == "`pickle.load` reads untrusted data. Load JSON or CSV instead."
    # A check's own action stands when the operator set none; the shell door hands it the command.
    shell = policy.review("generated", shell="curl http://example.com")
    assert ("no_curl", Action.DENY) in [(f.rule, f.action) for f in shell]


def test_a_check_that_raises_is_logged_and_skipped(
    tmp_path: Path, checks_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, f'checks = ["{checks_module}:broken"]\nentry_points = false\n[rules]\nshell = "deny"\n')
    with caplog.at_level(logging.ERROR):
        findings = load_policy(path).review("!ls")
    assert [f.rule for f in findings] == ["shell"]  # the built-in review still ran
    assert "this check has a bug" in caplog.text


def test_a_rule_of_a_custom_check_can_be_configured_but_an_unknown_one_cannot(
    tmp_path: Path, checks_module: str
) -> None:
    good = write(tmp_path, f'checks = ["{checks_module}:shell_words"]\n[rules.no_curl]\naction = "warn"\n')
    assert load_policy(good).rules["no_curl"].action is Action.WARN
    bad = write(tmp_path, f'checks = ["{checks_module}:shell_words"]\n[rules.no_wget]\naction = "warn"\n')
    with pytest.raises(ConfigError, match="line 2: unknown rule 'no_wget'"):
        load_policy(bad)


def test_checks_installed_as_entry_points_run(tmp_path: Path, checks_module: str, monkeypatch) -> None:
    """A package declares its check in group sandkernel.exec_policy; a dist-info on sys.path is
    what an installed package looks like to importlib.metadata."""
    site = tmp_path / "site"
    dist = site / "policy_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: policy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nno_pickle = {checks_module}:no_pickle\n")
    monkeypatch.syspath_prepend(str(site))
    path = write(tmp_path, '[rules.no_pickle]\naction = "deny"\n')
    findings = load_policy(path).review("data = pickle.load(f)")
    assert [(f.rule, f.action) for f in findings] == [("no_pickle", Action.DENY)]
    off = write(tmp_path, "entry_points = false\n")
    assert load_policy(off).review("data = pickle.load(f)") == []


def test_parse_policy_names_the_given_path() -> None:
    with pytest.raises(ConfigError, match=r"exec policy /etc/sandkernel/policy.toml, line 1"):
        parse_policy('default = "maybe"\n', Path("/etc/sandkernel/policy.toml"))
