"""Many hosts: one gateway per Docker engine, PostgreSQL as the cluster's only coordinator.

``catalog``: the shared tables of hosts, sessions' owners and tenants' limits (:class:`ClusterCatalog`,
over the connection pool of ``gateway/cluster/postgres.py``'s PostgresStore); ``membership``: this
gateway's registration and heartbeat; ``signing``/``forward``: requests sent on to the host that
holds a session. Nothing is imported here: a single-host gateway never needs psycopg.
"""
