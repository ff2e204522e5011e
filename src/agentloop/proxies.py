"""The proxy the environment names for a URL, for the clients that build their own transport (the
Bot API's, Discord's, Fetch): they pass ``trust_env=False`` to httpx, which would otherwise also
read ``.netrc`` credentials and certificate paths, and give the transport this proxy instead."""

from __future__ import annotations

import ipaddress
import urllib.request
from urllib.parse import urlsplit

__all__ = ["env_proxy", "this_machine"]


def this_machine(host: str) -> bool:
    """Whether ``host`` names this machine whatever a resolver says: ``localhost`` (and names
    under it, RFC 6761) or a loopback address."""
    name = host.lower().rstrip(".").removeprefix("[").removesuffix("]")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY`` or ``HTTP_PROXY`` by its
    scheme, else ``ALL_PROXY``, lower case first), as httpx itself would use it: None for a host
    ``NO_PROXY`` names, and for this machine (``localhost``, a loopback address: a proxy would
    reach its own), as Go's clients do. A proxy given without a scheme (``proxy:3128``) is an
    ``http://`` one, as curl and httpx read it."""
    parts = urlsplit(url)
    host = parts.hostname
    if host is None or this_machine(host) or urllib.request.proxy_bypass(host):
        return None
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy:
        return None
    return proxy if "://" in proxy else f"http://{proxy}"
