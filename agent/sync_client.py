"""The blocking twins of :mod:`sandkernel.agent.client`: ``Sandkernel`` and ``Session``.

    with Sandkernel() as sk, sk.session() as s:
        print(s.run("21 * 2").text)

Each call runs the async client's coroutine on a private event loop in a daemon thread, so
the sync client works in scripts, in threads, and inside a running event loop (a Jupyter
notebook) alike, with one implementation of every call. Streaming callbacks run on that thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from sandkernel.agent.client import AsyncSandkernel, AsyncSession
from sandkernel.agent.errors import ClientError
from sandkernel.agent.execution import Execution
from sandkernel.shell import ShellResult

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread; ``call`` blocks on a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sandkernel-client", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


class Sandkernel:
    """Blocking client; same arguments as :class:`~sandkernel.agent.client.AsyncSandkernel`."""

    def __init__(self, url: str | None = None, token: str | None = None, **options: Any) -> None:
        self._loop = _LoopThread()
        self._async = AsyncSandkernel(url, token, **options)

    @property
    def url(self) -> str:
        return self._async.url

    def __enter__(self) -> Sandkernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._loop.call(self._async.close())
        self._loop.stop()

    def create_session(
        self, profile: str | None = None, limits: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None
    ) -> Session:
        return Session(self, self._loop.call(self._async.create_session(profile, limits, metadata)))

    @contextlib.contextmanager
    def session(self, profile: str | None = None, **options: Any) -> Iterator[Session]:
        """``with sk.session() as s:``: a session deleted on exit (its notebook is kept)."""
        created = self.create_session(profile, **options)
        try:
            yield created
        finally:
            with contextlib.suppress(ClientError):
                created.delete()

    def get_session(self, session_id: str) -> Session:
        return Session(self, self._loop.call(self._async.get_session(session_id)))

    def list_sessions(self) -> list[dict[str, Any]]:
        return self._loop.call(self._async.list_sessions())

    def health(self) -> dict[str, Any]:
        return self._loop.call(self._async.health())

    def wait_until_up(self, timeout: float | None = None) -> bool:
        """See :meth:`AsyncSandkernel.wait_until_up`."""
        return self._loop.call(self._async.wait_until_up(timeout))


class Session:
    """Blocking view of an :class:`~sandkernel.agent.client.AsyncSession`."""

    def __init__(self, client: Sandkernel, session: AsyncSession) -> None:
        self._client = client
        self._async = session

    @property
    def restore(self) -> dict[str, Any] | None:
        """See :attr:`AsyncSession.restore` (how a forked session got its state)."""
        return self._async.restore

    @property
    def state(self) -> str | None:
        return self._async.state

    @property
    def id(self) -> str:
        return self._async.id

    @property
    def kernel_id(self) -> str:
        return self._async.kernel_id

    @property
    def info(self) -> dict[str, Any]:
        return self._async.info

    def __repr__(self) -> str:
        return f"<Session {self.id} at {self._client.url}>"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ClientError):
            self.delete()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._client._loop.call(coro)

    def run(self, code: str, timeout: float | None = None, **options: Any) -> Execution:
        """See :meth:`AsyncSession.run` (callbacks run on the client's loop thread; a gateway
        restart raises :class:`~sandkernel.agent.execution.GatewayRestarted` here likewise)."""
        return self._call(self._async.run(code, timeout, **options))

    def shell(self, command: str, timeout: float | None = None, **options: Any) -> ShellResult:
        """See :meth:`AsyncSession.shell`."""
        return self._call(self._async.shell(command, timeout, **options))

    def interrupt(self) -> None:
        self._call(self._async.interrupt())

    def restart(self) -> dict[str, Any]:
        return self._call(self._async.restart())

    def refresh(self) -> dict[str, Any]:
        return self._call(self._async.refresh())

    def pause(self, timeout: float | None = None) -> dict[str, Any]:
        """See :meth:`AsyncSession.pause`."""
        return self._call(self._async.pause(timeout))

    def resume(self, timeout: float | None = None) -> dict[str, Any]:
        """See :meth:`AsyncSession.resume`."""
        return self._call(self._async.resume(timeout))

    def fork(self, count: int = 1, cell: int | None = None, timeout: float | None = None) -> list[Session]:
        """See :meth:`AsyncSession.fork`; the new sessions are bound to this client."""
        return [Session(self._client, forked) for forked in self._call(self._async.fork(count, cell, timeout))]

    def rewind(self, cell: int, timeout: float | None = None) -> dict[str, Any]:
        """See :meth:`AsyncSession.rewind`."""
        return self._call(self._async.rewind(cell, timeout))

    def delete(self, delete_notebook: bool = False) -> None:
        self._call(self._async.delete(delete_notebook))

    def upload(self, path: str, data: bytes | str) -> dict[str, Any]:
        return self._call(self._async.upload(path, data))

    def upload_file(self, local: str | Path, path: str | None = None) -> dict[str, Any]:
        return self._call(self._async.upload_file(local, path))

    def download(self, path: str) -> bytes:
        return self._call(self._async.download(path))

    def list_files(self, path: str = "") -> list[dict[str, Any]]:
        return self._call(self._async.list_files(path))

    def variables(self) -> list[dict[str, Any]]:
        return self._call(self._async.variables())

    def notebook(self) -> dict[str, Any]:
        return self._call(self._async.notebook())

    def add_markdown(self, text: str) -> None:
        self._call(self._async.add_markdown(text))
