"""Regenerate the data the seccomp profile is built from.

Two facts come from outside this repository, and this script is how they are refreshed:

* the x86_64 syscall numbers, which ``kernel-image/seccomp_bpf.py`` needs to compile the
  profile's names to BPF (read from the kernel headers, ``asm/unistd_64.h`` in linux-libc-dev);
* Docker's default allow-list, which ``kernels/sandbox/seccomp.py`` starts from (read from a copy of
  moby's ``default.json``: github.com/moby/profiles, ``seccomp/default.json``).

Usage::

    python scripts/gen_syscall_table.py                       # rewrite the table in seccomp_bpf.py
    python scripts/gen_syscall_table.py --moby-default FILE   # print the allow-list for kernels/sandbox/seccomp.py

The table is rewritten in place between its BEGIN/END markers; the allow-list is printed for a
person to paste (with the commit it came from), because updating it is a security review.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HEADER = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
TARGET = Path(__file__).resolve().parent.parent / "kernel-image" / "seccomp_bpf.py"
BEGIN, END = "# BEGIN GENERATED SYSCALL TABLE", "# END GENERATED SYSCALL TABLE"


def read_table(header: Path) -> dict[str, int]:
    """name -> number for every ``#define __NR_name N`` in the header."""
    found = {m[1]: int(m[2]) for m in re.finditer(r"^#define __NR_(\w+)\s+(\d+)\s*$", header.read_text(), re.M)}
    if len(found) < 300:
        sys.exit(f"{header}: only {len(found)} syscalls found; is it the x86_64 unistd_64.h?")
    return found


def packed(entries: list[str], width: int = 116) -> str:
    """Entries several to a line (a table of 360 lines would bury the code around it)."""
    lines, line = [], "   "
    for entry in entries:
        if len(line) + 1 + len(entry) > width:
            lines.append(line)
            line = "   "
        line += " " + entry
    return "\n".join([*lines, line])


def render_table(table: dict[str, int], source: str) -> str:
    body = packed([f'"{name}": {nr},' for name, nr in sorted(table.items(), key=lambda item: item[1])])
    header = f"{BEGIN} (scripts/gen_syscall_table.py, from {source})"
    return f"{header}\nX86_64_SYSCALLS: dict[str, int] = {{\n{body}\n}}\n{END}"


def write_table(header: Path) -> None:
    table = read_table(header)
    text = TARGET.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    version = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}", "linux-libc-dev"], capture_output=True, text=True, check=False
    ).stdout.strip()
    source = f"{header.name} of linux-libc-dev {version or '(version unknown)'}"
    TARGET.write_text(text[:start] + render_table(table, source) + text[end:])
    print(f"{TARGET}: {len(table)} syscalls, highest {max(table.values())}")


def applies_without_capabilities(rule: dict) -> bool:
    """Whether moby's rule applies on x86_64 to a process that holds no capability.

    ``includes.caps`` rules are for capabilities sandkernel drops; ``minKernel`` rules are kept
    (our kernels are far newer; the only such rule is the ptrace family, which we deny anyway).
    """
    includes, excludes = rule.get("includes") or {}, rule.get("excludes") or {}
    if includes.get("caps"):
        return False
    if includes.get("arches") and "amd64" not in includes["arches"]:
        return False
    return "amd64" not in (excludes.get("arches") or [])


def print_allow_list(moby_default: Path) -> None:
    profile = json.loads(moby_default.read_text())
    names: list[str] = []
    conditional: list[dict] = []
    for rule in profile["syscalls"]:
        if not applies_without_capabilities(rule):
            continue
        if rule.get("args"):
            conditional.append({k: v for k, v in rule.items() if k not in ("includes", "excludes", "comment")})
        elif rule["action"] == "SCMP_ACT_ALLOW":
            names += rule["names"]
        else:
            conditional.append({k: v for k, v in rule.items() if k not in ("includes", "excludes", "comment")})
    print("DOCKER_ALLOWED = (")
    print(packed([f'"{n}",' for n in names]))
    print(")")
    print("# conditional and errno rules (translate by hand):")
    for rule in conditional:
        print("#", json.dumps(rule))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--header", type=Path, default=HEADER, help="asm/unistd_64.h to read")
    parser.add_argument("--moby-default", type=Path, help="moby's seccomp default.json: print its allow-list")
    args = parser.parse_args()
    if args.moby_default:
        print_allow_list(args.moby_default)
    else:
        write_table(args.header)


if __name__ == "__main__":
    main()
