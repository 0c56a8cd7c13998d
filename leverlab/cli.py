"""`leverlab <command>`: each command lives in its own module, imported only when it runs.

A command module defines `add_arguments(parser)` and `run(args) -> int` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("leverlab.cmd_generate", "generate text from prompts on the command line"),
    "serve": ("leverlab.server.cli", "serve a model through the OpenAI-compatible HTTP API"),
    "bench": ("leverlab.bench.cli", "measure an OpenAI-compatible server (latency buckets, concurrency sweep)"),
    "quantize": ("leverlab.models.quantize", "write a quantized checkpoint folder (int8, int4, awq)"),
    "train-default": ("leverlab.train.cli", "train the bundled default model family from the stdlib's source"),
    "train-eagle": ("leverlab.train.train_eagle", "train an EAGLE speculative head for a target model folder"),
    "study": ("leverlab.study.cli", "run the one-lever-at-a-time study"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="leverlab", description="LLM inference levers, built in and measured.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen command's module is imported: `leverlab bench` must not pay for torch.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
