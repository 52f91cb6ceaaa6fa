"""HTTPS and WSS for the gateway (``--certfile``/``--keyfile``): the operator's certificate.

Why here and not only at a load balancer: in a cluster the gateways forward tenants' requests to
each other, ``Authorization`` header included, over the hosts' network. With TLS on every
gateway (``--advertise-url https://...``) that hop is encrypted too; the forwarding gateway
checks the owner's certificate against the system's trust store, which ``SSL_CERT_FILE`` points
at a private cluster CA (docs/scale-out.md). TLS 1.2 at least; the key is the operator's file,
read once at start-up.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from sandkernel.errors import ConfigError


def server_context(certfile: Path, keyfile: Path) -> ssl.SSLContext:
    """The TLS context the gateway serves with; ConfigError saying what to fix when the files
    cannot be used (missing, not PEM, a key that is not the certificate's)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile, keyfile)
    except FileNotFoundError as err:
        raise ConfigError(f"the TLS file {err.filename} does not exist; fix --certfile/--keyfile") from None
    except (ssl.SSLError, OSError) as err:
        raise ConfigError(
            f"the TLS certificate {certfile} and key {keyfile} cannot be used ({err.__class__.__name__}: "
            f"{getattr(err, 'reason', None) or err}); give a PEM certificate chain and its PEM private key"
        ) from None
    return context
