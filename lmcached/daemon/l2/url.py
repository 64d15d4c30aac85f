"""The `--l2` URL: which Redis or Valkey servers the L2 tier talks to.

Pure, no I/O and no redis-py: `lmcached.settings` checks `--l2` with it before the daemon
starts, and `redis_store.RedisL2` takes the addresses it returns.
"""

URL_SCHEMES = ("redis://", "valkey://")


def parse_l2_url(url: str) -> list[tuple[str, int]]:
    """The servers of an L2 URL: `redis://HOST:PORT[,HOST:PORT...]` (or `valkey://`).

    One address is a standalone server or one node of a cluster; several addresses are
    the startup nodes of a cluster (which the servers' `INFO cluster` confirms at first
    use). IPv6 hosts go in brackets: `redis://[::1]:6379`.

    Args:
        url: the `--l2` option's value.

    Returns:
        (host, port) per address, in the URL's order.

    Raises:
        TypeError: `url` is not a str.
        ValueError: another scheme, a missing or bad port, a credential, a database
            number or query, an empty or repeated address; the message shows the fix.
    """
    if not isinstance(url, str):
        raise TypeError(f"the L2 URL is a str like 'redis://10.0.0.5:6379', "
                        f"got {type(url).__name__}")
    scheme = next((s for s in URL_SCHEMES if url.startswith(s)), None)
    if scheme is None:
        raise ValueError(f"L2 URL {url!r}: write redis://HOST:PORT[,HOST:PORT...] "
                         f"(or valkey://), e.g. redis://10.0.0.5:6379")
    rest = url[len(scheme):]
    if any(c in rest for c in "@/?#"):
        raise ValueError(f"L2 URL {url!r}: credentials, database numbers and options are not "
                         f"supported; give only HOST:PORT[,HOST:PORT...]")
    addresses: list[tuple[str, int]] = []
    for part in rest.split(","):
        host, sep, port = part.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"L2 URL {url!r}: {part!r} is not HOST:PORT with a port in "
                             f"1..65535, e.g. redis://10.0.0.5:6379")
        if (host, int(port)) in addresses:
            raise ValueError(f"L2 URL {url!r}: {part} is listed twice; list each server once")
        addresses.append((host, int(port)))
    return addresses
