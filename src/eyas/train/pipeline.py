"""The training pipeline, whole or a stage at a time: synth -> regen -> vocab -> capture -> fit -> export -> eval.

Usage: Pipeline(load_recipe("recipes/smollm2-135m-eagle3.toml")).run(["all"], argv=sys.argv)

Every stage reads what the previous ones left in the output directory and writes its own files there
(data/*.jsonl, vocab.safetensors, features/, checkpoints/, metrics.jsonl, draft/), so any stage can be
run again alone. `run.json` in the output directory records the recipe, the data hash, each stage's
time and results, and where the exported draft is.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from eyas.errors import EyasError
from eyas.train import sample_cache
from eyas.train.distributed import init_distributed, log
from eyas.train.prompts import as_prompt, build_pool, data_dir, read_conversations

STAGES = ("synth", "regen", "vocab", "capture", "fit", "export", "eval")
# What each stage does, said as it starts (with --no-progress there is no bar to say it).
STAGE_WORK = {"synth": "the target writes the training questions", "regen": "the target writes the replies",
              "vocab": "counting tokens for the draft's vocabulary", "capture": "storing the target's features",
              "fit": "training the draft", "export": "writing the draft checkpoint",
              "eval": "measuring the draft's acceptance length"}
SAMPLES_FILE = "samples.safetensors"  # the tokenized conversations (sample_cache.py)


class Pipeline:
    def __init__(self, recipe, progress: bool = True, profile: bool = False):
        self.recipe = recipe
        device = recipe.resolved_device()
        self.dist = init_distributed(device)
        self.device = self.dist.device(device)
        self.dtype = recipe.target_dtype()
        self.progress = progress and self.dist.main
        self.out = recipe.out
        self.profile = profile  # synth and regen time their engine's phases (eyas train --profile)
        self._tokenizer = self._samples = self._config = None

    # -- shared pieces ----------------------------------------------------------------------------
    @property
    def target_path(self) -> Path:
        from eyas.models.demo import resolve_model_path

        return resolve_model_path(self.recipe.target)

    @property
    def target_config(self):
        if self._config is None:
            from eyas.config import ModelConfig

            self._config = ModelConfig.from_dir(self.target_path)
        return self._config

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from eyas.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.target_path)
        return self._tokenizer

    def engine(self, max_batch: int, max_len: int):
        """The generation engine of synth and regen; with --profile it times prefill and decode steps
        (printed after the stage), to tell where a slow generation stage spends its time. Freed slots are
        refilled an eighth of the batch at a time, so prefills are few and full."""
        from eyas.engine.engine import Engine
        from eyas.engine.profile import Profiler

        profiler = Profiler(self.device) if self.profile else None
        return Engine(self.recipe.target, dtype=self.dtype, device=self.device, max_batch=max_batch, max_len=max_len,
                      profiler=profiler, admit_batch=max(1, max_batch // 8))

    def _report_profile(self, engine, stage: str):
        if engine.profiler is not None:
            log(self.dist, f"eyas train: [{stage}] engine phases (--profile)\n{engine.profiler.table()}")

    def samples(self):
        """Tokenized regenerated conversations and a hash of exactly what training will see."""
        if self._samples is None:
            from eyas.train.conversation import encode_all
            from eyas.train.regen import read_regenerated

            convs = read_regenerated(self.recipe)
            if not convs:
                raise EyasError(f"no regenerated conversations in {data_dir(self.recipe)}; run `eyas train regen`")
            key = sample_cache.cache_key(convs, self.tokenizer, self.recipe.data.max_len)
            cached = sample_cache.load(self.out / SAMPLES_FILE, key)
            if cached is not None:
                samples, stats = cached
            else:
                samples, stats = encode_all(self.tokenizer, convs, self.recipe.data.max_len, self.progress)
                if self.dist.main:
                    try:
                        sample_cache.save(self.out / SAMPLES_FILE, key, samples, stats)
                    except EyasError as e:  # the cache only saves time: training goes on without it
                        log(self.dist, f"eyas train: warning: tokenized samples not cached: {e}")
            h = hashlib.sha256()
            for s in samples:
                h.update(s.input_ids.numpy().tobytes())
                h.update(s.loss_mask.numpy().tobytes())
            self._samples = (samples, h.hexdigest()[:16], stats)
        return self._samples

    def draft_config(self):
        from eyas.train.draft_init import draft_config_for

        return draft_config_for(self.target_config, self.recipe.draft)

    def eval_prompts(self) -> list[list[int]]:
        from eyas.models.tokenizer import encode_messages

        cfg = self.recipe.eval
        path = Path(cfg.prompts) if cfg.prompts else data_dir(self.recipe) / "heldout.jsonl"
        if not path.is_file() or not path.stat().st_size:
            raise EyasError(f"no evaluation prompts at {path}: set [data] heldout > 0 or [eval] prompts")
        convs = [p for p in (as_prompt(c, 1) for c in read_conversations(path)) if p][: cfg.num_prompts]
        return [encode_messages(self.tokenizer, c.messages) for c in convs]

    def evaluator(self):
        from eyas.train.conversation import end_of_turn_ids
        from eyas.train.evaluate import AcceptanceEval

        cfg = self.recipe.eval
        return AcceptanceEval(self.recipe.target, self.eval_prompts(), self.device, self.dtype, cfg.max_tokens,
                              cfg.spec_steps, cfg.batch, end_of_turn_ids(self.tokenizer, self.target_config.eos_token_ids),
                              cfg.ignore_eos)

    # -- stages -----------------------------------------------------------------------------------
    def synth(self) -> dict:
        from eyas.train.synth import question_starts, synthesize

        cfg = self.recipe.synth
        if cfg.num == 0:
            return {"skipped": "[synth] num = 0"}
        longest = max(len(ids) for ids, _ in question_starts(self.tokenizer, cfg))
        engine = self.engine(cfg.batch, longest + cfg.max_tokens + 8)
        out = synthesize(self.recipe, engine, self.tokenizer, self.dist.rank, self.dist.world, self.progress)
        self._report_profile(engine, "synth")
        self.dist.barrier()
        return out

    def regen(self) -> dict:
        from eyas.train.regen import regenerate

        pool = build_pool(self.recipe, write=self.dist.main)
        cfg = self.recipe.regen
        if cfg.url:  # a server elsewhere holds the target: it writes the replies, eyas only tokenizes
            from eyas.train.regen_endpoint import regenerate_via_endpoint

            out = regenerate_via_endpoint(self.recipe, self.tokenizer, self.target_config.eos_token_ids, pool.train,
                                          cfg.url, self.dist.rank, self.dist.world, self.progress, cfg.batch)
            self.dist.barrier()
            return {**pool.stats, **out}
        engine = self.engine(self.recipe.regen.batch, self.recipe.data.max_len)
        out = regenerate(self.recipe, engine, self.tokenizer, pool.train, self.dist.rank, self.dist.world,
                         self.progress)
        self._report_profile(engine, "regen")
        self.dist.barrier()
        return {**pool.stats, **out}

    def vocab(self) -> dict:
        from eyas.train.vocab import VocabMapping, count_tokens, coverage_by_size, mapping_from_counts, save_mapping

        samples, data_hash, stats = self.samples()
        counts = count_tokens(samples, self.target_config.vocab_size)
        if self.recipe.draft.init_from:
            from eyas.models.draft_io import load_draft

            d = load_draft(self.recipe.draft.init_from, self.target_config)
            mapping = VocabMapping(d.d2t.clone(), d.t2d.clone(), float("nan"))
        else:
            mapping = mapping_from_counts(counts, self.recipe.draft.draft_vocab_size)
        if self.dist.main:
            save_mapping(mapping, self.out / "vocab.safetensors")
        by_size = {str(k): round(v, 5) for k, v in coverage_by_size(counts).items()}
        log(self.dist, "eyas train: coverage by draft vocabulary size: "
            + ", ".join(f"{k} {v:.2%}" for k, v in by_size.items()))
        self.dist.barrier()
        return {**stats, "data_hash": data_hash, "draft_vocab_size": int(mapping.d2t.numel()),
                "coverage": round(mapping.coverage, 5), "coverage_by_size": by_size}

    def capture(self) -> dict:
        from eyas.train.capture import capture_features

        samples, data_hash, _ = self.samples()
        layers = self.draft_config().capture_layers(self.target_config.num_layers)
        target = self.capture_target(layers)
        try:
            return capture_features(self.out / "features", target, samples, data_hash, self.recipe.train, self.dist,
                                    self.progress, dtype=self.dtype, concurrency=self.recipe.capture.concurrency)
        finally:
            if hasattr(target, "close"):
                target.close()

    def capture_target(self, layers):
        """eyas's model with its capture layers set, or a client of the serving engine that holds the target."""
        cfg = self.recipe.capture
        if cfg.source == "eyas":
            from eyas.models.loader import load_model

            target = load_model(self.recipe.target, self.dtype, self.device, max_positions=self.recipe.data.max_len + 8)
            target.capture_layers = layers
            return target
        from eyas.models.loader import parse_dtype
        from eyas.train.capture_engines import SglangCapture, VllmCapture
        from eyas.train.target import TargetHeads

        heads = TargetHeads.load(self.target_path, parse_dtype(self.dtype), "cpu")  # final norm + the greedy check
        if cfg.source == "vllm":
            return VllmCapture(cfg.url, layers, heads, model=cfg.model or None)
        return SglangCapture(cfg.url, cfg.hidden_url, layers, heads)

    def fit(self) -> dict:
        from eyas.train.draft_init import init_head_from_target, new_draft
        from eyas.train.evaluate import plot_metrics
        from eyas.train.trainer import Trainer
        from eyas.train.vocab import load_mapping

        r, cfg = self.recipe, self.recipe.train
        samples, data_hash, _ = self.samples()
        mapping = load_mapping(self.out / "vocab.safetensors")
        draft = new_draft(self.target_config, r.draft, mapping, cfg.seed)
        args = (cfg.batch_tokens, cfg.seed, mapping.used, mapping.t2d, self.device, self.dist.rank, self.dist.world)
        weights = dict(repeat_weight=cfg.repeat_weight, repeat_ngram=cfg.repeat_ngram,
                       teacher_temperature=cfg.teacher_temperature)
        if cfg.mode == "online":
            from eyas.models.loader import load_model
            from eyas.train.sources import OnlineSource

            target = load_model(r.target, self.dtype, self.device, max_positions=r.data.max_len + 8)
            target.capture_layers = draft.config.capture_layers(self.target_config.num_layers)
            source = OnlineSource(target, samples, *args, **weights)
            head, norm = target.lm_head.weight, target.model.norm.weight
        else:
            from eyas.models.loader import parse_dtype
            from eyas.train.shards import FeatureStore
            from eyas.train.sources import OfflineSource
            from eyas.train.target import TargetHeads

            store = FeatureStore(self.out / "features")
            if store.info.get("data_hash") != data_hash:
                raise EyasError(f"the features in {self.out / 'features'} were captured from other data; "
                                "run `eyas train capture` again")
            heads = TargetHeads.load(r.target, parse_dtype(self.dtype), self.device)
            source = OfflineSource(heads, store, *args, **weights)
            head, norm = heads.lm_head_weight, heads.norm_weight
        if r.draft.head_init == "target" and not r.draft.init_from:
            init_head_from_target(draft, head, norm)  # a resumed run then loads its checkpoint over this
        evaluator = self.evaluator() if r.eval.every and self.dist.main else None
        tr = {k: v for k, v in r.to_dict()["train"].items() if k not in ("log_every", "checkpoint_every",
                                                                          "keep_checkpoints")}
        digest = hashlib.sha256(json.dumps([tr, r.to_dict()["draft"], r.target, self.dtype, data_hash],
                                           sort_keys=True).encode()).hexdigest()[:16]
        trainer = Trainer(cfg, draft, source, self.out, self.device, evaluator, r.eval.every, digest, self.dist,
                          self.progress)
        summary = trainer.fit()
        if self.dist.main:
            plot_metrics(trainer.metrics_path, self.out / "metrics.png")
        return summary

    def export(self) -> dict:
        from eyas.models.draft_io import save_draft
        from eyas.train.checkpoint import latest_checkpoint, load_draft_checkpoint, load_state

        path = latest_checkpoint(self.out / "checkpoints")
        if path is None:
            raise EyasError(f"no checkpoint in {self.out / 'checkpoints'}; run `eyas train fit` first")
        step = load_state(path)["step"]
        if step < self.recipe.train.steps:
            log(self.dist, f"eyas train: exporting step {step} of {self.recipe.train.steps} (training unfinished)")
        out = {"step": step}
        if self.dist.main:
            draft = load_draft_checkpoint(path)
            for layout in self.recipe.export.layouts:
                # The speculators layout records a proposal length (the steps eyas's evaluation drafts) and ships
                # the target's embedding, as speculators' own save_pretrained does and its loader needs.
                embedding = None
                if layout == "speculators":
                    import torch

                    from eyas.train.target import TargetHeads

                    embedding = TargetHeads.load(self.target_path, torch.float32, "cpu").embed_weight
                out[layout] = str(save_draft(draft, self.export_dir(layout), layout, verifier=str(self.target_path),
                                             speculative_tokens=self.recipe.eval.spec_steps, embedding=embedding))
        self.dist.barrier()
        return out

    def export_dir(self, layout: str) -> Path:
        return self.out / ("draft" if layout == "sglang" else f"draft-{layout}")

    def eval(self) -> dict:
        from eyas.models.draft_io import load_draft

        layout = self.recipe.export.layouts[0]
        out = {}
        if self.dist.main:
            draft = load_draft(self.export_dir(layout), self.target_config)  # the exported files, as served
            out = {"draft": str(self.export_dir(layout)), **self.evaluator()(draft)}
        self.dist.barrier()
        return out

    # -- the front door ---------------------------------------------------------------------------
    def stages_for(self, names: list[str]) -> list[str]:
        if names != ["all"]:
            return names
        skip = {"synth"} if self.recipe.synth.num == 0 else set()
        if self.recipe.train.mode == "online":
            skip.add("capture")
        return [s for s in STAGES if s not in skip]

    def run(self, names: list[str], argv: list[str] | None = None) -> dict:
        from eyas.train.record import RunRecorder

        stages = self.stages_for(names)
        recorder = RunRecorder(self.out, self.recipe, argv or [], enabled=self.dist.main)
        results = {}
        try:
            log(self.dist, f"eyas train: stages {', '.join(stages)} on {self.device} (target in {self.dtype}) into "
                           f"{self.out}")
            for name in stages:
                log(self.dist, f"eyas train: [{name}] {STAGE_WORK[name]} ...")
                t0 = time.perf_counter()
                res = getattr(self, name)()
                res["seconds"] = round(time.perf_counter() - t0, 1)
                results[name] = res
                recorder.stage(name, res, self._samples[1] if self._samples else None)
                log(self.dist, f"eyas train: [{name}] {res['seconds']:.1f} s  {_brief(res)}")
        except BaseException as e:
            recorder.finish("interrupted" if isinstance(e, KeyboardInterrupt) else "failed", results)
            raise
        recorder.finish("ok", results)
        self.dist.close()
        return results


def _brief(res: dict) -> str:
    keys = ("prompts", "conversations", "sampled_replies", "samples", "coverage", "samples_captured", "steps",
            "final_loss", "accept_length", "skipped")
    return "  ".join(f"{k}={res[k]:.4g}" if isinstance(res[k], float) else f"{k}={res[k]}" for k in keys if k in res)
