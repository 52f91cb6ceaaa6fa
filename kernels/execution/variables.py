"""A cheap listing of a kernel's user namespace: name, type, size, shape.

Evaluated as a silent ``user_expressions`` request (no output, no execution count). The code
that walks the namespace ships in the kernel image (``kernel-image/sandkernel_variables.py``,
root-owned, imported by the launcher before user code); images without it (an operator's own)
get the same listing from an inline expression.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient

from sandkernel.errors import KernelAnswerError, SandkernelError
from sandkernel.kernels.execution.replies import ShellReader
from sandkernel.python_syntax import literal_eval

# The most characters of a listing's answer that are parsed. The real listing of 2000 names is a
# few hundred KiB; an answer up to the message limit (64 MiB), a forged one or names and shapes
# made huge, took 0.7 s of the gateway's CPU to parse (every tenant's answers waited, while it
# ran on the event loop).
MAX_LISTING_CHARS = 1024 * 1024

# The listing for images without the module (same JSON): one string, no side effects, bounded.
INLINE_EXPRESSION = (
    "(lambda ns, hidden, json=__import__('json'), sys=__import__('sys'): json.dumps(["
    "{'name': k, 'type': type(v).__module__ + '.' + type(v).__qualname__"
    " if type(v).__module__ != 'builtins' else type(v).__qualname__,"
    " 'size': int(getattr(v, 'nbytes', 0) or 0) or (len(v) if isinstance(v, (str, bytes, list, tuple, dict, set))"
    " else sys.getsizeof(v)),"
    " 'shape': list(v.shape) if isinstance(getattr(v, 'shape', None), tuple) else None}"
    " for k, v in list(ns.items())[:2000] if not k.startswith('_') and k not in hidden"
    " and type(v).__name__ not in ('module', 'function', 'builtin_function_or_method', 'type')]))"
    "(get_ipython().user_ns, get_ipython().user_ns_hidden)"
)
# Evaluated in the kernel: the image's module, looked up in sys.modules where start_kernel.py put
# it before any user code ran (never imported by name: a planted /workspace file could answer).
VARIABLES_EXPRESSION = (
    "(lambda m: m.listing(get_ipython()) if m is not None else " + INLINE_EXPRESSION + ")"
    "(__import__('sys').modules.get('sandkernel_variables'))"
)


async def list_variables(client: AsyncKernelClient, read_shell: ShellReader, timeout: float) -> list[dict[str, Any]]:
    """Ask the kernel for its variables and wait up to ``timeout`` seconds for the answer.

    Raises SandkernelError when the kernel does not answer or the listing fails."""
    msg_id = client.execute("", silent=True, store_history=False, user_expressions={"vars": VARIABLES_EXPRESSION})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = await read_shell(max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        try:  # what the kernel sends is untrusted: a listing that is not the expected literal is an error
            found = msg["content"].get("user_expressions", {}).get("vars", {})
            if found.get("status") != "ok":
                raise KernelAnswerError(f"listing variables failed: {str(found.get('evalue', 'no reply'))[:200]}")
            text = found["data"]["text/plain"]
            if not isinstance(text, str):
                raise TypeError("not text")
            if len(text) > MAX_LISTING_CHARS:
                raise KernelAnswerError(
                    f"listing variables failed: the kernel's answer is {len(text)} characters, over the "
                    f"{MAX_LISTING_CHARS} a listing may be: delete variables with huge names or shapes"
                )
            return await asyncio.to_thread(_parsed, text)
        except (AttributeError, KeyError, TypeError, ValueError, SyntaxError, RecursionError, MemoryError) as err:
            why = type(err).__name__
            raise KernelAnswerError(f"listing variables failed: the kernel's answer did not parse ({why})") from None
    raise SandkernelError(f"the kernel did not list its variables within {timeout:g}s; is it busy?")


def _parsed(text: str) -> list[dict[str, Any]]:
    """The listing from its answer's text: a string literal holding JSON (in a worker thread)."""
    return json.loads(literal_eval(text))
