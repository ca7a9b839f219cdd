"""`pdserve serve`: the supervised Ray driver of the cluster its flags
(pdserve/serve_args.py) configure."""

from __future__ import annotations

import os
import signal
import sys
import time

from .serve_args import cluster_config, serve_flags

_SERVE_CHILD_ENV = "PDSERVE_SERVE_CHILD"
STOP_POLL_S = 0.2       # how often the serving process looks for a stop signal


def _supervise(argv: list[str]) -> int:
    """Run `pdserve serve` (the Ray driver, with every Ray process it starts) in a child
    process in a session of its own, and forward SIGTERM/SIGINT/SIGHUP to it.

    A stop signal sent to this process's whole group (`kill -TERM -PGID`, Ctrl-C in a
    shell, an orchestrator stopping a process tree) then reaches this process only, and
    the child stops the router, the workers and Ray in order and exits 0; Ray's own
    processes, sharing the driver's group, would otherwise die mid-shutdown. The child
    gets SIGTERM if this process dies (PR_SET_PDEATHSIG), so no cluster outlives it.

    Returns the child's exit status (128 + N if it died by signal N).
    """
    import subprocess

    def die_with_parent() -> None:
        if sys.platform.startswith("linux"):
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    child = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv],
                             env=dict(os.environ, **{_SERVE_CHILD_ENV: "1"}),
                             start_new_session=True, preexec_fn=die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: child.send_signal(signum))
    rc = child.wait()              # resumed after each forwarding handler (PEP 475)
    return 128 - rc if rc < 0 else rc


def _serve(args) -> int:
    if os.environ.get(_SERVE_CHILD_ENV) != "1":
        return _supervise(args.argv)
    from .cluster import Cluster, ClusterStartError
    try:
        cfg = cluster_config(args)
    except ValueError as e:   # a setting out of range: the message names it
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    # The handler takes no lock: it runs in the main thread between two bytecodes, maybe
    # inside the lock of what that thread waits on (a threading.Event's set() from a
    # handler that interrupted the same Event's wait() hangs the process for good).
    signalled: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: signalled.append(signum))
    cluster = Cluster(cfg)
    try:
        try:
            port = cluster.start()
        except ClusterStartError as e:
            print(f"pdserve: failed to start: {e}", file=sys.stderr)
            return 1
        from .router.security import is_loopback
        rc = cfg.router    # says whether a key is required, never the key
        security = ", ".join(
            ["mutual TLS" if rc.tls_client_ca_file else "TLS" if rc.tls_cert_file
             else "plaintext"] + (["api key required"] if rc.api_key else [])
            + (["admin key required"] if rc.admin_api_key
               else [] if is_loopback(rc.host) else ["Drain and Scale refused: no admin key"]))
        http = ("" if cluster.http_port is None else
                f", OpenAI HTTP on http{'s' if rc.tls_cert_file else ''}://{args.host}:"
                f"{cluster.http_port}/v1")
        print(f"pdserve ready: gRPC on {args.host}:{port}{http} ({args.prefill_workers} "
              f"prefill, {args.decode_workers} decode, {cfg.prefill.transport} KV transport, "
              f"{security})", flush=True)
        while not signalled:
            time.sleep(STOP_POLL_S)      # seen within this long of the signal
        print("pdserve: shutting down", flush=True)
    finally:
        cluster.stop()
    return 0


def add_serve_parser(sub) -> None:
    """`pdserve serve` and its flags on `sub` (the `pdserve` subcommands' argparse
    subparsers)."""
    s = sub.add_parser("serve", help="start a cluster and serve gRPC (and HTTP with "
                                     "--http-port) until SIGINT/SIGTERM")
    serve_flags(s)
    s.set_defaults(fn=_serve)
