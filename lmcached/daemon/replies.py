"""What a request handler gives besides a reply Struct: a refusal, or a reply that waits.

Why this file exists: every handler module (`namespaces.py`, `request_checks.py`,
`value_handlers.py`, `admin_handlers.py`) raises `RequestError`, and the server parks a
`Deferred`; both live apart from `service.py` so that those modules need not import it.
"""


class RequestError(Exception):
    """A request the daemon refuses: becomes an `Error(code, message)` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Deferred:
    """A LOOKUP or ACQUIRE that waits for a fetch from the disk tier or L2 (docs/l2.md,
    "How a fetch looks to a client"): the server parks its connection until `job.done`
    or `deadline` (time.monotonic()), then answers it with `CacheService.resume`, which
    counts a wait that ran out in `stats.fetch_waits_timed_out` (the fetching tier's
    counters, `SpillTier.stats()`)."""

    __slots__ = ("request", "job", "deadline", "stats")

    def __init__(self, request, job, deadline: float, stats) -> None:
        self.request = request
        self.job = job
        self.deadline = deadline
        self.stats = stats
