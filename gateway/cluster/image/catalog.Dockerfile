# The sandkernel catalog image: PostgreSQL 15 from Debian's packages, the `catalog` service of
# the Swarm stack (stack.yml; issue 18). Built by `sandkernel cluster image build`
# (gateway/cluster/catalog_image.py) with the classic builder, in a context holding this file and
# catalog-start.sh. BASE_IMAGE is the gateway image's base (python:3.11-slim or the debootstrapped
# sandkernel-base:bookworm, both Debian 12); the packages come from Debian's mirror through apt,
# as the kernel image's catatonit does: no registry, no Docker Hub.
ARG BASE_IMAGE=sandkernel-base:bookworm
FROM ${BASE_IMAGE}

# The postgres user with a fixed uid/gid (999, as Docker's own postgres images): the stack gives
# the password secret to this uid, mode 0400, so it must be known before the package makes the
# user. No default cluster (create_main_cluster = false): the data dir is the service's volume,
# made by initdb on first start (catalog-start.sh). policy-rc.d keeps the packages' scripts from
# starting a server inside the build; it is removed again. Left out, to halve the image: the
# packages' docs, man pages and translations (dpkg path-exclude), the downloaded .debs (the
# debootstrapped base keeps them), and LLVM with z3 (128 MB, only for JIT-compiling big analytic
# queries: the catalog runs small indexed ones, and catalog-start.sh sets jit=off). Removing those
# two leaves dpkg's record of postgresql-15's dependency unmet; nothing installs packages later.
RUN set -eu; \
    printf '%s\n' 'path-exclude=/usr/share/doc/*' 'path-exclude=/usr/share/man/*' \
      'path-exclude=/usr/share/locale/*' > /etc/dpkg/dpkg.cfg.d/sandkernel-catalog-nodoc; \
    groupadd -r -g 999 postgres; \
    useradd -r -g postgres -u 999 -d /var/lib/postgresql -s /bin/sh postgres; \
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 0755 /usr/sbin/policy-rc.d; \
    apt-get update -q; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql-common; \
    sed -ri 's/^#?\s*create_main_cluster\b.*$/create_main_cluster = false/' /etc/postgresql-common/createcluster.conf; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql-15; \
    command -v catatonit >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends catatonit; \
    dpkg --purge --force-depends libllvm14 libz3-4; rm -f /usr/lib/postgresql/15/lib/llvmjit*; \
    rm -f /usr/sbin/policy-rc.d /etc/dpkg/dpkg.cfg.d/sandkernel-catalog-nodoc; \
    apt-get clean; rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin; \
    test ! -e /var/lib/postgresql/15/main; \
    mkdir -p /var/lib/postgresql/data /var/run/postgresql; \
    chown postgres:postgres /var/lib/postgresql/data /var/run/postgresql; \
    chmod 0700 /var/lib/postgresql/data; chmod 2775 /var/run/postgresql; \
    /usr/lib/postgresql/15/bin/postgres --version

COPY catalog-start.sh /usr/local/bin/sandkernel-catalog
RUN chmod 0755 /usr/local/bin/sandkernel-catalog

ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data \
    LANG=C.UTF-8
# A named volume mounted here starts as a copy of this directory: owned by postgres, 0700.
VOLUME /var/lib/postgresql/data
USER postgres:postgres
EXPOSE 5432
# pg_isready needs no login: it answers whether the server accepts connections. Swarm counts the
# task running only once it is healthy; the gateways retry until then (they restart).
HEALTHCHECK --interval=5s --timeout=5s --start-period=30s --retries=3 \
    CMD ["pg_isready", "-q", "-h", "127.0.0.1", "-p", "5432", "-U", "sandkernel", "-d", "sandkernel"]
# SIGINT is PostgreSQL's fast shutdown (SIGTERM's smart shutdown would wait for every gateway's
# pooled connection to close, until Swarm's SIGKILL). catatonit passes it on and reaps zombies.
STOPSIGNAL SIGINT
LABEL org.opencontainers.image.title="sandkernel catalog" sandkernel.image="catalog"
ENTRYPOINT ["catatonit", "--", "sandkernel-catalog"]
