"""The review of a cell as Python: IPython's own transform, then one walk over its ``ast``.

Why IPython's transform: ``!cmd``, ``%magic`` and ``%%magic`` are not Python, and a review that
skipped them would miss what the kernel runs. After ``TransformerManager().transform_cell`` they
are ordinary calls (``get_ipython().system('cmd')``, ``run_line_magic('pip', 'install x')``,
``run_cell_magic('bash', '', body)``), and each keeps its line (a cell magic is line 1; its body
starts on line 2). Shell text found that way is handed to shell_review.py.

Names are resolved through the cell's imports (``import subprocess as sp`` makes ``sp.run``
``subprocess.run``; ``__import__('os').system`` is ``os.system``), and a name bound once in the
cell to a constant path (``out = '/etc/x'``) stands for that path. Anything computed at run time
is not judged: the review is advisory, it catches mistakes, not an attacker (the sandbox is the
boundary).
"""

from __future__ import annotations

import ast
import functools
import shlex
from typing import Any

from sandkernel.kernels.policy import paths
from sandkernel.kernels.policy.findings import Finding
from sandkernel.kernels.policy.rules import (
    CTYPES,
    DYNAMIC_CODE,
    OS_SYSTEM,
    PACKAGE_INSTALL,
    PATH_TRAVERSAL,
    RAW_SOCKET,
    SHELL,
    SUBPROCESS,
    WRITE_OUTSIDE_WORKSPACE,
)
from sandkernel.kernels.policy.shell_review import review_shell
from sandkernel.python_syntax import parse

MODULE_RULES = {
    "subprocess": SUBPROCESS,
    "socket": RAW_SOCKET,
    "_socket": RAW_SOCKET,
    "ctypes": CTYPES,
    "_ctypes": CTYPES,
    "cffi": CTYPES,
}
PROGRAM_STARTERS = frozenset(
    {
        "os.popen",
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.posix_spawnp",
        "pty.spawn",
        "asyncio.create_subprocess_exec",
        "asyncio.create_subprocess_shell",
    }
)
PROGRAM_PREFIXES = ("os.exec", "os.spawn")
SYSTEM_CALLS = frozenset({"os.system", "posix.system"})
EVALUATORS = frozenset({"eval", "exec", "compile", "builtins.eval", "builtins.exec", "builtins.compile"})
IMPORTERS = frozenset({"__import__", "importlib.import_module", "builtins.__import__"})
IPYTHON_RUNNERS = frozenset({"run_cell", "ex", "ev", "run_code"})
# Line magics that are shell commands: %system/%sx, and IPython's default aliases (%rm, %ls...).
SHELL_LINE_MAGICS = frozenset({"system", "sx", "sc"})
ALIAS_MAGICS = frozenset({"cat", "cp", "ldir", "lf", "lk", "ll", "ls", "lx", "mkdir", "mv", "rm", "rmdir"})
SHELL_CELL_MAGICS = frozenset({"bash", "sh", "zsh", "system", "sx", "script", "!"})
SHELL_INTERPRETERS = frozenset({"sh", "bash", "zsh", "dash", "ksh"})
INSTALL_MAGICS = frozenset({"pip", "conda", "mamba", "micromamba"})

OPEN_CALLS = frozenset({"open", "io.open", "builtins.open", "codecs.open"})
PATH_TYPES = frozenset({"pathlib.Path", "pathlib.PosixPath", "pathlib.PurePath", "pathlib.PurePosixPath", "Path"})
PATH_WRITERS = frozenset(
    {"write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir", "chmod", "lchmod", "symlink_to", "hardlink_to"}
)
PATH_MOVERS = frozenset({"rename", "replace"})  # the path goes away, the argument is written
OS_FIRST = frozenset(
    {
        "os.remove",
        "os.unlink",
        "os.rmdir",
        "os.removedirs",
        "os.mkdir",
        "os.makedirs",
        "os.chmod",
        "os.chown",
        "os.lchown",
        "os.truncate",
        "os.mkfifo",
        "os.mknod",
        "os.utime",
        "shutil.rmtree",
        "shutil.chown",
        "shutil.make_archive",
    }
)
OS_BOTH = frozenset({"os.rename", "os.replace", "os.renames", "shutil.move"})
SECOND = frozenset(
    {
        "os.symlink",
        "os.link",
        "shutil.copy",
        "shutil.copy2",
        "shutil.copyfile",
        "shutil.copytree",
        "shutil.copymode",
        "shutil.copystat",
    }
)
OS_OPEN_WRITE_FLAGS = frozenset({"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"})
# Methods and functions that write their first argument (pandas, matplotlib, numpy): the usual way a
# model's code writes a result, so the usual place for a path outside the workspace.
SAVER_METHODS = frozenset(
    {
        "to_csv",
        "to_parquet",
        "to_excel",
        "to_json",
        "to_pickle",
        "to_feather",
        "to_hdf",
        "to_html",
        "to_latex",
        "to_markdown",
        "to_xml",
        "to_stata",
        "savefig",
    }
)
SAVER_FUNCTIONS = frozenset({"numpy.save", "numpy.savetxt", "numpy.savez", "numpy.savez_compressed"})
SAVER_KEYWORDS = frozenset({"path", "path_or_buf", "excel_writer", "fname", "file", "buf"})


@functools.cache
def _transformer() -> Any:
    """IPython's transformer, imported on first use (0.1 s) so a gateway without a policy never pays it."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()


def transform(code: str) -> tuple[str, ast.Module | None]:
    """The cell as the kernel will run it, and its ``ast``; the tree is None when it does not
    parse (the kernel will report the SyntaxError: nothing runs, nothing to review)."""
    try:
        transformed = _transformer().transform_cell(code)
    except Exception:  # IPython's transform raising is the kernel's to report, not ours
        transformed = code
    try:
        return transformed, parse(transformed)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return transformed, None


def _string(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _short(node: ast.AST, limit: int = 60) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # unparse of an odd tree: say nothing rather than fail the review
        return "this call"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Reviewer:
    """One walk over one cell's tree."""

    def __init__(self, tree: ast.Module, writable: tuple[str, ...]) -> None:
        self.tree = tree
        self.writable = writable
        self.aliases: dict[str, str] = {}
        self.constants: dict[str, str | None] = {}  # name -> constant path; None when bound twice or not constant
        self.findings: list[Finding] = []
        self.skip: set[int] = set()  # constants already read as shell text or file content
        self.docstrings: set[int] = set()

    def add(self, rule: str, what: str, node: ast.AST) -> None:
        self.findings.append(Finding(rule, what, getattr(node, "lineno", None)))

    # -- names ------------------------------------------------------------------------------

    def _bindings(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:  # `import a.b` binds a; `import a.b as c` binds c to a.b
                    top = alias.name.split(".")[0]
                    self.aliases[alias.asname or top] = alias.name if alias.asname else top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                value = self.path_of(node.value) if name not in self.constants else None
                self.constants[name] = value
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                self.docstrings.add(id(node.value))  # a bare string (a docstring) says nothing

    def qualname(self, node: ast.AST) -> str | None:
        """``subprocess.run`` for ``sp.run`` after ``import subprocess as sp``; iterative, so a
        long attribute chain cannot exhaust the stack."""
        attrs: list[str] = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            base = self.aliases.get(node.id, node.id)
        elif isinstance(node, ast.Call) and self.qualname(node.func) in IMPORTERS and node.args:
            base = _string(node.args[0])  # __import__('os').system
            if base is None:
                return None
        else:
            return None
        return ".".join([base, *reversed(attrs)])

    def path_of(self, node: ast.AST | None) -> str | None:
        """The path a constant expression names, as written: 'x', Path('a', 'b'), Path('a') / 'b',
        os.path.join('a', 'b'), or a name bound once to one of those."""
        if node is None:
            return None
        text = _string(node)
        if text is not None:
            return text
        if isinstance(node, ast.Name):
            return self.constants.get(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            left, right = self.path_of(node.left), self.path_of(node.right)
            return f"{left.rstrip('/')}/{right}" if left is not None and right is not None else None
        if isinstance(node, ast.Call) and not node.keywords:
            name = self.qualname(node.func)
            if name in PATH_TYPES or name == "os.path.join":
                parts = [self.path_of(arg) for arg in node.args]
                if parts and all(part is not None for part in parts):
                    joined = parts[0] or ""
                    for part in parts[1:]:
                        joined = part if part.startswith("/") else f"{joined.rstrip('/')}/{part}"  # type: ignore[union-attr]
                    return joined
        return None

    # -- the walk ---------------------------------------------------------------------------

    def run(self) -> list[Finding]:
        self._bindings()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self._module(alias.name, node)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                self._module(node.module, node)
            elif isinstance(node, ast.Call):
                self._call(node)
        for node in ast.walk(self.tree):  # after the calls: they mark shell text and file contents
            text = _string(node)
            quiet = id(node) in self.skip or id(node) in self.docstrings
            if text is not None and not quiet and paths.traverses(text):
                self.add(PATH_TRAVERSAL, f"the string `{_short(node)}` holds '..'", node)
        return self.findings

    def _module(self, module: str, node: ast.AST) -> None:
        rule = MODULE_RULES.get(module.split(".")[0])
        if rule is not None:
            self.add(rule, f"the cell imports {module}", node)

    def _call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and self._is_ipython(func.value):
            self._ipython(func.attr, node)
            return
        name = self.qualname(func)
        if name is not None:
            self._named_call(name, node)
        if isinstance(func, ast.Attribute):
            self._method(func, node)

    @staticmethod
    def _is_ipython(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_ipython"

    def _named_call(self, name: str, node: ast.Call) -> None:
        root = name.split(".")[0]
        if name in SYSTEM_CALLS:
            self.add(OS_SYSTEM, f"`{_short(node)}` runs a shell command", node)
        elif root == "subprocess" or name in PROGRAM_STARTERS or name.startswith(PROGRAM_PREFIXES):
            self.add(SUBPROCESS, f"`{_short(node)}` starts a program", node)
        elif root in MODULE_RULES and MODULE_RULES[root] != SUBPROCESS:
            self.add(MODULE_RULES[root], f"`{_short(node)}` uses the {root} module", node)
        elif name in EVALUATORS:
            self.add(DYNAMIC_CODE, f"`{_short(node)}` runs code built at run time", node)
        elif name in IMPORTERS and (not node.args or _string(node.args[0]) is None):
            self.add(DYNAMIC_CODE, f"`{_short(node)}` imports a module whose name is computed", node)
        if name in OPEN_CALLS:
            mode = _string(node.args[1]) if len(node.args) > 1 else None
            mode = next((_string(k.value) for k in node.keywords if k.arg == "mode"), mode)
            if mode is not None and any(flag in mode for flag in "wax+"):
                self._write(node.args[0] if node.args else _keyword(node, "file"), node, f"open(..., {mode!r})")
        elif name == "os.open" and len(node.args) > 1:
            flags = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "") for n in ast.walk(node.args[1])}
            if flags & OS_OPEN_WRITE_FLAGS:
                self._write(node.args[0], node, "os.open")
        elif name in OS_FIRST:
            self._write(node.args[0] if node.args else None, node, name)
        elif name in OS_BOTH:
            for arg in node.args[:2]:
                self._write(arg, node, name)
        elif name in SECOND:
            self._write(node.args[1] if len(node.args) > 1 else _keyword(node, "dst"), node, name)
        elif name in SAVER_FUNCTIONS:
            self._write(node.args[0] if node.args else _saver_keyword(node), node, name)

    def _method(self, func: ast.Attribute, node: ast.Call) -> None:
        if func.attr in SAVER_METHODS:
            self._write(node.args[0] if node.args else _saver_keyword(node), node, f".{func.attr}")
            return
        target = self.path_of(func.value)
        if target is None:
            return
        if func.attr in PATH_WRITERS:
            self._write(func.value, node, f".{func.attr}")
        elif func.attr in PATH_MOVERS:
            self._write(func.value, node, f".{func.attr}")
            self._write(node.args[0] if node.args else None, node, f".{func.attr}")
        elif func.attr == "open":
            mode = _string(node.args[0]) if node.args else _string(_keyword(node, "mode"))
            if mode is not None and any(flag in mode for flag in "wax+"):
                self._write(func.value, node, f".open({mode!r})")

    def _write(self, target: ast.AST | None, node: ast.AST, how: str) -> None:
        written = self.path_of(target)
        if written is None:
            return
        where = paths.resolve(written)
        if where is not None and not paths.writable(where, self.writable):
            self.add(WRITE_OUTSIDE_WORKSPACE, f"`{how}` writes {written!r} ({where})", node)

    # -- IPython's calls ----------------------------------------------------------------------

    def _ipython(self, method: str, node: ast.Call) -> None:
        args = [_string(arg) for arg in node.args]
        for arg in node.args:
            self.skip.add(id(arg))
        line = node.lineno
        if method in ("system", "getoutput"):
            command = args[0] if args else None
            self._shell(command, line, line, f"!{_clip(command or '')}")
        elif method == "run_line_magic" and len(args) >= 2 and args[0] is not None:
            magic, rest = args[0], args[1] or ""
            if magic in SHELL_LINE_MAGICS:
                self._shell(rest, line, line, f"%{magic}")
            elif magic in ALIAS_MAGICS:
                self._shell(f"{magic} {rest}", line, line, f"%{magic}")
            elif magic in INSTALL_MAGICS and rest.split()[:1] and rest.split()[0] in ("install", "uninstall", "remove"):
                what = f"`%{magic} {rest.split()[0]}` changes the installed packages"
                self.findings.append(Finding(PACKAGE_INSTALL, what, line))
            elif magic == "cd" and paths.traverses(rest):
                self.findings.append(Finding(PATH_TRAVERSAL, f"`%cd {rest}` uses '..'", line))
        elif method == "run_cell_magic" and len(args) >= 3 and args[0] is not None:
            self._cell_magic(args[0], args[1] or "", args[2] or "", line)
        elif method in IPYTHON_RUNNERS:
            what = f"`get_ipython().{method}(...)` runs code built at run time"
            self.findings.append(Finding(DYNAMIC_CODE, what, line))

    def _cell_magic(self, magic: str, line_text: str, body: str, line: int) -> None:
        if magic == "script" and (shlex.split(line_text) or [""])[0].rsplit("/", 1)[-1] not in SHELL_INTERPRETERS:
            self.findings.append(Finding(SHELL, f"`%%script {line_text}` runs another program", line))
            return
        if magic in SHELL_CELL_MAGICS:
            self._shell(body, line, line + 1, f"%%{magic}")
        elif magic == "writefile":
            words = [w for w in _split(line_text) if w not in ("-a", "--append")]
            if words:
                where = paths.resolve(words[0])
                if where is not None and not paths.writable(where, self.writable):
                    self.findings.append(
                        Finding(WRITE_OUTSIDE_WORKSPACE, f"`%%writefile` writes {words[0]!r} ({where})", line)
                    )
                if paths.traverses(words[0]):
                    self.findings.append(Finding(PATH_TRAVERSAL, f"`%%writefile {words[0]}` uses '..'", line))

    def _shell(self, text: str | None, line: int, first_line: int, how: str) -> None:
        self.findings.append(Finding(SHELL, f"`{how}` runs a shell command", line))
        if text is not None:
            self.findings.extend(review_shell(text, first_line, self.writable))


def _clip(text: str, limit: int = 40) -> str:
    first = (text.strip().splitlines() or [""])[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def _keyword(node: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in node.keywords if k.arg == name), None)


def _saver_keyword(node: ast.Call) -> ast.AST | None:
    return next((k.value for k in node.keywords if k.arg in SAVER_KEYWORDS), None)


def review_tree(tree: ast.Module, writable: tuple[str, ...]) -> list[Finding]:
    """Every built-in rule's findings for one parsed cell (actions left to the policy)."""
    return _Reviewer(tree, writable).run()
