"""The review of shell lines: ``!cmd``, ``%system``, ``%%bash`` bodies, and the shell door's command.

Each line is split as ``/bin/sh`` would roughly see it (:mod:`shlex` with shell punctuation), into
simple commands separated by ``;``, ``&&``, ``||``, ``|``, ``&``. What is looked for: the files
a command writes (redirections, ``rm``/``mv``/``cp``/``touch``/``mkdir``/``tee``/``chmod``/...,
``dd of=``) outside the writable directories, ``..`` in any word, and package installs. A line
that does not split (an unclosed quote) is split on whitespace instead. This is a reading for
mistakes, not a shell parser: variables, globs and here-documents are taken as written.
"""

from __future__ import annotations

import shlex

from sandkernel.kernels.policy import paths
from sandkernel.kernels.policy.findings import Finding
from sandkernel.kernels.policy.rules import PACKAGE_INSTALL, PATH_TRAVERSAL, WRITE_OUTSIDE_WORKSPACE

SEPARATORS = frozenset({";", ";;", "&&", "||", "|", "|&", "&", "(", ")"})
REDIRECTS = frozenset({">", ">>", ">|", "&>", "&>>", "<>", ">&"})
# Words that run the command after them: `sudo rm x` writes what `rm x` writes.
WRAPPERS = frozenset({"sudo", "env", "nohup", "command", "exec", "time", "nice", "stdbuf", "xargs"})
WRITES_EVERY_ARGUMENT = frozenset({"rm", "rmdir", "unlink", "touch", "mkdir", "tee", "truncate", "shred", "mkfifo"})
WRITES_AFTER_FIRST = frozenset({"chmod", "chown", "chgrp"})  # the first argument is a mode or an owner
WRITES_LAST = frozenset({"cp", "ln", "install", "rsync"})  # the destination
WRITES_ALL_AND_MOVES = frozenset({"mv"})  # the sources go away, the destination is written
INSTALLERS = frozenset({"pip", "pip3", "conda", "mamba", "micromamba", "apt", "apt-get", "uv"})
INSTALL_VERBS = frozenset({"install", "uninstall", "remove", "add"})


def split_line(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unclosed quote: the shell will complain; read the words anyway
        return text.split()


def simple_commands(tokens: list[str]) -> list[list[str]]:
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token in SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def _program(words: list[str]) -> list[str]:
    """The words from the program on: leading ``NAME=value`` assignments and wrappers dropped."""
    index = 0
    while index < len(words):
        word = words[index]
        if not (word in WRAPPERS or ("=" in word and not word.startswith("-"))):
            break
        index += 1
    return words[index:]


def _written(words: list[str]) -> list[str]:
    """The paths one simple command writes, as written."""
    targets = []
    rest: list[str] = []
    index = 0
    while index < len(words):  # redirections first: anywhere in the command
        word = words[index]
        if word in REDIRECTS and index + 1 < len(words):
            target = words[index + 1]
            if not (word == ">&" and target.isdigit()):
                targets.append(target)
            index += 2
            continue
        if word in ("<", "<<", "<<<") and index + 1 < len(words):
            index += 2
            continue
        rest.append(word)
        index += 1
    program = _program(rest)
    if not program:
        return targets
    name = program[0].rsplit("/", 1)[-1]
    operands = [word for word in program[1:] if not word.startswith("-")]
    if name in WRITES_EVERY_ARGUMENT or name in WRITES_ALL_AND_MOVES:
        targets += operands
    elif name in WRITES_AFTER_FIRST:
        targets += operands[1:]
    elif name in WRITES_LAST and len(operands) >= 2:
        targets.append(operands[-1])
    elif name == "dd":
        targets += [word[3:] for word in program[1:] if word.startswith("of=")]
    return targets


def _installs(words: list[str]) -> bool:
    program = _program(words)
    if not program:
        return False
    name = program[0].rsplit("/", 1)[-1]
    if name.startswith("python") and program[1:3] == ["-m", "pip"]:
        program = program[2:]
        name = "pip"
    return name in INSTALLERS and any(word in INSTALL_VERBS for word in program[1:3])


def review_shell(command: str, first_line: int, writable: tuple[str, ...]) -> list[Finding]:
    """Findings (action left to the policy) for a shell text whose first line is ``first_line``
    of the cell. The ``shell`` rule itself is the caller's: it knows the text is a shell line."""
    findings: list[Finding] = []
    for offset, text in enumerate(command.splitlines()):
        line = first_line + offset
        tokens = split_line(text)
        traversing = [token for token in tokens if paths.traverses(token)]
        if traversing:
            findings.append(Finding(PATH_TRAVERSAL, f"the shell command uses `{traversing[0]}`", line))
        for words in simple_commands(tokens):
            for target in _written(words):
                where = paths.resolve(target)
                if where is not None and not paths.writable(where, writable):
                    findings.append(
                        Finding(WRITE_OUTSIDE_WORKSPACE, f"the shell command writes {target!r} ({where})", line)
                    )
                    break
            if _installs(words):
                what = f"`{' '.join(words[:4])}` installs packages"
                findings.append(Finding(PACKAGE_INSTALL, what, line))
    return findings
