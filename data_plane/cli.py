"""The ``lorafleet`` command line."""

from __future__ import annotations

import argparse
import sys

from data_plane.errors import LorafleetError


def _cmd_model_demo(args: argparse.Namespace) -> int:
    from data_plane.demo_model import ensure_demo_model

    print(ensure_demo_model(quiet=args.quiet))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if not args.local:
        print("lorafleet generate: only --local generation is available in this build", file=sys.stderr)
        return 2
    from data_plane.demo_model import ensure_demo_model
    from data_plane.local import greedy_stream
    from data_plane.model import load_model
    from data_plane.model.tokenizer import Tokenizer

    model_dir = args.model or ensure_demo_model()
    model = load_model(model_dir, args.dtype, args.device)
    tokenizer = Tokenizer(model_dir)
    prompt = args.prompt
    if not args.raw and tokenizer.has_chat_template:
        prompt = tokenizer.render_chat([{"role": "user", "content": prompt}])
    for text in greedy_stream(model, tokenizer, tokenizer.encode(prompt), args.max_tokens):
        print(text, end="", flush=True)
    print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description="Serve many LoRA adapters on one base LLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    demo = model_sub.add_parser("demo", help="print the demo model's directory, fetching and converting it first")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    demo.set_defaults(func=_cmd_model_demo)

    gen = sub.add_parser("generate", help="generate text for a prompt, streamed as it is produced")
    gen.add_argument("prompt", help="the user's message (rendered with the chat template unless --raw)")
    gen.add_argument("--local", action="store_true", help="run the model in this process, no server")
    gen.add_argument("--model", help="model directory for --local (default: the demo model)")
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device for --local")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                     help="weights dtype for --local")
    gen.add_argument("--max-tokens", type=int, default=128, help="maximum tokens to generate")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LorafleetError as e:
        print(f"lorafleet: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
