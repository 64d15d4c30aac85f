"""Redis as the L2 store: pipelined SET / EXISTS / GET, from many threads, through outages.

Why this file exists: the L2 tier's writer and fetch threads need a store that batches
every request into one round trip per Redis node, works the same on one server and on a
cluster, and turns an L2 that is down, slow or full into a counted event instead of an
error or a hang. It and `failures` are the only modules that import redis-py, so the
daemon needs redis-py only when `--l2` is set (`pip install 'lmcached[l2]'`). Valkey
speaks the same protocol.

How it talks to Redis (redis-py with hiredis, its C reply parser, when installed):

- Mode is detected at first use: `INFO cluster` on the first address that answers;
  `cluster_enabled:1` -> `redis.cluster.RedisCluster` (its pipeline sends each node its
  commands, all nodes written before any is read), else one `redis.Redis`.
- One client shared by every thread; each call builds its own pipeline from it
  (redis-py: "Redis client instances can safely be shared between threads ... It is not
  safe to pass PubSub or Pipeline objects between threads", docs "Advanced Features";
  RedisCluster guards its slot table with locks, redis/cluster.py NodesManager).
- redis-py retries nothing here: its default Retry (3 attempts, exponential back-off up
  to 10 s, redis/client.py) would hide an outage for seconds. One attempt, socket
  timeouts of `timeout_s`, and our own back-off instead (a circuit breaker):

      up --failure--> down, retry_at = now + backoff (0.1 s, doubling to 5 s)
      down: every call raises L2Unavailable at once (no network) until retry_at;
            then ONE call probes (others still fail fast): success -> up
            (num_reconnects += 1, backoff = 0.1 s), failure -> down, backoff doubled.

- A server that answers, but not as an L2 can use, is `misconfigured`, with the same
  back-off (each probe connects and checks again): one that does not speak RESP (a wrong
  port: its first bytes are shown), one that refuses us without a password (NOAUTH,
  NOPERM: `--l2` sends no credentials), a read-only replica (INFO role:slave at connect,
  or READONLY to a SET after a failover). Counted by kind ("protocol", "auth", "readonly",
  "response" for an INFO refused), logged as ONE error line per distinct answer, never a
  traceback per call.
"""

import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    InvalidResponse,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from lmcached.daemon.l2.counters import ERROR_KINDS
from lmcached.daemon.l2.failures import L2Misconfigured, L2Unavailable, describe_misconfiguration
# parse_l2_url stays importable from here: settings and startup import it through this
# module, so that a missing redis-py fails there with the install hint.
from lmcached.daemon.l2.url import parse_l2_url  # noqa: F401
from lmcached.daemon.l2.values import GENERATION_KEY
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

BACKOFF_MIN_S = 0.1  # first wait after a failure
BACKOFF_MAX_S = 5.0  # the wait doubles after each failed probe, up to this
# An L2 that cannot answer now: raised by redis-py, or (cluster pipelines) returned in the
# place of a command it re-sent alone. ClusterDownError: a master is gone (CLUSTERDOWN);
# RedisClusterException: no startup node answers, or slots are not covered.
_OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, ClusterDownError,
                  RedisClusterException, OSError)
_TIMEOUT_ERRORS = (RedisTimeoutError, TimeoutError)
# A server that answers, but not as Redis answers us: before _OUTAGE_ERRORS (redis-py's
# AuthenticationError is a ConnectionError).
_MISCONFIG_ERRORS = (InvalidResponse, AuthenticationError, NoPermissionError, ResponseError)

_now = time.monotonic  # the back-off's clock (tests replace it)


class RedisL2:
    """The L2 store on Redis or Valkey, standalone or cluster; shared by every thread.

    Each call is one pipeline (one round trip per node the keys live on), runs in the
    calling thread and returns when Redis answered, or raises L2Unavailable. It never
    connects in __init__: the mode is detected at the first call.

    Args:
        addresses: (host, port) per server (`parse_l2_url`).
        ttl_s: time to live of the values written, in seconds (sent as SET PX in whole
            milliseconds, at least 1); None = no expiry.
        timeout_s: socket connect and read timeout per operation, in seconds (a reply
            slower than this is an outage; a pipeline of many values may take longer
            in total, each read bounded by it).

    Attributes:
        mode: "unknown" (before the first call), "standalone" or "cluster".
        state: "unknown" (before the first answer), "up", "down" or "misconfigured".
        errors: failed calls and refused commands by kind: "connection" (refused,
            reset, cluster down), "timeout", "full" (a SET refused with OOM: maxmemory
            reached under `noeviction`), "response" (any other error reply), and the
            misconfigurations "protocol" (not RESP), "auth" (NOAUTH, NOPERM), "readonly"
            (a replica). Calls refused during back-off are not counted.
        num_reconnects: successes after a failure.

    Raises:
        ValueError: no address, ttl_s <= 0 or timeout_s <= 0.
    """

    def __init__(self, addresses: list[tuple[str, int]], *, ttl_s: float | None,
                 timeout_s: float = 1.0) -> None:
        if not addresses:
            raise ValueError("RedisL2 needs at least one (host, port); see parse_l2_url")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 seconds or None (no expiry), got {ttl_s}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.addresses = [(str(host), int(port)) for host, port in addresses]
        self.url = ",".join(f"{host}:{port}" for host, port in self.addresses)
        self._px = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._conn_kwargs = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        self.mode = "unknown"
        self.state = "unknown"
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self.num_reconnects = 0
        self._lock = threading.Lock()  # state, counters, back-off
        self._connect_lock = threading.Lock()  # one thread detects the mode and connects
        self._client: redis.Redis | RedisCluster | None = None
        self._backoff_s = BACKOFF_MIN_S
        self._retry_at = 0.0
        self._probing = False
        self._config_error: str | None = None
        self._misconfig_logged: str | None = None  # the answer last logged
        self._closed = False

    # ---------------------------------------------------------------- the API
    def set_many(self, items: list[tuple[bytes, bytes]]) -> int:
        """SET each (key, value) in one pipeline, with PX ttl when a TTL is set.

        Args:
            items: (key, value) pairs; values are bytes or memoryviews (sent as they are).

        Returns:
            How many values were stored. A SET refused by Redis is counted in
            `errors` ("full" for OOM, "response" else), not raised.

        Raises:
            L2Unavailable: the L2 is down, slow or backing off (nothing is known stored).
        """
        if not items:
            return 0
        return sum(result is True for result in self._pipelined(self._sets(items)))

    def set_many_reading_generation(self, items: list[tuple[bytes, bytes]]) -> tuple[int, int]:
        """`set_many`, with a GET of the L2's clear generation (`generation`) in the same
        pipeline: a writer learns a CLEAR another node ran at no extra round trip.

        Returns:
            (values stored, the L2's clear generation).

        Raises:
            L2Unavailable: as `set_many`.
        """
        sets = self._sets(items)

        def queue(pipe) -> None:
            pipe.get(GENERATION_KEY)
            sets(pipe)

        results = self._pipelined(queue)
        return sum(result is True for result in results[1:]), _as_generation(results[0])

    def _sets(self, items: list[tuple[bytes, bytes]]):
        """A pipeline filler that SETs each item, with PX ttl when a TTL is set."""
        px = self._px

        def queue(pipe) -> None:
            for key, value in items:
                if px is None:
                    pipe.set(key, value)
                else:
                    pipe.set(key, value, px=px)
        return queue

    def generation(self) -> int:
        """The L2's clear generation: GET of `values.GENERATION_KEY`, 0 when it is absent
        (no CLEAR yet) or holds no integer. Keys of chunks carry it (`values.l2_key`).

        Raises:
            L2Unavailable: the L2 is down, slow or backing off.
        """
        return _as_generation(self._pipelined(lambda pipe: pipe.get(GENERATION_KEY))[0])

    def bump_generation(self) -> int:
        """Advance the L2's clear generation (INCR of `values.GENERATION_KEY`): from
        now on every daemon on this L2 reads and writes chunks under the new one, and
        the keys of older generations are never read again (their TTL removes them).

        Returns:
            The new generation.

        Raises:
            L2Unavailable: the L2 is down, slow or backing off.
            RuntimeError: Redis refused the INCR (e.g. the key holds no integer: DEL it).
        """
        result = self._pipelined(lambda pipe: pipe.incr(GENERATION_KEY))[0]
        if not isinstance(result, int):
            raise RuntimeError(f"L2 {self.url}: INCR {GENERATION_KEY.decode()} was refused "
                               f"({result}); delete that key (redis-cli DEL "
                               f"{GENERATION_KEY.decode()}) and run CLEAR again")
        return result

    def exists_prefix(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first on, exist (EXISTS in one pipeline).

        Args:
            keys: the L2 keys of a chain's chunks, in chain order.

        Returns:
            The length of the leading run of keys that exist; a later key that exists
            after a missing one does not count (a chain is usable up to its first gap).

        Raises:
            L2Unavailable: the L2 is down, slow or backing off.
        """
        if not keys:
            return 0
        results = self._pipelined(lambda pipe: [pipe.exists(key) for key in keys])
        num_leading = 0
        while num_leading < len(results) and results[num_leading] == 1:
            num_leading += 1
        return num_leading

    def value_lengths(self, keys: list[bytes]) -> list[int]:
        """The length of each key's value in bytes, 0 for a missing key (STRLEN in one
        pipeline), so that a fetch knows what it will GET before it does.

        Args:
            keys: the L2 keys to measure.

        Returns:
            One length per key, in order; 0 for a missing key or a refused STRLEN.

        Raises:
            L2Unavailable: the L2 is down, slow or backing off.
        """
        if not keys:
            return []
        results = self._pipelined(lambda pipe: [pipe.strlen(key) for key in keys])
        return [result if isinstance(result, int) else 0 for result in results]

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """GET each key in one pipeline.

        Args:
            keys: the L2 keys to read.

        Returns:
            The values in the order of `keys`; None for a key that does not exist (or
            expired, or whose GET was refused: counted in `errors["response"]`).

        Raises:
            L2Unavailable: the L2 is down, slow or backing off.
        """
        if not keys:
            return []
        results = self._pipelined(lambda pipe: [pipe.get(key) for key in keys])
        return [result if isinstance(result, bytes) else None for result in results]

    def close(self) -> None:
        """Close every connection; later calls raise L2Unavailable. Idempotent."""
        with self._connect_lock, self._lock:
            client, self._client = self._client, None
            self._closed = True
        if client is not None:
            client.close()

    # ------------------------------------------------------- the one call path
    def _pipelined(self, queue) -> list:
        """Run the commands `queue(pipe)` adds in one pipeline; count, back off."""
        probing = self._admit()
        try:
            try:
                client = self._client if self._client is not None else self._connect()
                pipe = client.pipeline(transaction=False)
                queue(pipe)
                results = pipe.execute(raise_on_error=False)
            except L2Misconfigured:
                raise
            except _MISCONFIG_ERRORS as exc:
                raise self._misconfigured(*describe_misconfiguration(
                    exc, self.addresses, self._conn_kwargs["socket_timeout"]), probing) from None
            except _OUTAGE_ERRORS as exc:
                raise self._down(exc, probing) from exc
            refused = {"full": 0, "response": 0}
            for result in results:
                if isinstance(result, _OUTAGE_ERRORS):  # a cluster command re-sent alone
                    raise self._down(result, probing) from result
                if isinstance(result, ReadOnlyError):  # a failover made it a replica
                    self._misconfigured("readonly", f"refused a write: READONLY {result}; "
                                        f"give the primary's address", probing)
                    return results
                if isinstance(result, Exception):
                    refused["full" if isinstance(result, OutOfMemoryError) else "response"] += 1
            self._up(refused)
            return results
        finally:
            if probing:
                with self._lock:
                    self._probing = False

    def _admit(self) -> bool:
        """Let a call through, or raise at once. Returns True when the call is the probe."""
        with self._lock:
            if self._closed:
                raise L2Unavailable(f"L2 {self.url}: the store is closed")
            if self._config_error is not None:
                raise ValueError(self._config_error)
            if self.state not in ("down", "misconfigured"):
                return False
            wait_s = self._retry_at - _now()
            if wait_s > 0 or self._probing:
                raise L2Unavailable(f"L2 {self.url} is {self.state}; next try in "
                                    f"{max(wait_s, 0):.2f} s")
            self._probing = True
            return True

    def _connect(self) -> "redis.Redis | RedisCluster":
        """Detect the mode (`INFO cluster` on the first address that answers) and
        create the shared client. Raises an outage error when no address answers."""
        with self._connect_lock:
            if self._client is not None:
                return self._client
            if self._closed:
                raise L2Unavailable(f"L2 {self.url}: the store is closed")
            no_retry = Retry(NoBackoff(), 0)
            last_exc: Exception | None = None
            for host, port in self.addresses:
                probe = redis.Redis(host=host, port=port, retry=no_retry, **self._conn_kwargs)
                try:
                    cluster = probe.info("cluster").get("cluster_enabled") == 1
                    replication = {} if cluster else probe.info("replication")
                except _MISCONFIG_ERRORS as exc:
                    probe.close()
                    raise self._misconfigured(*describe_misconfiguration(
                        exc, self.addresses, self._conn_kwargs["socket_timeout"], (host, port)),
                        self._probing) from None
                except _OUTAGE_ERRORS as exc:
                    probe.close()
                    last_exc = exc
                    continue
                if replication.get("role") == "slave":
                    probe.close()
                    raise self._misconfigured(
                        "readonly", f"{host}:{port} is a read-only replica (INFO role:slave, "
                        f"of {replication.get('master_host')}:{replication.get('master_port')})"
                        f"; give the primary's address", self._probing)
                if cluster:
                    probe.close()
                    client, mode = self._cluster_client(no_retry), "cluster"
                elif len(self.addresses) > 1:
                    probe.close()
                    with self._lock:
                        self._config_error = (
                            f"L2 {self.url}: {host}:{port} is a standalone server (INFO "
                            f"cluster_enabled:0); list several addresses only for a cluster")
                    logger.error("%s", self._config_error)
                    raise ValueError(self._config_error)
                else:
                    client, mode = probe, "standalone"
                self._client, self.mode = client, mode
                logger.info("L2 %s: %s mode", self.url, mode)
                return client
            assert last_exc is not None, "at least one address was tried (a bug)"
            raise last_exc

    def _cluster_client(self, no_retry: Retry) -> RedisCluster:
        """A RedisCluster client that retries nothing (its own loop and its nodes')."""
        if redis.VERSION >= (6,):  # the Retry object sets the cluster's own attempts
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.addresses],
                                retry=no_retry, **self._conn_kwargs)
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.addresses],
                            retry=no_retry, cluster_error_retry_attempts=0, **self._conn_kwargs)

    def _misconfigured(self, kind: str, what: str, probing: bool) -> L2Misconfigured:
        """Count a misconfiguration, back off as for an outage, drop the client (the next
        probe connects and checks again), log it once per distinct answer. Returns what
        to raise."""
        message = f"L2 {what}" if len(self.addresses) == 1 else f"L2 {self.url}: {what}"
        with self._lock:
            self.errors[kind] += 1
            self._client = None  # in-flight calls of other threads keep their reference
            if self.state not in ("down", "misconfigured") or probing:
                wait_s = self._backoff_s
                self._retry_at = _now() + wait_s
                self._backoff_s = min(2 * wait_s, BACKOFF_MAX_S)
            self.state = "misconfigured"
            log, self._misconfig_logged = message != self._misconfig_logged, message
        if log:
            logger.error("%s. Chunks stay in the arena; lmcached tries again, backing off up "
                         "to %g s (INFO l2_state:misconfigured, l2_errors_%s)", message,
                         BACKOFF_MAX_S, kind)
        return L2Misconfigured(message)

    def _down(self, exc: BaseException, probing: bool) -> L2Unavailable:
        """Count a failed call; start or lengthen the back-off. Returns what to raise."""
        kind = "timeout" if isinstance(exc, _TIMEOUT_ERRORS) else "connection"
        with self._lock:
            self.errors[kind] += 1
            if self.state != "down" or probing:  # not a call admitted before the outage
                wait_s = self._backoff_s
                self._retry_at = _now() + wait_s
                self._backoff_s = min(2 * wait_s, BACKOFF_MAX_S)
                self.state = "down"
                logger.warning("L2 %s down (%s: %s); next try in %.1f s", self.url,
                               type(exc).__name__, exc, wait_s)
        return L2Unavailable(f"L2 {self.url}: {type(exc).__name__}: {exc}")

    def _up(self, refused: dict[str, int]) -> None:
        """Count an answered call and the commands Redis refused in it."""
        with self._lock:
            for kind, count in refused.items():
                self.errors[kind] += count
            if self.state in ("down", "misconfigured"):
                self.num_reconnects += 1
                logger.info("L2 %s back (reconnect %d)", self.url, self.num_reconnects)
            self.state = "up"
            self._misconfig_logged = None
            self._backoff_s = BACKOFF_MIN_S


def _as_generation(result) -> int:
    """A GET of the generation key as an integer: 0 when absent, refused or not one."""
    try:
        return max(0, int(result)) if isinstance(result, bytes | str) else 0
    except ValueError:
        return 0
