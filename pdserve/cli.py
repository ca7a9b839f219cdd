"""`pdserve` command line: every subcommand's parser, and generate (serve: serve.py;
status, drain and scale: cli_admin.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from .cli_admin import add_admin_parsers, add_client_security_args, make_client
from .serve import add_serve_parser


def _generate(args) -> int:
    import grpc

    from .client import make_request

    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    req = make_request(prompt, max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        req.sampling.seed = args.seed
    client = make_client(args, "generate")
    if client is None:
        return 2
    with client:
        try:
            for msg in client.stream(req):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    print(f"\n[finish_reason={msg.finish_reason} prompt_tokens="
                          f"{msg.usage.prompt_tokens} completion_tokens="
                          f"{msg.usage.completion_tokens}]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`pdserve`'s parser with every subcommand (docs/gen_config.py renders it into
    docs/configuration.md)."""
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    add_serve_parser(sub)

    g = sub.add_parser("generate", help="stream a completion to stdout")
    g.add_argument("prompt")
    g.add_argument("--server", default="127.0.0.1:50051")
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    add_client_security_args(g)
    g.set_defaults(fn=_generate)

    add_admin_parsers(sub)

    from .bench.commands import add_bench_parser
    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING"))
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
