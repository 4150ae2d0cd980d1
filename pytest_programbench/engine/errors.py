"""The engine's infrastructure errors: whatever they interrupt is an error of the run, never an agent's score."""

from __future__ import annotations

import requests


class EngineUnavailable(Exception):
    """The Docker engine does not answer: an infrastructure error, never a score."""


class EngineConnectionError(EngineUnavailable, requests.exceptions.ConnectionError):
    """The connection to the engine failed (after the retries the operation allows)."""


class EngineRestarted(EngineConnectionError):
    """The engine restarted while a container of this process was in use: its state is gone."""


class DiskSpaceError(EngineUnavailable):
    """Not enough free disk space for what was about to happen: an infrastructure error, never a score."""
