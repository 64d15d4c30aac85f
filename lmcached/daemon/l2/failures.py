"""What the L2 store raises, and what a misconfigured server answered.

`L2Unavailable` (down, slow, backing off) and `L2Misconfigured` (a server that answers,
but not as an L2 can use: the module docstring of `redis_store` lists the kinds) are what
`redis_store.RedisL2` raises; `describe_misconfiguration` turns redis-py's error into the
kind counted and the message logged. Imports redis-py's exceptions only: the daemon
imports this module, like `redis_store`, only when `--l2` is set.
"""

import socket

from redis.exceptions import AuthenticationError, InvalidResponse, NoPermissionError

PEEK_BYTES = 64  # of a server's answer to PING shown when it does not speak RESP


class L2Unavailable(Exception):
    """The L2 cannot answer now (refused, reset, timed out, cluster down, or backing off).

    Never an error to a client: the tier drops the write or answers a miss.
    """


class L2Misconfigured(L2Unavailable):
    """The server answers, but not as an L2 can use (module docstring): handled as an
    outage (backed off), logged once per distinct answer."""


def describe_misconfiguration(exc: Exception, addresses: list[tuple[str, int]], timeout_s: float,
                              address: tuple[str, int] | None = None) -> tuple[str, str]:
    """(error kind, what the server answered and the fix) of a misconfiguration.

    Args:
        exc: what redis-py raised (one of redis_store's `_MISCONFIG_ERRORS`).
        addresses: the L2's servers (`url.parse_l2_url`).
        timeout_s: socket timeout of the PING that shows a non-RESP answer, in seconds.
        address: the server that answered, when known.
    """
    if address is None and len(addresses) == 1:
        address = addresses[0]
    where = f"{address[0]}:{address[1]}" if address else "a server"
    if isinstance(exc, (AuthenticationError, NoPermissionError)):
        return "auth", (f"{where} refuses lmcached: {type(exc).__name__}: {exc}; --l2 sends "
                        f"no credentials: give a server that needs none (on a trusted "
                        f"network) or let its default user in")
    if isinstance(exc, InvalidResponse):
        answer = peek(address, timeout_s) if address else str(exc)
        return "protocol", (f"{where} does not speak RESP (Redis' protocol): to PING it "
                            f"answered {answer}; give the address of a Redis or Valkey "
                            f"server (port 6379 by default)")
    return "response", f"{where} refused INFO: {exc}; is it a Redis or Valkey server?"


def peek(address: tuple[str, int], timeout_s: float) -> str:
    """The first PEEK_BYTES a server sends back to an inline PING, as a Python literal
    (what a misconfiguration's message shows), or why none came."""
    try:
        with socket.create_connection(address, timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return repr(sock.recv(PEEK_BYTES))
    except OSError as exc:
        return f"nothing readable ({exc.strerror or exc})"
