"""`eyas models`: locate or prepare models.

Usage: eyas models demo        (prints the demo checkpoint directory, converting the GGUF on first use)
"""

import argparse


def _demo(args: argparse.Namespace) -> int:
    from eyas.models.demo import demo_model_path  # imports torch; keep `eyas models --help` light

    print(demo_model_path())
    return 0


# sub-verb -> (handler, one-line help); `list` and friends slot in here later.
ACTIONS = {
    "demo": (_demo, "print the demo target's checkpoint directory (SmolLM2-135M-Instruct), converting it once"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, (_, help_text) in ACTIONS.items():
        sub.add_parser(name, help=help_text, description=help_text)


def run(args: argparse.Namespace) -> int:
    handler, _ = ACTIONS[args.action]
    return handler(args)
