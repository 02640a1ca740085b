"""Client-server mode, the device side: ``DeviceDrafter`` (the drafter + the few target tensors
it borrows), ``Transport`` (keep-alive HTTP to ``/v1/cs``), ``RemoteGenerator`` (local drafting,
remote verification, offline degradation). ``moa client generate`` is its command line."""

from moa_serve.client.device import DeviceDrafter
from moa_serve.client.generate import (
    ClientEvent,
    ClientResult,
    HandshakeError,
    LinkPolicy,
    OfflineError,
    RemoteGenerator,
)
from moa_serve.client.transport import ResyncError, ServerError, Transport, Unreachable

__all__ = [
    "ClientEvent",
    "ClientResult",
    "DeviceDrafter",
    "HandshakeError",
    "LinkPolicy",
    "OfflineError",
    "RemoteGenerator",
    "ResyncError",
    "ServerError",
    "Transport",
    "Unreachable",
]
