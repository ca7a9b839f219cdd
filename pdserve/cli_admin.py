"""`pdserve` commands that call a running cluster's Admin service (status, drain,
scale), and the client flags every calling command shares (cli.py's generate too)."""

from __future__ import annotations

import argparse
import os
import sys


def make_client(args, command: str):
    """The Client that `generate` / `status` flags ask for, or None after printing why
    it cannot be made (--tls-cert without --tls-key or the other way round, a --tls-*
    file that cannot be read)."""
    from .client import Client

    try:
        return Client(args.server, tls=args.tls, tls_ca_file=args.tls_ca,
                      tls_client_cert_file=args.tls_cert, tls_client_key_file=args.tls_key,
                      api_key=args.api_key,
                      admin_api_key=getattr(args, "admin_api_key", None))
    except (ValueError, OSError) as e:
        print(f"pdserve {command}: {e}", file=sys.stderr)
        return None


def add_client_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", action="store_true",
                   help="connect over TLS, checking the server against the system's roots "
                        "(implied by --tls-ca / --tls-cert)")
    p.add_argument("--tls-ca", default=None,
                   help="PEM CA that signed the server's certificate (connects over TLS)")
    p.add_argument("--tls-cert", default=None,
                   help="mutual TLS: PEM client certificate (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="mutual TLS: PEM key of --tls-cert")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None,
                   help="sent as 'authorization: Bearer <key>' (default: $PDSERVE_API_KEY)")


def _add_admin_key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin-api-key", default=os.environ.get("PDSERVE_ADMIN_API_KEY") or None,
                   help="the router's admin key, which Drain and Scale need "
                        "(default: $PDSERVE_ADMIN_API_KEY)")


def _admin_call(args, command: str, call):
    """`call(client)` on a Client from the flags: (reply, None), or (None, exit code)
    after printing why (2: bad client flags; 1: the RPC failed, with its status)."""
    import grpc

    client = make_client(args, command)
    if client is None:
        return None, 2
    with client:
        try:
            return call(client), None
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return None, 1


def _drain(args) -> int:
    r, rc = _admin_call(args, "drain", lambda c: c.drain(args.node_ip, args.timeout_s))
    if r is None:
        return rc
    print(f"{args.node_ip}: {', '.join(r.worker_ids)} take no new requests; "
          + ("drained" if r.drained else f"{r.running_requests} requests still running after "
                                         f"{args.timeout_s:g} s"))
    return 0 if r.drained else 1


def _scale(args) -> int:
    r, rc = _admin_call(args, "scale", lambda c: c.scale(args.prefill, args.decode,
                                                         args.timeout_s))
    if r is None:
        return rc
    print(f"serving: {r.num_prefill_workers} prefill, {r.num_decode_workers} decode"
          + (f"; started {', '.join(r.started)}" if r.started else "")
          + (f"; retired {', '.join(r.retired)}" if r.retired else "")
          + (f"; stopped at {args.timeout_s:g} s, their requests moved on: "
             f"{', '.join(r.migrated)}" if r.migrated else ""))
    return 0


def _status(args) -> int:
    st, rc = _admin_call(args, "status", lambda c: c.status())
    if st is None:
        return rc
    cols = ("worker_id", "role", "pid", "node_ip", "state", "epoch", "kv_blocks_free",
            "kv_blocks_total", "running_requests", "waiting_requests", "kv_reservations_leased",
            "kv_reservations_reclaimed", "kv_address", "metrics_address")
    rows = [[f"{w.epoch:x}"[:8] if c == "epoch" else str(getattr(w, c)) for c in cols]
            for w in st.workers]
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(cols)]
    print(f"model: {st.model}  queued for prefill: {st.queued_requests} requests, "
          f"{st.queued_tokens} prompt tokens  router metrics: http://{st.metrics_address}/metrics"
          + (f"  OpenAI HTTP: {st.http_address}" if st.http_address else ""))
    for r in [list(cols), *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    return 0


def add_admin_parsers(sub) -> None:
    """The status, drain and scale subcommands on `sub` (argparse subparsers)."""
    st = sub.add_parser("status", help="print ClusterStatus as a table")
    st.add_argument("--server", default="127.0.0.1:50051")
    add_client_security_args(st)
    st.set_defaults(fn=_status)

    dr = sub.add_parser("drain", help="stop new requests to one node's workers and wait for "
                                      "theirs to finish (a Kubernetes preStop hook)")
    dr.add_argument("--server", default="127.0.0.1:50051")
    dr.add_argument("--node-ip", required=True, help="the node whose workers drain")
    dr.add_argument("--timeout-s", type=float, default=60.0,
                    help="how long to wait for their requests (seconds)")
    add_client_security_args(dr)
    _add_admin_key_arg(dr)
    dr.set_defaults(fn=_drain)

    sc = sub.add_parser("scale", help="start or retire workers at runtime (Admin.Scale): a "
                                      "retiring worker finishes its requests first")
    sc.add_argument("--server", default="127.0.0.1:50051")
    sc.add_argument("--prefill", type=int, required=True, help="prefill workers wanted")
    sc.add_argument("--decode", type=int, required=True, help="decode workers wanted")
    sc.add_argument("--timeout-s", type=float, default=300.0,
                    help="how long a retiring worker may take to finish its requests; "
                         "then they move to the others (retry, stream migration)")
    add_client_security_args(sc)
    _add_admin_key_arg(sc)
    sc.set_defaults(fn=_scale)
