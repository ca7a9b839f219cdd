"""The router's freed heap memory back to the OS after large requests (malloc_trim(3))."""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Callable


LARGE_REQUEST_BYTES = 1 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on a libc without it."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


class HeapTrim:
    """Calls malloc_trim(0) `quiet_s` seconds (default 1) after the last request of
    LARGE_REQUEST_BYTES (1 MiB) or more ended, once per such quiet spell.

    A request of up to router.max_request_bytes arrives in HTTP/2 frames that gRPC
    reassembles and Python copies into bytes. glibc keeps the freed chunks in its
    arenas (one per allocating thread, up to 8 per core: mallopt(3)), resident: on the
    default model's router, floods of 4 concurrent 8 MiB requests left 60-105 MB behind
    each, and malloc_trim(0) gave all of it back. A trim takes each arena's lock in turn
    and runs off the event loop, in a thread.
    """

    def __init__(self, quiet_s: float = 1.0, trim: Callable[[int], int] | None = None):
        self.quiet_s = quiet_s
        self._trim = trim if trim is not None else _malloc_trim()
        self._last_end: float | None = None       # monotonic, of the last large request
        self.trims = 0

    @property
    def pending(self) -> bool:
        """A large request ended since the last trim."""
        return self._last_end is not None

    def ended(self, request_bytes: int) -> None:
        """A request of `request_bytes` (bytes on the wire, or of an HTTP body) ended; its
        buffers are dropped by the time the trim runs, `quiet_s` later."""
        if request_bytes >= LARGE_REQUEST_BYTES:
            self._last_end = time.monotonic()

    async def run(self) -> None:
        """Trim while the router serves; cancel to stop."""
        if self._trim is None:
            return
        while True:
            await asyncio.sleep(self.quiet_s / 2)
            if self._last_end is not None and time.monotonic() - self._last_end >= self.quiet_s:
                self._last_end = None
                await asyncio.to_thread(self._trim, 0)
                self.trims += 1
