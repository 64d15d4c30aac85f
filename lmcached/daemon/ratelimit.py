"""`RateLimitedLog`: a warning repeated by a condition that persists, logged at most once
per LOG_INTERVAL_S with a count of the ones left out.

Why this file exists: the event loop (a full accept queue, dropped clients) and the disk
tier (I/O faults) both log conditions that can recur on every loop pass; neither may
flood the log, and the disk tier must not import the loop's modules to get this.
"""

import logging
import time

LOG_INTERVAL_S = 10.0  # a repeated warning is logged at most once per interval


class RateLimitedLog:
    """Logs a repeated condition at most once per LOG_INTERVAL_S, with a repeat count.

    Args:
        logger: the logger of the module whose condition it reports (its name is what
            operators filter on, and what docs/troubleshooting.md quotes).
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.next_at = 0.0
        self.suppressed = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        if self.suppressed:
            message += " (%d more since the last report)"
            args = (*args, self.suppressed)
        self.logger.warning(message, *args)
        self.suppressed = 0
        self.next_at = now + LOG_INTERVAL_S
