"""The ``lorafleet`` command line. Imports stay inside the commands, so that ``--help``, the control
plane, ``up`` and the admin commands never load torch. Every failure is one line on stderr,
``lorafleet: ...``, and a non-zero exit status."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import NoReturn

from conventions import defaults
from conventions.flag_help import DefaultsShown


def _cmd_model_demo(args: argparse.Namespace) -> int:
    from data_plane.model.demo_model import ensure_demo_model

    print(ensure_demo_model(quiet=args.quiet))
    return 0


def _sampling(args: argparse.Namespace):
    from data_plane.engine.sequence import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))


def _sampling_proto(args: argparse.Namespace):
    """The request's SamplingParams as sent; the pod validates them (the remote path loads no torch)."""
    from lorafleet.v1 import generation_pb2 as g

    sampling = g.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, stop=list(args.stop or ()))
    if args.seed is not None:
        sampling.seed = args.seed
    return sampling


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.local:
        return asyncio.run(_generate_local(args))
    return _generate_remote(args)


async def _generate_local(args: argparse.Namespace) -> int:
    from data_plane.local import generate_local

    adapter = Path(args.adapter) if args.adapter else None
    if adapter is not None and not adapter.is_dir():
        raise SystemExit(f"lorafleet: with --local, --adapter takes a PEFT adapter directory; {adapter} is not one")
    async for out in generate_local(args.prompt, _sampling(args), Path(args.model) if args.model else None,
                                    adapter, chat=args.chat, device=args.device, dtype=args.dtype):
        print(out.text, end="", flush=True)
    print()
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc
    from lorafleet.v1 import generation_pb2 as g
    from lorafleet.v1 import generation_pb2_grpc

    request = g.GenerateRequest(adapter=args.adapter or "", sampling=_sampling_proto(args))
    if args.chat:
        request.messages.messages.append(g.ChatMessage(role="user", content=args.prompt))
    else:
        request.prompt = args.prompt
    key = args.api_key or os.environ.get("LORAFLEET_API_KEY", "")
    metadata = (("authorization", f"Bearer {key.strip()}"),) if key.strip() else None
    ca = args.tls_ca or os.environ.get("LORAFLEET_TLS_CA")
    if ca:
        try:
            root = Path(ca).read_bytes()
        except OSError as e:
            raise SystemExit(f"lorafleet: --tls-ca {ca}: cannot read it ({e.strerror})") from None
        channel_of = lambda: grpc.secure_channel(args.endpoint, grpc.ssl_channel_credentials(root))
    else:
        channel_of = lambda: grpc.insecure_channel(args.endpoint)
    with channel_of() as channel:
        streamed = False
        try:
            for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata):
                streamed = streamed or bool(response.text)
                print(response.text, end="", flush=True)
        finally:
            if streamed:
                print(flush=True)  # ends the streamed line, also before an error message
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from cli.up.config import config_from_args
    from cli.up.stack import run

    return run(config_from_args(args))


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line that points at --help; every flag's default shown in --help (subcommands'
    parsers are of this class too)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lorafleet", description="Serve many LoRA adapters on one base LLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, target in (("data-plane", "run a data-plane pod (see lorafleet data-plane --help)"),
                         ("control-plane", "run a control-plane replica (see lorafleet control-plane --help)"),
                         ("router", "route Generate to the pods holding each adapter (see lorafleet router --help)")):
        p = sub.add_parser(name, help=target, add_help=False)
        p.add_argument("argv", nargs=argparse.REMAINDER)

    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    demo = model_sub.add_parser("demo", help="print the demo model's directory, fetching and converting it first")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    demo.set_defaults(func=_cmd_model_demo)

    gen = sub.add_parser("generate", help="generate text for a prompt, streamed as it is produced")
    gen.add_argument("prompt", help="the user's message (rendered with the model's chat template unless --raw)")
    gen.add_argument("--adapter", help="adapter name (server) or PEFT directory (--local); default: base model")
    gen.add_argument("--endpoint", default=os.environ.get("LORAFLEET_ENDPOINT", defaults.ROUTER_ENDPOINT),
                     help="router or data-plane pod host:port (env LORAFLEET_ENDPOINT; "
                          "default: the router of lorafleet up, %(default)s)")
    gen.add_argument("--api-key", help="your tenant's key, sent as 'authorization: Bearer KEY' to a router with "
                                       "tenants; the environment variable LORAFLEET_API_KEY keeps it out of the "
                                       "process list (default: LORAFLEET_API_KEY, else none)")
    gen.add_argument("--tls-ca", help="PEM CA of a router whose doors serve TLS (--door-tls-cert): connect over TLS "
                                      "and verify it (default: LORAFLEET_TLS_CA, else plaintext)")
    gen.add_argument("--local", action="store_true", help="run the model in this process, no server")
    gen.add_argument("--model", help="model directory for --local (default: the demo model)")
    gen.add_argument("--device", default=defaults.DEVICE, choices=["cpu", "cuda"], help="device for --local")
    gen.add_argument("--dtype", default=defaults.DTYPE, choices=defaults.DTYPES,
                     help="precision for --local, as the pod's --dtype")
    gen.add_argument("--max-tokens", type=int, default=128, help="maximum tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    gen.add_argument("--seed", type=int, help="seed for reproducible sampling")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    form = gen.add_mutually_exclusive_group()
    form.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="send the prompt as a user message, rendered with the chat template")
    # --chat sets the default; --raw's own would be shown as "True", the opposite of what --raw does
    form.add_argument("--raw", dest="chat", action="store_false", default=argparse.SUPPRESS,
                      help="send the prompt as is, without the template")
    gen.set_defaults(func=_cmd_generate)

    from cli import admin_commands
    from cli.up import config as up_config

    admin_commands.add_parsers(sub)
    up = sub.add_parser("up", help="run Redis, a control plane, a CPU pod with the demo adapters and a router; "
                                   "Ctrl-C stops")
    up_config.add_arguments(up)
    up.set_defaults(func=_cmd_up)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "data-plane":
        from data_plane.server import main as data_plane_main

        return data_plane_main(argv[1:])
    if argv and argv[0] == "control-plane":
        from control_plane.server import main as control_plane_main

        return control_plane_main(argv[1:])
    if argv and argv[0] == "router":
        from router.server import main as router_main

        return router_main(argv[1:])
    args = build_parser().parse_args(argv)
    import grpc

    from cli.admin_client import AdminClientError
    from cli.up.child_process import ChildExited
    from cli.up.config import StackError
    from conventions.errors import LorafleetError

    try:
        return args.func(args)
    except grpc.RpcError as e:
        details = " ".join((e.details() or "").split())
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            details += " (is the server running? `lorafleet up` starts one)"
        elif e.code() == grpc.StatusCode.UNAUTHENTICATED and getattr(args, "func", None) is _cmd_generate:
            details += " (give your tenant's key: LORAFLEET_API_KEY=... or --api-key)"
        print(f"lorafleet: {e.code().name}: {details}", file=sys.stderr)
        return 1
    except (LorafleetError, AdminClientError, StackError, ChildExited, TimeoutError) as e:
        print(f"lorafleet: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
