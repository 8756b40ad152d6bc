"""EAGLE-3 speculative decoding: draft -> verify -> accept -> commit, batched, chain and tree alike.

Bookkeeping per sequence with `c = seq.cached` target tokens in the target cache and the last
output token x_c pending (the tree root):
- the draft cache holds the pairs (feature f_i, token x_{i+1}) at positions i < c, and the draft's
  output at position c-1 (its hidden and log-probs) is kept in `seq.draft_state`;
- drafting feeds candidate nodes at positions c, c+1, ... (storage columns past c, a tree mask over them);
- verify runs the whole tree through the target in one forward at columns c..c+N-1;
- commit compacts the accepted path's target KV to c..c+m and re-runs the draft on the accepted
  pairs with the target's fresh features (overwriting the speculative draft entries).
A greedy cycle is one body (greedy_cycle) that runs on the device from its inputs to its results, acceptance
and the extend pass included, and the host reads the result once: ahead of the host (ahead.py) the body is
one CUDA graph; in step with it (tensor parallelism, the profiler) each pass is its own graph. Batches with
sampled sequences accept on the host. A chain (topk 1) drafts and accepts through shorter functions of its
own (Drafter.chain, draft_tree.accept_greedy_chain) that give the general tree's results with k = 1 in fewer kernels.
When the policy chooses a plain step the draft does not run, and catches up on the step's pairs before it
drafts again (catch_up.py). Which of the two a step runs, and the policy's books, is adaptive_steps.py's.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from eyas.config import SpecConfig
from eyas.engine import catch_up as lag
from eyas.engine.adaptive_steps import AdaptiveSteps
from eyas.engine.ahead import SpecAhead, StepInputs, step_inputs
from eyas.engine.draft_state import set_states
from eyas.engine.drafter import Drafter
from eyas.engine.graphs import bucket_rows, graph_kv_len
from eyas.engine.profile import NULL_PROFILER
from eyas.engine.runner import PREFILL_CHUNK, chunked_length
from eyas.layers.attention import AttentionBatch
from eyas.layers.draft_tree import accept_greedy, accept_greedy_batched, accept_greedy_chain, accept_sampled
from eyas.layers.kv_cache import KVCache
from eyas.layers.rotary import RotaryEmbedding
from eyas.layers.sampling import adjusted_probs, token_logprobs
from eyas.models.draft_io import load_draft
from eyas.models.eagle3 import Eagle3Draft
from eyas.spec_policy import SpecPolicy


class SpeculativeDecoder:
    def __init__(self, engine, draft_path, spec: SpecConfig | None):
        self.engine = engine
        self.spec = spec or SpecConfig()
        self.target = engine.target
        dtype = next(self.target.parameters()).dtype
        s, k = self.spec.steps, self.spec.topk
        positions = engine.max_len + s * k + 8
        if isinstance(draft_path, Eagle3Draft):  # an in-memory draft (tests, training-time evaluation)
            self.draft = draft_path.to(device=engine.device, dtype=dtype)
            if self.draft.rotary.max_positions < positions:  # its rope table must cover every drafted position
                r = self.draft.rotary
                self.draft.rotary = RotaryEmbedding(r.head_dim, r.theta, r.scaling, positions).to(engine.device)
        else:
            self.draft = load_draft(draft_path, self.target.config, dtype, engine.device, max_positions=positions)
        self.draft.fuse_projections()
        self.target.capture_layers = self.draft.config.capture_layers(self.target.config.num_layers)
        self.policy = SpecPolicy(max_batch=self.spec.max_batch, adaptive=self.spec.adaptive)
        heads, head_dim, shared = self.draft.config.kv_cache_layout()  # an MLA draft caches one latent per token
        self.kv = KVCache(1, engine.runner.kv.num_slots, positions, heads, head_dim, dtype, engine.device, shared)
        self.accept_on_device = True  # greedy batches; False keeps them on the host path (tests compare both)
        self.drafter = Drafter(self.draft, self.target.model.embed_tokens, self.kv, self.spec, engine.device)
        self.draft_fn = self.drafter.chain if k == 1 else self.drafter.tree
        # Columns past the longest row's cache that each pass of a cycle reaches (its graph's attention bound):
        # the draft's tree writes (steps - 1) * topk, the verify pass draft_tokens, the extend pass steps + 1.
        self.reach = {"tree": (s - 1) * k, "verify": self.spec.draft_tokens, "commit": s + 1}
        self.ahead = SpecAhead(self)  # greedy cycles one ahead of the host (off: execution_plan's decode_ahead)
        self.step_loop = AdaptiveSteps(self.policy, self.ahead, engine.ahead,
                                       speculative_cycle=self.speculative_cycle, plain_step=self.plain_step,
                                       catch_up=partial(lag.catch_up, self), agree=self.target.tp.agree,
                                       captured_graphs=engine.captured_graphs, device=engine.device)

    @property
    def lookahead(self) -> int:
        return self.spec.draft_tokens + 1

    @property
    def profiler(self):
        return self.engine.profiler or NULL_PROFILER

    @property
    def graphs(self):
        return self.engine.runner.graphs

    def verify_body(self, tokens, depth, mask, c_t, slots, kv_len):
        """The target over the drafted tree at columns c..c+N-1; returns its greedy tokens, logits and features."""
        persistent = self.engine.runner.persistent
        if persistent is not None and persistent.serves(*tokens.shape, kv_len):
            return persistent.forward(tokens, c_t, slots, depth, mask)
        batch = AttentionBatch(kv=self.engine.runner.kv, slots=slots, starts=c_t, kv_len=kv_len, new_mask=mask)
        out = self.target(tokens, c_t[:, None] + depth, batch)
        logits = self.target.logits(out.hidden)
        return logits.argmax(-1), logits, out.aux_hidden

    def commit_body(self, tokens, parents, depth, mask, argmax, aux, c_t, slots, kv_len):
        """Greedy acceptance of a verified tree and the draft run over the accepted pairs (see extend).
        Pure or idempotent, as a graph's body must be: capturing one runs it more than once."""
        if self.spec.topk == 1:
            sel, accepted, new = accept_greedy_chain(tokens, argmax)
        else:
            sel, accepted, new = accept_greedy_batched(tokens, parents, depth, mask, argmax, self.spec.steps)
        feats = aux.gather(1, sel[..., None].expand(-1, -1, aux.shape[-1]))
        h, scores = self.drafter.extend(new, feats, accepted, c_t, slots, kv_len)
        return new, accepted, sel, h, scores

    def run_padded(self, name, fn, B, kv, kv_need, inputs, pads=None, padded=False):
        """fn over B rows of inputs at the attention bound of kv_need columns: replayed from a CUDA graph of the
        batch bucket when the engine has them, rows padded with `pads` (None: padded already). `padded`
        returns the outputs unsliced."""
        kv_len = graph_kv_len(kv, kv_need)
        if self.graphs is None:
            outs = fn(*inputs, kv_len)
        else:
            key = self._graph_key(name, B, kv, kv_need, [x.shape[1:] for x in inputs])
            outs = self.graphs.run(key, lambda *xs: fn(*xs, kv_len), inputs, key[1], pads)
        return outs if padded else [o[:B] for o in outs]

    def _graph_key(self, name, B, kv, kv_need, shapes) -> tuple:
        """run_padded's graph for B rows of inputs of these per-row shapes: (name, bucket, kv bound, shapes)."""
        return name, bucket_rows(B), graph_kv_len(kv, kv_need), tuple(tuple(s) for s in shapes)

    def has_graph(self, name, B, kv, kv_need, shapes) -> bool:
        """Whether run_padded would replay a graph captured already (never capture one) for these inputs."""
        return self.graphs is not None and self._graph_key(name, B, kv, kv_need, shapes) in self.graphs.graphs

    def extend(self, seqs, ids: torch.Tensor, last: torch.Tensor, feats: torch.Tensor, starts: torch.Tensor,
                slots: torch.Tensor, max_start: int):
        """Run the draft over accepted pairs (ids, feats [B, L], padded to a fixed length) at columns
        starts..; keep its output at `last` per sequence."""
        h, scores = self.run_padded("extend", self.drafter.extend, len(seqs), self.kv, max_start + feats.shape[1],
                                    [ids, feats, last, starts, slots], [0, 0, 0, 0, self.engine.runner.scratch_slot])
        # Copies: under CUDA graphs h and scores are static buffers that the next replay overwrites.
        set_states(seqs, h.clone(), scores.clone())

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self, seqs, features, lens: list[int]):
        """After the target's prefill (engine.py): run the draft over each prompt's (feature, next token)
        pairs, the rows right-padded like the target's. When the target ran in graphed chunks (runner.py),
        the draft does too, through the extend graphs; otherwise in one eager pass."""
        dev = self.engine.device
        B, T = features.shape[:2]
        rows = [s.prompt_ids[1:] + s.output_ids[:1] for s in seqs]
        ids = torch.tensor([r + [0] * (T - len(r)) for r in rows], device=dev)
        last, slots = torch.tensor([[n - 1 for n in lens], [s.slot for s in seqs]], device=dev)  # one copy
        if self.engine.runner.prefills_in_chunks(B, T):
            set_states(seqs, *self._prefill_in_chunks(ids, features, last, slots))
        else:  # one extend pass over the whole prompts
            starts = torch.zeros(B, dtype=torch.long, device=dev)
            set_states(seqs, *self.drafter.extend(ids, features, last, starts, slots, graph_kv_len(self.kv, T)))

    def _prefill_in_chunks(self, ids, features, last, slots):
        """The draft's prefill as PREFILL_CHUNK-token extend passes at columns 0, C, 2C, ...; each row keeps
        the output at its last prompt token, from the chunk that holds it."""
        B, T = ids.shape
        C = PREFILL_CHUNK
        pad = chunked_length(T) - T
        ids, features = F.pad(ids, (0, pad)), F.pad(features, (0, 0, 0, pad))
        h = scores = None
        for start in range(0, T, C):
            starts = torch.full((B,), start, dtype=torch.long, device=ids.device)
            hc, lc = self.run_padded("extend", self.drafter.extend, B, self.kv, start + C,
                                     [ids[:, start:start + C], features[:, start:start + C],
                                      (last - start).clamp(0, C - 1), starts, slots],
                                     [0, 0, 0, 0, self.engine.runner.scratch_slot])
            if h is None:  # copies: under CUDA graphs hc and lc are buffers the next replay overwrites
                h, scores = hc.clone(), lc.clone()
            else:
                here = ((last >= start) & (last < start + C))[:, None]
                h, scores = torch.where(here, hc, h), torch.where(here, lc, scores)
        return h, scores

    def speculative_cycle(self, seqs):
        """One draft -> verify -> accept -> commit cycle for the batch: on the device for greedy batches (ahead of
        the host where it may), on the host where a sequence samples. Log-probabilities need the verify pass's
        rows on the host: those sequences accept there too."""
        if self.accept_on_device and all(s.params.greedy and not s.wants_logprobs for s in seqs):
            self._greedy_cycle(seqs)
        else:
            self._sampled_cycle(seqs)

    def _greedy_cycle(self, seqs):
        """A cycle of greedy sequences: ahead of the host where it may (ahead.py, the whole cycle one graph),
        else in step with it, each pass from its own graph (which the profiler can time), then one read."""
        if self.ahead.usable(seqs):
            self.ahead.advance(seqs)
            return
        B = len(seqs)
        x = self._cycle_inputs(seqs)
        results, following = self.greedy_cycle(x, self._in_step(B, max(s.cached for s in seqs)), self.profiler)
        with self.profiler.phase("accept"):
            # Copies: under CUDA graphs the draft's output is the commit graph's, which its next replay overwrites.
            set_states(seqs, following.hidden[:B].clone(), following.scores[:B].clone())
            host = results[:B].tolist()  # the cycle's one sync
            self.advance(seqs, [row[:row[-1] + 1] for row in host], [row[-1] for row in host])

    def greedy_cycle(self, x: StepInputs, run, prof=NULL_PROFILER) -> tuple[torch.Tensor, StepInputs]:
        """One greedy cycle on the device, from its inputs to its results without a host sync: the draft, the
        verify pass, acceptance and the draft's extend pass over the accepted pairs (commit_body), a tree's KV
        compaction. Returns [rows, steps + 2] (the new tokens, then the accepted count) and the next cycle's
        inputs. `run(name, fn, inputs)` runs a pass: inside the whole-cycle graph ahead of the host (ahead.py)
        a plain call, in step with the host its own graph (_in_step)."""
        tokens, parents, depth, mask, argmax, _, aux = self._draft_and_verify(x, run, prof)
        with prof.phase("commit"):
            new, accepted, sel, h, scores = run("commit", self.commit_body,
                                                [tokens, parents, depth, mask, argmax, aux, x.cached, x.slots])
            self.compact_paths(x.slots, x.cached, sel, accepted)
        # Padding rows stay at column 0 of the scratch row.
        following = StepInputs(new.gather(1, accepted[:, None])[:, 0], x.cached + (accepted + 1) * x.active,
                               x.slots, x.active, h, scores)
        return torch.cat([new, accepted[:, None]], dim=1), following

    def compact_paths(self, slots_t, c_t, sel, accepted):
        """A tree's accepted path may skip nodes: move its target KV from columns c + sel to c, c+1, ...
        (on the device; past the path, column c onto itself). A chain's path never skips a node."""
        if self.spec.topk == 1:
            return
        self.engine.runner.kv.compact_path(slots_t, c_t, sel, accepted)

    def advance(self, seqs, new_tokens: list[list[int]], accepted: list[int], logprobs: list | None = None):
        """The host's side of a commit: each sequence takes its accepted tokens and the bonus token (and
        their log-probabilities, where it asked for them)."""
        for i, (s, tokens, m) in enumerate(zip(seqs, new_tokens, accepted)):
            self.profiler.record_accept(m, self.spec.steps)
            s.cached += m + 1
            s.verify_passes += 1
            s.append(tokens, self.engine.eos_ids, logprobs[i] if logprobs else None)

    def _sampled_cycle(self, seqs):
        """A cycle with sampled sequences: acceptance draws on the host (draft_tree.accept_sampled)."""
        prof, dev = self.profiler, self.engine.device
        S, N = self.spec.steps, self.spec.draft_tokens
        B = len(seqs)
        c = [s.cached for s in seqs]
        x = self._cycle_inputs(seqs)
        tokens, parents, _, _, argmax, logits, aux = self._draft_and_verify(x, self._in_step(B, max(c)), prof)
        c_t, slots_t = x.cached[:B], x.slots[:B]
        with prof.phase("accept"):
            host = torch.cat([tokens[:B], parents[:B], argmax[:B]], dim=1).tolist()  # the cycle's one sync
            paths, bonus = [], []
            for i, s in enumerate(seqs):
                toks, par, best = host[i][:N], host[i][N:2 * N], host[i][2 * N:]
                if s.params.greedy:
                    path, b = accept_greedy(toks, par, best)
                else:
                    p = s.params
                    probs = adjusted_probs(logits[i], p.temperature, p.top_p, p.top_k)
                    path, b = accept_sampled(toks, par, probs, s.generator)
                paths.append(path)
                bonus.append(b)
        with prof.phase("commit"):
            # Fixed length S+1 (the longest possible path), so the extend pass keeps one graph shape; rows
            # are padded with the root (node 0), which the extend pass computes past `last` and ignores.
            L = S + 1
            sel = [path + [0] * (L - len(path)) for path in paths]                     # accepted nodes
            new_tokens = [[host[i][j] for j in paths[i][1:]] + [bonus[i]] for i in range(B)]
            # The k-th new token was accepted (or drawn) against the target's row at the k-th node of the path.
            logprobs = [token_logprobs(logits[i, paths[i]], new_tokens[i], s.params.logprobs)
                        if s.wants_logprobs else None for i, s in enumerate(seqs)]
            self.advance(seqs, new_tokens, [len(path) - 1 for path in paths], logprobs)
            # One host-to-device copy: accepted nodes, the extend pass's tokens and its last valid index
            # (which is also the number of drafted nodes accepted).
            meta = torch.tensor([sel[i] + t + [t[-1]] * (L - len(t)) + [len(t) - 1]
                                 for i, t in enumerate(new_tokens)], device=dev)
            sel_t, ids, last = meta[:, :L], meta[:, L:2 * L], meta[:, 2 * L]
            feats = aux[:B].gather(1, sel_t[..., None].expand(-1, -1, aux.shape[-1]))
            self.compact_paths(slots_t, c_t, sel_t, last)
            self.extend(seqs, ids, last, feats, c_t, slots_t, max(c))

    def _draft_and_verify(self, x: StepInputs, run, prof):
        """Draft a tree for every row from its draft state, and verify it with the target."""
        with prof.phase("draft"):
            tokens, parents, depth, mask = run("tree", self.draft_fn, [x.scores, x.hidden, x.token, x.cached, x.slots])
        with prof.phase("verify"):
            argmax, logits, aux = run("verify", self.verify_body, [tokens, depth, mask, x.cached, x.slots])
        return tokens, parents, depth, mask, argmax, logits, aux

    def _cycle_inputs(self, seqs) -> StepInputs:
        """A cycle's inputs in step with the host, padded to the batch bucket where graphs run its passes."""
        B = len(seqs)
        rows = B if self.graphs is None else bucket_rows(B)
        return step_inputs(seqs, rows, self.engine.runner.scratch_slot, self.engine.device, with_draft=True)

    def _in_step(self, B: int, c: int):
        """`run` for a cycle in step with the host, for B sequences whose longest holds c cached tokens: each
        pass through run_padded (its own graph, or eagerly) at its own attention bound, inputs padded already."""
        kv = {"tree": self.kv, "verify": self.engine.runner.kv, "commit": self.kv}

        def run(name, fn, inputs):
            outs = self.run_padded(name, fn, B, kv[name], c + self.reach[name], inputs, padded=True)
            # The tree is read after the verify graph replays, which may keep its temporaries where it lives
            # (graphs.py): a chain's verify pass crosses a length bucket two columns before its draft does, so
            # its graph is captured first and the draft's is then free to reuse that memory. Copies.
            return [o.clone() for o in outs] if name == "tree" else outs
        return run

    def plain_step(self, seqs):
        """One plain decode step; the draft catches up later (see the module docstring), so speculation
        can resume on any later step. Greedy batches decode ahead of the host (ahead.py), which
        holds each step's pair back as it reads the step's tokens."""
        eng, prof = self.engine, self.profiler
        with prof.phase("verify"):
            out = eng.decode(seqs)  # samples and appends too
        with prof.phase("commit"):
            if out is not None:  # in step with the host
                # A CUDA graph's output buffer is overwritten next replay: copied.
                lag.hold_back(seqs, out.aux_hidden[:, 0].clone(), range(len(seqs)))
                for _ in seqs:
                    prof.record_accept(0, 0)
            lag.catch_up(self, [s for s in seqs if len(s.draft_state.lag_tokens) >= lag.LAG_FLUSH and not s.finished])
