"""What a draft directory is and how each engine will run it: `eyas draft check` and the check `eyas launch` runs.

Facts per engine (read in their sources): SGLang's LlamaForCausalLMEagle3 stacks q/k/v and gate/up, turns d2t into
hot_token_id, skips t2d and silently skips any weight it has no parameter for; it reads none of the speculators
flags, and explicit capture ids mean "output of layer id" (it captures the input of id + 1). vLLM (method eagle3)
renames midlayer.* to layers.0.*, stacks the same projections, renames d2t to draft_id_to_target_id, skips t2d, uses
a shipped embed_tokens.weight, reads the speculators flags (its speculators config reader defaults a missing
norm_before_residual to True) and takes explicit ids, from either layout, as layer inputs. speculators reads its own
layout only (its config class defaults norm_before_residual to False) and needs a verifier to load. The EAGLE code
reads pytorch_model.bin before model.safetensors, non-strictly, copies the target's embedding only without
target_hidden_size, derives head_dim, and always captures the inputs of layers 2, L//2 and L-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eyas.config import ModelConfig, read_config_json
from eyas.draft_config import DraftConfig
from eyas.errors import EyasError

ENGINES = ("eyas", "sglang", "vllm", "speculators", "eagle")
FLAG_MEANINGS = {
    "norm_before_residual": "the first residual is the normed hidden state (vanilla EAGLE-3: the raw one)",
    "norm_output": "the next draft step reads the normed output (vanilla: the pre-norm one)",
    "norm_before_fc": "one RMSNorm over the fused 3-layer features before fc (key input_norm.weight)",
    "fc_norm": "one RMSNorm per captured feature before fc (keys fc_norm.{0,1,2}.weight)",
}


@dataclass
class Problem:
    engines: tuple[str, ...]  # the engines it affects
    text: str


@dataclass
class DraftCheck:
    path: Path
    layout: str
    config: DraftConfig | None = None
    lines: list[str] = field(default_factory=list)      # what the draft is, flag by flag, engine by engine
    problems: list[Problem] = field(default_factory=list)

    def errors(self, engine: str | None = None) -> list[str]:
        return [p.text for p in self.problems if engine is None or engine in p.engines]

    def render(self) -> str:
        out = [f"draft {self.path}: {self.layout} layout", *self.lines]
        out += [f"PROBLEM ({', '.join(p.engines)}): {p.text}" for p in self.problems] or ["no problems found"]
        return "\n".join(out)


def weight_dtypes(path: Path) -> dict[str, str]:
    """Weight name -> dtype name, as the file stores it (safetensors headers only; a .bin is read whole)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    out = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                out.update({k: str(fh.get_slice(k).get_dtype()) for k in fh.keys()})
        if not files and (path / "pytorch_model.bin").exists():
            import torch

            sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
            out = {k: str(v.dtype).removeprefix("torch.") for k, v in sd.items()}
    except Exception as e:
        raise EyasError(f"cannot read draft weights in {path}: {str(e).splitlines()[0]}") from None
    if not out:
        raise EyasError(f"no draft weights (model.safetensors or pytorch_model.bin) in {path}")
    return out


_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "float32": "float32"}


def check_draft(path: str | Path, target: ModelConfig | None = None, sglang_algorithm: str | None = None,
                vllm_method: str | None = None) -> DraftCheck:
    """Read the draft at `path` (and, given its target's config, check the fit) without building it."""
    path = Path(path)
    if not path.exists():
        raise EyasError(f"draft directory not found: {path}")
    hf = read_config_json(path)
    speculators = "speculators_config" in hf or "transformer_layer_config" in hf
    report = DraftCheck(path, "speculators" if speculators else "?")
    try:
        cfg = DraftConfig.from_hf(hf)
    except EyasError as e:
        report.problems.append(Problem(("eyas",), f"eyas refuses this config: {e}"))
        return report
    report.config, report.layout = cfg, cfg.layout
    weights = weight_dtypes(path)
    _describe_flags(report, hf, cfg)
    _describe_engines(report, hf, cfg, weights)
    _check_vocab_and_dtype(report, hf, cfg, weights)
    _check_capture(report, hf, cfg, target)
    if target is not None:
        _check_target(report, cfg, target)
    if sglang_algorithm is not None and sglang_algorithm.upper() != "EAGLE3":
        report.problems.append(Problem(("sglang",), f"SGLang --speculative-algorithm {sglang_algorithm} with an EAGLE-3 "
                                       "draft: it runs the EAGLE-2 path, which cannot use the fused features, and accepts "
                                       "nothing (acceptance exactly 1.0); use EAGLE3"))
    if vllm_method is not None and vllm_method.lower() != "eagle3":
        report.problems.append(Problem(("vllm",), f"vLLM speculative method {vllm_method!r} with an EAGLE-3 draft: it "
                                       "builds the EAGLE-1 model class; use \"method\": \"eagle3\""))
    return report


def _describe_flags(report: DraftCheck, hf: dict, cfg: DraftConfig) -> None:
    layer = hf.get("transformer_layer_config") or {}
    for flag, meaning in FLAG_MEANINGS.items():
        given = flag in hf or flag in layer or flag in (hf.get("eagle_config") or {})
        source = "set" if given else "absent, so " + (
            "speculators' default" if cfg.layout == "speculators" else "the default of every engine")
        report.lines.append(f"  {flag} = {str(getattr(cfg, flag)).lower()} ({source}): {meaning}")
    report.lines.append(f"  target_hidden_size = {cfg.target_hidden_size}"
                        + ("" if "target_hidden_size" in hf else " (absent: hidden_size)"))
    report.lines.append(f"  draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size}; head_dim {cfg.head_dim}; "
                        f"rope theta {cfg.rope_theta:g}, scaling {cfg.rope_scaling or 'none'}; rms_norm_eps "
                        f"{cfg.rms_norm_eps:g}" + (f"; speculative_tokens {cfg.speculative_tokens}"
                                                   if cfg.speculative_tokens else ""))
    if cfg.layout == "speculators" and "norm_before_residual" not in hf:
        report.problems.append(Problem(("vllm",), "norm_before_residual is absent: speculators (and eyas) run it as "
                                       "false, vLLM's speculators reader as true; write it explicitly"))
    used = [f for f in FLAG_MEANINGS if getattr(cfg, f)]
    if used and cfg.layout != "speculators":
        report.problems.append(Problem(("sglang", "eagle"), f"{', '.join(used)} set in the {cfg.layout} layout: SGLang "
                                       "and the EAGLE code ignore it (vLLM and eyas honour it)"))


def _describe_engines(report: DraftCheck, hf: dict, cfg: DraftConfig, weights: dict[str, str]) -> None:
    arch = (hf.get("architectures") or ["?"])[0]
    embed = "embed_tokens.weight" in weights
    add = report.lines.append
    add("engines:")
    add("  eyas: loads every layout strictly (a missing or unknown weight is refused); uses the target's embedding")
    if cfg.layout == "speculators":
        add("  vLLM: --speculative-config '{\"method\": \"eagle3\", \"model\": DIR}' reads the speculators config "
            "(Eagle3DraftModel -> Eagle3LlamaForCausalLM); stacks q/k/v and gate/up, d2t -> draft_id_to_target_id, "
            "skips t2d" + ("; uses the shipped embed_tokens.weight" if embed else "; shares the target's embedding"))
        add("  speculators: Eagle3DraftModel.from_pretrained(DIR)")
        add("  SGLang: cannot load it (architecture Eagle3DraftModel, layers.0.* keys): eyas draft convert DIR OUT "
            "--layout sglang")
        add("  EAGLE code: cannot load it (layers.0.* keys would be skipped by its non-strict load): convert "
            "--layout eagle")
        if not embed:
            report.problems.append(Problem(("speculators",), "no embed_tokens.weight: speculators 0.9 then keeps an "
                                           "uninitialised embedding (its NaN check misses it); convert with --target"))
        verifier = ((hf.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if not verifier:
            report.problems.append(Problem(("speculators",), "speculators_config.verifier.name_or_path is empty: "
                                           "Eagle3DraftModel.from_pretrained needs the target's path there"))
        return
    sglang = "loads it as is" if arch == "LlamaForCausalLMEagle3" or cfg.mla else \
        f"needs architecture LlamaForCausalLMEagle3 (this one says {arch}): convert --layout sglang"
    add(f"  SGLang: --speculative-algorithm EAGLE3 (EAGLE, its EAGLE-2 path, accepts nothing: acceptance exactly "
        f"1.0) --speculative-draft-model-path DIR; {sglang}; stacks q/k/v into "
        "qkv_proj and gate/up into gate_up_proj, d2t -> hot_token_id, skips t2d and any unknown weight; takes the "
        "target's embedding")
    add("  vLLM: --speculative-config '{\"method\": \"eagle3\", \"model\": DIR}' (architecture -> Eagle3LlamaForCausalLM); "
        "renames midlayer.* -> layers.0.*, stacks q/k/v and gate/up, d2t -> draft_id_to_target_id, skips t2d")
    bin_first = "pytorch_model.bin" if (report.path / "pytorch_model.bin").exists() else "model.safetensors"
    add(f"  EAGLE code: EaModel.from_pretrained(ea_model_path=DIR) reads {bin_first} (pytorch_model.bin first), "
        "non-strictly; " + ("copies the target's embedding" if "target_hidden_size" not in hf else
                            "skips the target's embedding (target_hidden_size is set)"))
    if "target_hidden_size" in hf and not embed:
        report.problems.append(Problem(("eagle",), "target_hidden_size is set and no embed_tokens.weight is shipped: "
                                       "the EAGLE code then runs the draft with a random embedding; drop the key "
                                       "(eyas draft convert --layout eagle)"))
    if not cfg.mla and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        report.problems.append(Problem(("eagle",), f"head_dim {cfg.head_dim} is not hidden_size // heads: the EAGLE "
                                       "code ignores head_dim"))


def _check_vocab_and_dtype(report: DraftCheck, hf: dict, cfg: DraftConfig, weights: dict[str, str]) -> None:
    if cfg.draft_vocab_size < cfg.vocab_size and "d2t" not in weights:
        report.problems.append(Problem(ENGINES, f"no d2t vocabulary mapping for a {cfg.draft_vocab_size}-token draft "
                                       f"vocabulary: SGLang and vLLM would read draft ids as target ids"))
    declared = hf.get("torch_dtype") or (hf.get("transformer_layer_config") or {}).get("torch_dtype")
    stored = {_DTYPES.get(v, v) for k, v in weights.items() if k.endswith("weight")}
    if declared and stored and stored != {declared}:
        report.problems.append(Problem(("vllm", "sglang"), f"config says torch_dtype {declared}, the weights are "
                                       f"{', '.join(sorted(stored))}"))


def engine_capture_layers(hf: dict, cfg: DraftConfig, layers: int) -> dict[str, tuple[int, ...]]:
    """The target layers whose *input* each engine feeds this draft, as each engine reads the config."""
    default = (2, layers // 2, layers - 3)
    if cfg.layout == "speculators":
        ids = hf.get("eagle_aux_hidden_state_layer_ids")
        given = tuple(ids) if ids else default
        return {"eyas": given, "vllm": given, "speculators": given}
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return {e: default for e in ("eyas", "sglang", "vllm", "eagle")}
    return {"eyas": tuple(i + 1 for i in ids), "sglang": tuple(i + 1 for i in ids), "vllm": tuple(ids),
            "eagle": default}


def _check_capture(report: DraftCheck, hf: dict, cfg: DraftConfig, target: ModelConfig | None) -> None:
    layers = target.num_layers if target is not None else None
    if layers is None:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
            hf.get("eagle_aux_hidden_state_layer_ids")
        report.lines.append("capture: " + (f"explicit ids {ids}" if ids else "the default inputs of layers 2, L//2, L-3")
                            + " (give --target to resolve them per engine)")
        return
    per_engine = engine_capture_layers(hf, cfg, layers)
    report.lines.append(f"capture (inputs of target layers, target has {layers}):")
    for engine, got in per_engine.items():
        report.lines.append(f"  {engine}: {list(got)}")
        missing = [i for i in got if not 0 <= i < layers]
        if missing:
            report.problems.append(Problem((engine,), f"{engine} would capture the input of layer {missing[0]}, which a "
                                           f"target of {layers} layers does not have: is the draft for another model?"))
    trained = per_engine["eyas"]
    for engine, got in per_engine.items():
        if got != trained and all(0 <= i < layers for i in got):
            report.problems.append(Problem((engine,), f"{engine} feeds layers {list(got)}, the draft reads "
                                           f"{list(trained)}: it would run on the wrong features"))


def _check_target(report: DraftCheck, cfg: DraftConfig, target: ModelConfig) -> None:
    if cfg.target_hidden_size != target.hidden_size:
        report.problems.append(Problem(ENGINES, f"the draft expects target hidden size {cfg.target_hidden_size}, the "
                                       f"target has {target.hidden_size}"))
    elif cfg.hidden_size != target.hidden_size:
        report.problems.append(Problem(ENGINES, f"draft hidden size {cfg.hidden_size} differs from the target's "
                                       f"{target.hidden_size}, whose embedding it reads"))
    if cfg.vocab_size != target.vocab_size:
        report.problems.append(Problem(ENGINES, f"draft vocabulary {cfg.vocab_size} differs from the target's "
                                       f"{target.vocab_size}"))
