"""The training recipe: one TOML file parsed into typed dataclasses, one clear error per mistake.

Usage: recipe = load_recipe("recipes/smollm2-135m-eagle3.toml", {"train.steps": 100, "device": "cpu"})

Sections mirror the pipeline's stages (synth -> regen -> vocab -> capture -> fit -> export/eval). Unknown
sections and keys are errors: a typo that silently falls back to a default would cost a whole GPU run.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from eyas.errors import EyasError

MODES = ("online", "offline")
LAYOUTS = ("sglang", "eagle", "speculators")
CAPTURE_SOURCES = ("eyas", "vllm", "sglang")


def _positive(section: str, **values):
    for name, v in values.items():
        if v <= 0:
            raise EyasError(f"[{section}] {name} must be positive, got {v}")


@dataclass
class DataConfig:
    sharegpt: list[str] = field(default_factory=list)  # ShareGPT / OpenAI-messages files (JSON or JSONL)
    max_prompts: int = 0          # cap on prompts taken from the files; 0 = all
    heldout: int = 32             # prompts kept out of training, used to measure acceptance
    max_len: int = 2048           # tokens per training sample; longer samples are truncated
    max_turns: int = 1            # user turns kept per conversation (each gets a regenerated reply)
    eval_sets: list[str] = field(default_factory=lambda: ["mt-bench", "humaneval", "sharegpt", "python-faq"])  # never trained on
    seed: int = 0

    def __post_init__(self):
        _positive("data", max_len=self.max_len, max_turns=self.max_turns)
        if self.max_prompts < 0 or self.heldout < 0:
            raise EyasError("[data] max_prompts and heldout must be >= 0")


@dataclass
class SynthConfig:
    """Magpie: the target writes user questions from the chat template's bare user-turn prefix."""

    num: int = 0                  # prompts to synthesize; 0 skips the stage
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    min_chars: int = 12
    max_chars: int = 2000
    min_ascii_ratio: float = 0.8  # share of letters that are ASCII: a cheap "is it English" filter
    batch: int = 128              # Engine max_batch
    max_rounds: int = 8           # generation rounds before giving up on reaching `num` (filters drop some)
    # System turns the question is written under, taken in turn ("" = the template's own); each steers the
    # target toward one kind of task. Only the question is kept: replies are regenerated without it.
    system_prompts: list[str] = field(default_factory=list)
    # Words the user's turn starts with, taken in turn ("" = none): the target writes the rest of the
    # question, so "Write", "Explain", "Solve" ... turn chat questions into the tasks users give.
    openers: list[str] = field(default_factory=list)
    plain_per_opener: int = 0     # questions with no opener written after each opened one, taken in turn

    def __post_init__(self):
        if self.num < 0:
            raise EyasError(f"[synth] num must be >= 0, got {self.num}")
        for key in ("system_prompts", "openers"):
            if not all(isinstance(x, str) for x in getattr(self, key)):
                raise EyasError(f"[synth] {key} must be a list of strings")
        _positive("synth", max_tokens=self.max_tokens, batch=self.batch, max_rounds=self.max_rounds)
        if self.plain_per_opener < 0:
            raise EyasError(f"[synth] plain_per_opener must be >= 0, got {self.plain_per_opener}")
        if not 0 <= self.min_ascii_ratio <= 1:
            raise EyasError(f"[synth] min_ascii_ratio must be in [0, 1], got {self.min_ascii_ratio}")


@dataclass
class RegenConfig:
    """The target rewrites every assistant turn, so the draft learns the target's own distribution."""

    temperature: float = 0.7
    top_p: float = 1.0            # also for the sampled copies
    max_tokens: int = 512
    batch: int = 128              # Engine max_batch
    max_samples: int = 0          # cap on training prompts regenerated (before copies); 0 = the whole prompt pool
    sampled_copies: int = 0       # extra conversations per prompt, every turn sampled: more varied contexts
    sampled_temperature: float = 0.8  # the copies' temperature
    url: str = ""                 # an OpenAI-compatible server of the target to write the replies (default: eyas's engine)

    def __post_init__(self):
        _positive("regen", max_tokens=self.max_tokens, batch=self.batch,
                  sampled_temperature=self.sampled_temperature)
        if self.temperature < 0:
            raise EyasError(f"[regen] temperature must be >= 0, got {self.temperature}")
        if self.sampled_copies < 0:
            raise EyasError(f"[regen] sampled_copies must be >= 0, got {self.sampled_copies}")


@dataclass
class DraftSection:
    """How the draft is shaped; sizes not given are the target's (the draft reads the target's embeddings)."""

    draft_vocab_size: int = 32000
    rope_theta: float = 10000.0   # EAGLE's default, not the target's theta
    intermediate_size: int = 0    # 0 = the target's
    aux_layer_ids: list[int] = field(default_factory=list)  # SGLang meaning; empty = EAGLE's default
    init_from: str = ""           # start from an existing draft checkpoint instead of random weights
    head_init: str = "random"     # or "target": LM-head rows and final norm copied from the target

    def __post_init__(self):
        _positive("draft", draft_vocab_size=self.draft_vocab_size, rope_theta=self.rope_theta)
        if self.head_init not in ("target", "random"):
            raise EyasError(f"[draft] head_init must be \"target\" or \"random\", got {self.head_init!r}")
        if self.aux_layer_ids and len(self.aux_layer_ids) != 3:
            raise EyasError(f"[draft] aux_layer_ids must list 3 layers (low, mid, high), got {self.aux_layer_ids}")


@dataclass
class TrainConfig:
    mode: str = "online"          # online: target runs per batch; offline: features captured to disk first
    steps: int = 1000             # optimizer steps
    batch_tokens: int = 16384     # padded tokens per batch per rank (length-bucketed)
    lr: float = 1e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.0     # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 7
    step_decay: float = 0.8       # loss weight of TTT step k is step_decay ** k
    repeat_weight: float = 1.0    # loss weight of tokens that repeat earlier text (train/repeats.py); 1 = EAGLE-3's
    repeat_ngram: int = 8         # a token repeats when the repeat_ngram tokens ending with it occurred before
    teacher_temperature: float = 1.0  # the teacher is softmax(z / T) over the draft vocabulary; 1 = EAGLE-3's
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    shard_tokens: int = 1 << 20   # offline: tokens per feature shard

    def __post_init__(self):
        if self.mode not in MODES:
            raise EyasError(f"[train] mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        _positive("train", steps=self.steps, batch_tokens=self.batch_tokens, lr=self.lr, ttt_steps=self.ttt_steps,
                  log_every=self.log_every, checkpoint_every=self.checkpoint_every,
                  keep_checkpoints=self.keep_checkpoints, shard_tokens=self.shard_tokens,
                  repeat_ngram=self.repeat_ngram)
        if self.repeat_weight < 0:
            raise EyasError(f"[train] repeat_weight must be >= 0, got {self.repeat_weight}")
        if not self.teacher_temperature > 0:
            raise EyasError(f"[train] teacher_temperature must be > 0, got {self.teacher_temperature}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise EyasError("[train] warmup_steps, grad_clip and weight_decay must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 < self.step_decay <= 1:
            raise EyasError("[train] min_lr_ratio must be in [0, 1] and step_decay in (0, 1]")


@dataclass
class CaptureConfig:
    """Where offline capture gets the target's hidden states: eyas's own engine, or a server that holds a target
    too large for it (train/capture_engines.py; docs/training-large-targets.md)."""

    source: str = "eyas"          # eyas | vllm | sglang
    url: str = ""                 # the engine's base URL (vllm, sglang: the EAGLE-3 server giving the features)
    hidden_url: str = ""          # sglang only: a server of the target alone, giving the final hidden states
    model: str = ""               # the served model name (vllm; default: the first of /v1/models)
    concurrency: int = 8          # prefill requests in flight

    def __post_init__(self):
        if self.source not in CAPTURE_SOURCES:
            raise EyasError(f"[capture] source must be one of {', '.join(CAPTURE_SOURCES)}, got '{self.source}'")
        if self.source != "eyas" and not self.url:
            raise EyasError(f"[capture] source = \"{self.source}\" needs url (the server's base URL)")
        _positive("capture", concurrency=self.concurrency)


@dataclass
class EvalConfig:
    every: int = 500              # measure acceptance every N steps (0 = only at the end)
    num_prompts: int = 32
    max_tokens: int = 128
    spec_steps: int = 3           # chain drafting, SpecConfig(spec_steps, 1)
    batch: int = 32
    prompts: str = ""             # a prompt file; default: the held-out prompts
    ignore_eos: bool = False      # generate max_tokens every time (fixed-length measurement)

    def __post_init__(self):
        if self.every < 0:
            raise EyasError(f"[eval] every must be >= 0, got {self.every}")
        _positive("eval", num_prompts=self.num_prompts, max_tokens=self.max_tokens, spec_steps=self.spec_steps,
                  batch=self.batch)


@dataclass
class ExportConfig:
    layouts: list[str] = field(default_factory=lambda: ["sglang"])

    def __post_init__(self):
        bad = [x for x in self.layouts if x not in LAYOUTS]
        if bad or not self.layouts:
            raise EyasError(f"[export] layouts must name some of {', '.join(LAYOUTS)}, got {self.layouts}")


@dataclass
class Recipe:
    target: str                   # checkpoint directory, or "demo"
    name: str = "eagle3"
    out_dir: str = "out/eagle3"
    device: str = "auto"          # auto = cuda when available
    dtype: str = "bf16"           # the target's dtype on GPU (CPU always runs fp32)
    data: DataConfig = field(default_factory=DataConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    draft: DraftSection = field(default_factory=DraftSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    @property
    def out(self) -> Path:
        return Path(self.out_dir)

    def resolved_device(self) -> str:
        import torch

        if self.device != "auto":
            try:
                kind = torch.device(self.device).type
            except (RuntimeError, TypeError):
                raise EyasError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from None
            if kind == "cuda" and not torch.cuda.is_available():
                raise EyasError(f"device {self.device!r} was asked for but no CUDA device is available")
            return self.device

        return "cuda" if torch.cuda.is_available() else "cpu"

    def target_dtype(self) -> str:
        # bf16 matmuls on CPU are slow and make CPU tests inexact; the GPU is where bf16 pays.
        return "fp32" if self.resolved_device() == "cpu" else self.dtype

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, values: dict, where: str):
    if not isinstance(values, dict):
        raise EyasError(f"{where} must be a table")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise EyasError(f"unknown key '{unknown[0]}' in {where}; known keys: {', '.join(known)}")
    kwargs = {}
    for name, value in values.items():
        f = known[name]
        sub = _SECTIONS.get(name) if cls is Recipe else None
        if sub is not None:
            kwargs[name] = _build(sub, value, f"[{name}]")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else ""
        kwargs[name] = _coerce(value, default, f"{where} {name}")
    return cls(**kwargs)


def _coerce(value, default, what: str):
    """Check a TOML value against the type of the field's default (ints are accepted for floats)."""
    want = type(default)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is list:
        if not isinstance(value, list):
            raise EyasError(f"{what} must be a list, got {value!r}")
        return value
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise EyasError(f"{what} must be {want.__name__}, got {value!r}")
    return value


_SECTIONS = {"data": DataConfig, "synth": SynthConfig, "regen": RegenConfig, "draft": DraftSection,
             "train": TrainConfig, "capture": CaptureConfig, "eval": EvalConfig, "export": ExportConfig}


def parse_recipe(data: dict, overrides: dict | None = None, where: str = "recipe") -> Recipe:
    """`overrides` maps dotted keys ("train.steps", "device") to values, applied before validation."""
    data = json.loads(json.dumps(data))  # a deep copy
    for key, value in (overrides or {}).items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    if "target" not in data:
        raise EyasError(f"{where} lacks 'target' (a checkpoint directory or \"demo\")")
    recipe = _build(Recipe, data, where)
    if recipe.capture.source != "eyas" and recipe.train.mode != "offline":
        raise EyasError(f"[capture] source = \"{recipe.capture.source}\" captures features to disk: set [train] "
                        "mode = \"offline\" (online training runs the target in eyas)")
    return recipe


def load_recipe(path: str | Path, overrides: dict | None = None) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise EyasError(f"recipe not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise EyasError(f"{path} is not valid TOML: {e}") from None
    return parse_recipe(data, overrides, where=str(path))
