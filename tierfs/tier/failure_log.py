"""A background task's repeating failure, logged once until the task works again.

gc and compaction retry every few seconds; during a bucket outage each pass fails the
same way, and a warning per pass would bury the log. The first failure is a warning,
the recovery an info line with how many passes failed in between (as the uploader's)."""
from __future__ import annotations

import logging


class FailureLog:
    def __init__(self, logger: logging.Logger, what: str):
        self.logger = logger
        self.what = what
        self.failures = 0  # in a row, since it last worked

    def failed(self, error: Exception) -> None:
        if not self.failures:
            self.logger.warning("%s failed (%s); will retry, and say so once it works again",
                                self.what, error)
        self.failures += 1

    def worked(self) -> None:
        if self.failures:
            self.logger.info("%s works again, after %d failed tries", self.what,
                                self.failures)
        self.failures = 0
