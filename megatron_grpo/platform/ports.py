"""A free TCP port for a rendezvous (torchrun's --master-port, a single-process group)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS had free on ``host`` just now. Another process may take it before it is
    used; callers that start torchrun retry on an address-in-use failure where that matters."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
