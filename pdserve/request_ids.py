"""A request's ids on the workers. The router names each attempt at a request
`<client id>#<router>.<32 hex digits>` (`router`: the index of the router replica that
serves it, `serve --routers N`; the digits 128 random bits, so that attempts at
requests that reuse a client id never share an id on a worker, where an id names a
reservation and its KV), and the decode worker names sample k > 0 of it
`<attempt id>/<k>` (decode_worker/fork.py). A worker tells from the id alone which
replica a request belongs to: whose event stream carries its tokens, and what a
restarted replica aborts. The client id may hold any printable character; the tag
follows its last "#"."""

from __future__ import annotations

import re
import secrets

_TAG = re.compile(r"(\d+)\.[0-9a-f]{32}(?:/\d+)?")


def attempt_id(client_id: str, router: int) -> str:
    """A new id, unique per attempt, for an attempt at `client_id` by router `router`."""
    return f"{client_id}#{router}.{secrets.token_hex(16)}"


def router_of(request_id: str) -> int:
    """The router index in `request_id` (an attempt's or a sample's id); 0 for an id
    without the tag (a worker driven directly: benchmarks, tests)."""
    _, sep, tail = request_id.rpartition("#")
    m = _TAG.fullmatch(tail) if sep else None
    return int(m.group(1)) if m else 0
