"""The gateway: a tornado server with the Jupyter kernel API and websocket, and the session API.

One typed settings object (``settings``) built from flags, environment and a config file; routes
in one table (``server``); handlers that get their dependencies through ``initialize()`` and map
every error in one place (``base``); the websocket relay (``channels``, with its in-flight bounds
in ``inflight`` and audit notes in ``ws_audit``) that runs execute requests on the session
layer's one execution path; and the observers the gateway attaches to each session
(``session_observers``: activity and metrics; the transcript comes from ``notebooks``).
"""
