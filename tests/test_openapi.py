"""gateway/openapi.json matches the gateway's route table (issue 12, item 9): every route has its
path in the document with exactly the methods its handler serves, and every documented path and
method is a route that serves it.

The routes are read from the application :func:`sandkernel.gateway.server.make_app` builds
(tornado's router, not a copy of the list), with ``None`` for every required argument: building
the table touches none of them, so the test needs no engine and follows a change of signature.
A method counts as served when the handler's class resolves it to something other than
tornado's default (which answers 405) and it is in ``SUPPORTED_METHODS``; an inherited method
counts, because tornado serves it. HEAD and OPTIONS are not documented.
"""

from __future__ import annotations

import inspect
import json
import re

from tornado import web

from sandkernel.gateway import server

DOCUMENTED_METHODS = ("get", "post", "put", "patch", "delete")
# Methods a handler defines but refuses on one of its routes, with the refusal it answers
# (gateway/files_api.py); they are left out of the document on purpose.
REFUSED_ON_ROUTE = {
    ("/api/sessions/{session_id}/files", "put"): "400: PUT needs a file path",
}
GROUP = re.compile(r"\(\?P<(?P<name>\w+)>(?P<body>[^()]*)\)")


def route_paths(pattern: str) -> list[str]:
    """OpenAPI paths for one route regex: named groups become ``{name}``, except a group that is
    an alternation of literals (``interrupt|restart``), which gives one path per literal."""
    pattern = pattern.removesuffix("$").removesuffix("/?")
    paths = [pattern]
    for group in GROUP.finditer(pattern):
        body = group["body"]
        literal = re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", body)
        choices = body.split("|") if literal else [f"{{{group['name']}}}"]
        paths = [p.replace(group[0], choice, 1) for p in paths for choice in choices]
    return [p.replace("\\", "") for p in paths]


def served_methods(handler: type[web.RequestHandler]) -> set[str]:
    supported = {m.lower() for m in handler.SUPPORTED_METHODS}
    return {
        m
        for m in DOCUMENTED_METHODS
        if m in supported and getattr(handler, m) is not getattr(web.RequestHandler, m)
    }


def route_table() -> dict[str, tuple[str, set[str]]]:
    """{path: (handler name, methods served)} from the application's router."""
    signature = inspect.signature(server.make_app)
    app = server.make_app(**{n: None for n, p in signature.parameters.items() if p.default is p.empty})
    table: dict[str, tuple[str, set[str]]] = {}
    for rule in app.wildcard_router.rules:
        handler = rule.target
        if handler.__name__ == "NotFoundHandler":
            continue  # the catch-all 404 with a pointer to this document
        for path in route_paths(rule.matcher.regex.pattern):
            methods = {m for m in served_methods(handler) if (path, m) not in REFUSED_ON_ROUTE}
            table[path] = (handler.__name__, methods)
    return table


def documented() -> dict[str, set[str]]:
    spec = json.loads(server.OPENAPI_PATH.read_text())
    return {path: {m for m in ops if m in DOCUMENTED_METHODS} for path, ops in spec["paths"].items()}


def test_route_paths_are_read_the_way_the_document_writes_them():
    assert route_paths(r"/api/sessions/(?P<session_id>[^/]+)/(?P<action>interrupt|restart)/?$") == [
        "/api/sessions/{session_id}/interrupt",
        "/api/sessions/{session_id}/restart",
    ]
    assert route_paths(r"/api/sessions/(?P<session_id>[^/]+)/files/(?P<path>.+)$") == [
        "/api/sessions/{session_id}/files/{path}"
    ]
    assert route_paths(r"/api/openapi.json$") == ["/api/openapi.json"]


def test_every_route_is_documented_with_the_methods_it_serves():
    routes, doc = route_table(), documented()
    assert len(routes) > 15, f"only {len(routes)} routes read: the router was not read"
    problems = []
    for path, (handler, methods) in sorted(routes.items()):
        if path not in doc:
            problems.append(f"{path} ({handler}: {sorted(methods)}) is not in openapi.json")
        elif doc[path] != methods:
            problems.append(f"{path} ({handler}) serves {sorted(methods)}, openapi.json says {sorted(doc[path])}")
    problems += [f"{path} is in openapi.json but no route serves it" for path in sorted(set(doc) - set(routes))]
    assert not problems, "openapi.json and the route table disagree:\n" + "\n".join(problems)


def test_the_document_is_served_as_valid_json_with_the_package_version():
    from sandkernel import __version__

    spec = json.loads(server.OPENAPI_PATH.read_text())
    assert spec["openapi"].startswith("3.") and spec["info"]["version"] == __version__
