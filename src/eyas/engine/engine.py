"""Engine: the library API. Tokens in, tokens out, plain or speculative.

    engine = Engine("demo", dtype="fp32", device="cpu")
    [seq] = engine.generate([prompt_ids], SamplingParams(max_tokens=64))

Requests join between steps while cache slots are free and leave when finished: the same loop
serves `eyas generate` and the server's continuous batching.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from eyas.tensor_parallel import SINGLE, TPContext
from eyas.engine.ahead import DecodeAhead
from eyas.engine.graphs import graph_kv_len
from eyas.engine.persistent import PersistentTarget
from eyas.engine.plan_summary import plan_summary
from eyas.engine.profile import NULL_PROFILER
from eyas.engine.runner import ModelRunner
from eyas.engine.sequence import Sequence
from eyas.errors import EyasError
from eyas.layers.sampling import SamplingParams, adjusted_probs, sample_from, token_logprobs, uniform
from eyas.models.loader import load_model, parse_dtype, weight_bytes


class Engine:
    def __init__(self, model: str, dtype="bf16", device="cpu", draft: str | None = None, spec=None,
                 max_batch: int = 8, max_len: int = 2048, tp: TPContext = SINGLE, cuda_graphs: bool = True,
                 profiler=None, admit_batch: int = 1):
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.target = load_model(model, self.dtype, self.device, tp, max_positions=max_len)
        self.config = self.target.config
        self.max_len = max_len
        self.admit_batch = max(1, admit_batch)
        self.runner = ModelRunner(self.target, max_batch, max_len, self.device)
        self.eos_ids = set(self.config.eos_token_ids)
        self.profiler = profiler
        self.last_admitted = 0     # requests the last step prefilled (the server's metrics)
        self.last_decision = None  # (batch size, speculated) of the last step's speculative decision, if it made one
        self._ids = itertools.count()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.decoder = None
        self.ahead = DecodeAhead(self)  # plain greedy steps one ahead of the host (off: execution_plan's decode_ahead)
        if draft is not None:
            from eyas.engine.speculative import SpeculativeDecoder

            self.decoder = SpeculativeDecoder(self, draft, spec)
        if cuda_graphs and self.device.type == "cuda":
            from eyas.engine.graphs import CudaGraphs

            self.runner.graphs = CudaGraphs(self.runner)
        self.runner.persistent = PersistentTarget(self.runner)  # batch-1 passes as one launch, where the plan asks
        self.execution_plan_summary = plan_summary(self)  # the plan in force at build and the paths it implies

    # -- requests -------------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise EyasError("the prompt is empty")
        margin = self.lookahead
        if len(prompt_ids) + params.max_tokens + margin > self.max_len:
            raise EyasError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                            f"context of {self.max_len - margin} tokens")
        seq = Sequence(next(self._ids), list(prompt_ids), params)
        if params.seed is not None and not params.greedy:  # a greedy row draws nothing, and may run ahead
            seq.generator = torch.Generator(self.device).manual_seed(params.seed)
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is, freeing its cache slot (a stop string matched, or the client left)."""
        self.drain_ahead()  # the batch changes: no step may stay in flight for it
        if seq.slot is not None and any(s is seq for s in self.running):
            self._release(seq)
        # Identity, not ==: a Sequence holds tensors, and dataclass equality would compare them.
        self.waiting = deque(s for s in self.waiting if s is not seq)
        self.running = [s for s in self.running if s is not seq]
        seq.finish_reason = seq.finish_reason or "abort"

    def _release(self, seq: Sequence) -> None:
        self.runner.kv.free(seq.slot)
        seq.draft_state = None

    def drain_ahead(self) -> None:
        """Read every step or cycle still in flight ahead of the host (ahead.py)."""
        if self.decoder is not None:
            self.decoder.step_loop.drain_ahead()  # both modes, booked to the adaptive policy's open window
        else:
            self.ahead.drain()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def lookahead(self) -> int:
        """Cache columns past a sequence's tokens that one step may write: a cycle's draft tokens + 1, or 1."""
        return self.decoder.lookahead if self.decoder else 1

    def usable_slots(self) -> int:
        """Cache slots requests can use: the running ones and the free ones (not the runner's scratch slot)."""
        return len(self.running) + self.runner.kv.free_slots

    def weight_bytes(self) -> int:
        """Bytes of the target's weights as loaded on this rank (packed, where the checkpoint ships quantized)."""
        return weight_bytes(self.target)

    def kv_cache_bytes(self) -> int:
        """Bytes of the target's KV cache on this rank."""
        return self.runner.kv.bytes()

    def policy_snapshot(self) -> dict | None:
        """The adaptive speculation policy's estimates (SpecPolicy.snapshot), or None without one."""
        return self.decoder.policy.snapshot() if self.decoder and self.decoder.policy.adaptive else None

    def step(self) -> list[Sequence]:
        """Admit waiting requests, run one decode step or speculative cycle; returns finished sequences."""
        admitted = []
        if self._should_admit():
            self.drain_ahead()  # the batch changes
            while self.waiting and self.runner.kv.free_slots:
                seq = self.waiting.popleft()
                seq.slot = self.runner.kv.allocate()
                admitted.append(seq)
        prof = self.profiler or NULL_PROFILER
        if admitted:
            started = self.decoder.step_loop.prefill_started() if self.decoder else None
            with prof.phase("prefill"):
                for group in prefill_groups(admitted, PREFILL_TOKENS):
                    self._prefill(group)
            if self.decoder:
                self.decoder.step_loop.prefill_done(started)
        self.last_admitted = len(admitted)
        self.running.extend(admitted)
        live = [s for s in self.running if not s.finished]
        self.last_decision = None
        if live and self.decoder:
            self.decoder.step_loop.cycle(live)
            self.last_decision = self.decoder.step_loop.last_decision
        elif live:
            with prof.phase("decode"):
                self.decode(live)
        done = [s for s in self.running if s.finished]
        for s in done:
            self._release(s)
        self.running = [s for s in self.running if not s.finished]
        if self.decoder and not self.running and not self.waiting:
            self.decoder.step_loop.idle()
        return done

    def warm_up(self) -> int:
        """Capture the CUDA graphs of every batch bucket now (a server's start), not on first use in the
        middle of traffic, where each capture stalls every running request: for greedy and sampled requests,
        which take different graphs (ahead of the host, or in step with it), and in both of a speculative
        engine's modes, which the adaptive policy may choose. Returns the number of graphs captured; a no-op
        without CUDA graphs."""
        graphs = self.runner.graphs
        if graphs is None:
            return 0
        from eyas.engine.graphs import BATCH_BUCKETS, SHORT_ROWS
        from eyas.layers.attention import kernel_reads_cache

        before = self.captured_graphs()
        lookahead = self.lookahead
        params = SamplingParams(max_tokens=4 * lookahead + 2, ignore_eos=True)  # a few steps per mode and bucket
        kernel = kernel_reads_cache(self.runner.kv)
        # Graphs over the slot-attention kernel come in two widths: rows up to SHORT_ROWS columns, and longer.
        lengths = [8]
        if kernel and SHORT_ROWS + 8 + params.max_tokens + lookahead <= self.max_len:
            lengths.append(SHORT_ROWS + 8)
        # Each mode forced: the adaptive policy measures nothing on these dummy prompts.
        sampled = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True, temperature=0.8)
        passes = [(True, params), (False, params), (True, sampled), (False, sampled)] if self.decoder \
            else [(None, params), (None, sampled)]
        for forced, pass_params in passes:
            if self.decoder:
                self.decoder.policy.forced = forced
            try:
                for n in lengths:
                    for b in (b for b in BATCH_BUCKETS if b <= graphs.max_batch):
                        self.generate([[0] * n] * b, pass_params)
            finally:
                if self.decoder:
                    self.decoder.policy.forced = None
        if self.decoder:  # the draft's catch-up after plain steps, in wide passes (catch_up.py)
            from eyas.engine.catch_up import warm_wide_passes

            warm_wide_passes(self.decoder, graphs.max_batch)
        if kernel:
            self.warm_eager_passes(long_rows=len(lengths) > 1)
        return self.captured_graphs() - before

    def captured_graphs(self) -> int:
        """CUDA graphs captured so far: the target's passes, the draft's phases and the pairs of both modes
        ahead of the host (two graphs each)."""
        g = self.runner.graphs
        if g is None:
            return 0
        pairs = len(self.ahead.pairs) + (len(self.decoder.ahead.pairs) if self.decoder else 0)
        return len(g.graphs) + 2 * pairs

    def warm_eager_passes(self, long_rows: bool = True):
        """Run the passes whose slot-attention kernels would otherwise compile in the middle of traffic, each
        new variant stalling every running request: eager prefills of short prompts (groups too large for
        graphed chunks, runner.py), and with a draft the catch-up after plain steps, over rows up to SHORT_ROWS
        columns and past it. Query lengths 2, 8, 12 and 16 cover the kernel's row-block sizes (16, 32, 64) and
        its cases of query length (1, a multiple of 16, other); the graph captures cover decode-shaped passes."""
        from eyas.engine.graphs import SHORT_ROWS

        query_lengths = (2, 8, 12, 16)  # prompt lengths of the prefills, lag lengths of the catch-ups
        chunked, self.runner.chunked_prefill = self.runner.chunked_prefill, False  # eager: large groups' path
        if self.decoder is not None:
            self.decoder.policy.forced = True  # dummy prompts: the adaptive policy books nothing
        try:
            for n in query_lengths:
                self.generate([[0] * n], SamplingParams(max_tokens=1, ignore_eos=True))
        finally:
            self.runner.chunked_prefill = chunked
            if self.decoder is not None:
                self.decoder.policy.forced = None
        if self.decoder is None:
            return
        policy, lookahead = self.decoder.policy, self.lookahead
        starts = [8] + ([SHORT_ROWS + 8] if long_rows else [])
        try:
            for n in starts:
                for lag in query_lengths:
                    params = SamplingParams(max_tokens=lag + 2 * lookahead + 2, ignore_eos=True)
                    if n + params.max_tokens + lookahead > self.max_len:
                        continue
                    self.add([0] * n, params)
                    policy.forced = False
                    for _ in range(lag):
                        self.step()
                    policy.forced = True  # the next step catches the draft up over `lag` pairs
                    while self.has_work():
                        self.step()
        finally:
            policy.forced = None

    def _should_admit(self) -> bool:
        """Admit while nothing runs, or once `admit_batch` requests (or every waiting one) fit at once.

        A prefill is an eager forward whose launch cost barely depends on how many prompts it holds; a
        throughput job (synth, regen) that refilled one slot per step would pay it on nearly every step.
        """
        free = self.runner.kv.free_slots
        if not self.waiting or not free:
            return False
        if not any(not s.finished for s in self.running):
            return True
        return free >= min(self.admit_batch, len(self.waiting))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, params)]
        while self.has_work():
            self.step()
        return seqs

    # -- forwards -------------------------------------------------------------------------------
    def _prefill(self, seqs: list[Sequence]):
        """The target over several prompts at once, right-padded to the longest (runner.prefill)."""
        lens = [len(s.prompt_ids) for s in seqs]
        T = max(lens)
        ids = torch.tensor([s.prompt_ids + [0] * (T - len(s.prompt_ids)) for s in seqs], device=self.device)
        out = self.runner.prefill(ids, [s.slot for s in seqs])
        last = torch.tensor(lens, device=self.device) - 1
        rows = torch.arange(len(seqs), device=self.device)
        logits = self.target.logits(out.hidden[rows, last])
        tokens = self.sample(logits, seqs).tolist()
        for s, t, lp in zip(seqs, tokens, self.step_logprobs(seqs, logits, tokens)):
            s.cached = len(s.prompt_ids)
            s.append([t], self.eos_ids, lp)
        if self.decoder:
            self.decoder.prefill(seqs, out.aux_hidden, lens)

    def decode(self, seqs: list[Sequence]):
        """One plain decode step; returns the target's output (the speculative decoder reads its features),
        or None when it ran ahead of the host (ahead.py) or a drain left nothing to decode."""
        if self.ahead.active and not self.ahead.usable(seqs):
            self.ahead.drain()  # e.g. rows crossing an attention bound: start again on their graph pair
            seqs = [s for s in seqs if not s.finished]
            if not seqs:
                return None
        if self.ahead.usable(seqs):
            return self.ahead.advance(seqs)
        starts, slots = [s.cached for s in seqs], [s.slot for s in seqs]
        ids, pos, slots_t = torch.tensor([[s.output_ids[-1] for s in seqs], starts, slots],
                                         device=self.device)[:, :, None]
        if self.runner.persistent.serves(len(seqs), 1, graph_kv_len(self.runner.kv, max(starts) + 1)):
            logits, out = self.runner.persistent.output(ids, pos[:, 0], slots_t[:, 0])
        else:
            out = self.runner.forward(ids, pos, slots, starts)
            logits = self.target.logits(out.hidden[:, -1])
        tokens = self.sample(logits, seqs).tolist()
        self.take_step(seqs, tokens, self.step_logprobs(seqs, logits, tokens))
        return out

    def take_step(self, seqs: list[Sequence], tokens: list[int], logprobs: list | None = None) -> None:
        """One decode step's tokens into its sequences (its cache write counted); a sequence that stopped
        before the step (decoding ahead learns a stop a step late) takes nothing."""
        for i, (s, t) in enumerate(zip(seqs, tokens)):
            if s.finished:
                continue
            s.cached += 1
            s.verify_passes += 1
            s.append([t], self.eos_ids, logprobs[i] if logprobs else None)

    @staticmethod
    def step_logprobs(seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> list:
        """Per sequence, [its token's TokenLogprob] under its row of logits [B, V] when it asked for
        log-probabilities, else None. Nothing is computed when no sequence asked."""
        return [token_logprobs(logits[i:i + 1], tokens[i:i + 1], s.params.logprobs) if s.wants_logprobs else None
                for i, s in enumerate(seqs)]

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [B, V] -> tokens [B]. Greedy rows take the argmax; sampled rows sharing temperature, top-p
        and top-k are adjusted together; a seeded row draws its one uniform from its own generator, so it
        gets the same tokens whatever else is in the batch, and unseeded rows share one batched draw."""
        tokens = logits.argmax(-1)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(seqs):
            p = s.params
            if not p.greedy:
                groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(i)
        for (temperature, top_p, top_k), rows in groups.items():
            probs = adjusted_probs(logits[rows], temperature, top_p, top_k)
            u = torch.rand(len(rows), device=probs.device, dtype=probs.dtype)  # unseeded rows: one draw for all
            for j, i in enumerate(rows):
                if seqs[i].generator is not None:
                    u[j:j + 1] = uniform(probs, seqs[i].generator)
            tokens[rows] = sample_from(probs, None, u)
        return tokens


PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward


def prefill_groups(seqs: list[Sequence], budget: int) -> list[list[Sequence]]:
    """Admitted sequences grouped by similar length so that each padded forward stays under `budget` tokens."""
    groups, cur = [], []
    for s in sorted(seqs, key=lambda s: len(s.prompt_ids)):
        if cur and len(s.prompt_ids) * (len(cur) + 1) > budget:
            groups.append(cur)
            cur = []
        cur.append(s)
    return groups + [cur] if cur else groups
