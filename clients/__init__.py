"""Clients of a tlt-serve server: typed HTTP clients, the task, an example RL loop."""

from clients.client import AsyncClient, Client
from clients.results import AuthError, BadRequest, Sample, ServerError, SpecStats, Unavailable

__all__ = ["AsyncClient", "AuthError", "BadRequest", "Client", "Sample", "ServerError",
           "SpecStats", "Unavailable"]
