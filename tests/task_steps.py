"""Counting the steps of trio tasks: a test that a long job gives the event loop
back between passes asserts on this count, not on timing."""
from __future__ import annotations

import collections

import trio


class TaskSteps(trio.abc.Instrument):
    """How many times each task ran: a task that never yields runs once."""

    def __init__(self):
        self.steps = collections.Counter()

    def before_task_step(self, task):
        self.steps[task.name] += 1
