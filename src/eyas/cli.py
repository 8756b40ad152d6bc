"""The one entry point: `eyas <verb> ...`.

Usage: eyas generate --model demo --chat --prompt "Hello"

Each verb lives in its own module that defines `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their verb runs, so `eyas runs list` never imports torch.
"""

import argparse
import importlib
import sys

from eyas.errors import EyasError

# verb -> (module, one-line help)
VERBS = {
    "generate": ("eyas.commands.generate", "generate text with a target model (and optionally an EAGLE-3 draft)"),
    "models": ("eyas.commands.models", "locate or prepare models (`eyas models demo`)"),
    "convert-gguf": ("eyas.commands.convert_gguf", "convert a GGUF file into an HF checkpoint directory"),
    "serve": ("eyas.server.cli", "serve a model behind an OpenAI-compatible API"),
    "bench": ("eyas.commands.bench", "benchmark an OpenAI-compatible endpoint"),
    "runs": ("eyas.commands.runs", "query the run ledger: list, show, best, diff, replay, export, plot"),
    "launch": ("eyas.commands.launch", "start a server from a launch config, verify its environment, bench, record"),
    "tune": ("eyas.commands.tune", "sweep speculative settings (and env sets) against a baseline, record each"),
    "remote": ("eyas.commands.remote", "status, logs or stop of a launched server (local or over ssh)"),
    "train": ("eyas.train.cli", "train an EAGLE-3 draft"),
    "draft": ("eyas.commands.draft", "convert an EAGLE-3 draft between layouts, or check how each engine runs it"),
    "demo": ("eyas.commands.demo", "run the demo on the embedded default model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas", description="EAGLE-3 speculative decoding, end to end.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        p.set_defaults(_module=module)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # First pass finds the verb; the verb's module then adds its own arguments.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    module_name = getattr(known, "_module", None)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"eyas: error: the '{known.verb}' command is not available in this build", file=sys.stderr)
            return 2
        raise
    verb_parser = argparse.ArgumentParser(prog=f"eyas {known.verb}", description=VERBS[known.verb][1])
    module.add_arguments(verb_parser)
    args = verb_parser.parse_args(argv[1:])
    args.argv = ["eyas"] + argv
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that left early (`| head`) is seen here, not at exit
        return code
    except EyasError as e:
        print(f"eyas: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eyas: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`eyas ... | head`): nothing more to say, and nowhere to say it.
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
