"""EAGLE-3 speculative decoding: draft -> verify -> accept -> commit, batched, chain and tree alike.

Bookkeeping per sequence with `c = seq.cached` target tokens in the target cache and the last
output token x_c pending (the tree root):
- the draft cache holds the pairs (feature f_i, token x_{i+1}) at positions i < c, and the draft's
  output at position c-1 (its hidden and log-probs) is kept in `seq.draft_state`;
- drafting feeds candidate nodes at positions c, c+1, ... (storage columns past c, a tree mask over them);
- verify runs the whole tree through the target in one forward at columns c..c+N-1;
- commit compacts the accepted path's target KV to c..c+m and re-runs the draft on the accepted
  pairs with the target's fresh features (overwriting the speculative draft entries).
For greedy batches, acceptance and commit run on the device right after verify (acceptance and the extend
pass as one more graph), and the host reads the result once per cycle; ahead of the host (spec_ahead.py) the
whole cycle is a single graph. Batches with sampled sequences accept on the host. A chain (topk 1) drafts and accepts through shorter functions of its own (Drafter.chain,
tree.accept_greedy_chain) that give the general tree's results with k = 1 in fewer kernels.
When the policy chooses a plain step, the draft does not run: the step's (feature, token) pair is kept
in the sequence's lag, and the draft catches up before it drafts again (catch_up.py). Plain steps then cost
what plain decoding costs, ahead of the host too. Which of the two a step runs, and the policy's books, is the
step loop's (adaptive_steps.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.config import SpecConfig
from eyas.engine import catch_up as lag
from eyas.engine.adaptive_steps import AdaptiveSteps
from eyas.engine.draft_state import gather_states, set_states
from eyas.engine.drafter import Drafter
from eyas.engine.graphs import BATCH_BUCKETS, graph_kv_len
from eyas.engine.kv_cache import KVCache
from eyas.engine.profile import NullProfiler
from eyas.engine.runner import PREFILL_CHUNK, chunked_length
from eyas.engine.spec_ahead import SpecAhead
from eyas.engine.spec_policy import SpecPolicy
from eyas.engine.tree import accept_greedy, accept_greedy_batched, accept_greedy_chain, accept_sampled
from eyas.layers.attention import AttentionBatch
from eyas.layers.rotary import RotaryEmbedding
from eyas.layers.sampling import adjusted_probs, token_logprobs
from eyas.models.draft_io import load_draft
from eyas.models.eagle3 import Eagle3Draft


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
        # Which of the two modes each step runs, and the policy's books.
        self.step_loop = AdaptiveSteps(self.policy, self.ahead, engine.ahead,
                                       speculative_cycle=self.speculative_cycle, plain_step=self.plain_step,
                                       catch_up=self.catch_up, agree=self.target.tp.agree,
                                       captured_graphs=engine.captured_graphs, device=engine.device)

    @property
    def lookahead(self) -> int:
        return self.spec.draft_tokens + 1

    @property
    def profiler(self):
        return self.engine.profiler or NullProfiler()

    @property
    def graphs(self):
        g = self.engine.runner.graphs
        return None if g is None else g.functions

    def release(self, seq):
        seq.draft_state = None

    def verify_body(self, tokens, depth, mask, c_t, slots, kv_len):
        """The target over the drafted tree at columns c..c+N-1; returns its greedy tokens, logits and features."""
        batch = AttentionBatch(kv=self.engine.runner.kv, slots=slots, starts=c_t, kv_len=kv_len, new_mask=mask)
        out = self.target(tokens, c_t[:, None] + depth, batch)
        logits = self.target.logits(out.hidden)
        return logits.argmax(-1), logits, out.aux_hidden

    def commit_body(self, tokens, parents, depth, argmax, aux, c_t, slots, kv_len):
        """Greedy acceptance of a verified tree and the draft run over the accepted pairs (see extend).
        Pure or idempotent, as a graph's body must be: capturing one runs it more than once."""
        if self.spec.topk == 1:
            sel, accepted, new = accept_greedy_chain(tokens, argmax)
        else:
            sel, accepted, new = accept_greedy_batched(tokens, parents, depth, argmax, self.spec.steps)
        feats = aux.gather(1, sel[..., None].expand(-1, -1, aux.shape[-1]))
        h, scores = self.drafter.extend(new, feats, accepted, c_t, slots, kv_len)
        return new, accepted, sel, h, scores

    def run_padded(self, name, fn, B, kv, kv_need, inputs, pads, padded=False):
        """Run `fn` on inputs padded to a batch bucket; replayed from a CUDA graph when the engine has them.
        Inputs may arrive already padded (another run_padded's outputs); `padded` returns the outputs unsliced."""
        graphs = self.graphs
        key = None if graphs is None else self._graph_key(name, B, kv, kv_need, [x.shape[1:] for x in inputs])
        Bp, kv_len = (B, graph_kv_len(kv, kv_need)) if key is None else key[1:3]
        inputs = [x if x.shape[0] == Bp else
                  torch.cat([x, torch.full((Bp - x.shape[0],) + x.shape[1:], pad, dtype=x.dtype, device=x.device)])
                  for x, pad in zip(inputs, pads)]
        if graphs is None:
            outs = fn(*inputs, kv_len)
        else:
            outs = graphs.run(key, lambda *xs: fn(*xs, kv_len), inputs)
        return outs if padded else [o[:B] for o in outs]

    def _graph_key(self, name, B, kv, kv_need, shapes) -> tuple:
        """The key of run_padded's graph for B rows of inputs of these per-row shapes: (name, batch bucket, kv
        bound, shapes)."""
        Bp = next((b for b in BATCH_BUCKETS if b >= B), B)
        return name, Bp, graph_kv_len(kv, kv_need), tuple(tuple(s) for s in shapes)

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
        meta = torch.tensor([[n - 1 for n in lens], [s.slot for s in seqs]], device=dev)
        last, slots = meta[0], meta[1]
        if self.engine.runner.prefills_in_chunks(B, T):
            set_states(seqs, *self._prefill_in_chunks(ids, features, last, slots))
            return
        pos = torch.arange(T, device=dev)[None].expand(B, T)
        starts = torch.zeros(B, dtype=torch.long, device=dev)
        out = self.drafter.forward(self.target.embed(ids), features, pos, slots, starts, graph_kv_len(self.kv, T),
                                   fuse=True)
        h = out[torch.arange(B, device=dev), last]
        set_states(seqs, h, self.drafter.scores(h))

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
        """A cycle of greedy sequences. Acceptance and the draft's extend pass run as one more graph right
        after the verify pass, and a tree's KV compaction eagerly on the device, so the GPU runs the whole
        cycle without waiting for the host, which reads the accepted tokens once, at the end (or a cycle
        later, spec_ahead.py, where the whole cycle is one graph)."""
        if self.ahead.usable(seqs):
            self.ahead.advance(seqs)
            return
        prof, B = self.profiler, len(seqs)
        c = [s.cached for s in seqs]
        tokens, parents, depth, argmax, _, aux, c_t, slots_t = self._draft_and_verify(seqs, c)
        with prof.phase("commit"):
            new, accepted, h, scores = self.commit_pass(B, max(c), tokens[:B], parents[:B], depth[:B], argmax,
                                                        aux, c_t, slots_t)
            set_states(seqs, h.clone(), scores.clone())  # graph outputs: the next replay overwrites them
        with prof.phase("accept"):
            host = torch.cat([new, accepted[:, None]], dim=1).tolist()  # the cycle's one sync
            self.advance(seqs, [row[:row[-1] + 1] for row in host], [row[-1] for row in host])

    def compact_paths(self, slots_t, c_t, sel, accepted):
        """A tree's accepted path may skip nodes: move its target KV from columns c + sel to c, c+1, ...
        (on the device; past the path, column c onto itself). A chain's path never skips a node."""
        if self.spec.topk == 1:
            return
        cols = torch.arange(sel.shape[1], device=sel.device)[None]
        order = torch.where(cols <= accepted[:, None], cols, 0)
        self.engine.runner.kv.compact(slots_t, c_t[:, None] + sel, c_t[:, None] + order)

    def advance(self, seqs, new_tokens: list[list[int]], accepted: list[int], logprobs: list | None = None):
        """The host's side of a commit: each sequence takes its accepted tokens and the bonus token (and
        their log-probabilities, where it asked for them)."""
        for i, (s, tokens, m) in enumerate(zip(seqs, new_tokens, accepted)):
            self.profiler.record_accept(m, self.spec.steps)
            s.cached += m + 1
            s.verify_passes += 1
            s.append(tokens, self.engine.eos_ids, logprobs[i] if logprobs else None)

    def _sampled_cycle(self, seqs):
        """A cycle with sampled sequences: acceptance draws on the host (tree.accept_sampled)."""
        prof, dev = self.profiler, self.engine.device
        S, N = self.spec.steps, self.spec.draft_tokens
        B = len(seqs)
        c = [s.cached for s in seqs]
        tokens, parents, _, argmax, logits, aux, c_t, slots_t = self._draft_and_verify(seqs, c)
        with prof.phase("accept"):
            host = torch.cat([tokens[:B], parents[:B], argmax], dim=1).tolist()  # the cycle's one sync
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

    def _draft_and_verify(self, seqs, c: list[int]):
        """Draft a tree for every sequence from its draft state, and verify it with the target."""
        with self.profiler.phase("draft"):
            hidden0, scores0 = gather_states(seqs)
            root, c_t, slots_t = torch.tensor([[s.output_ids[-1] for s in seqs], c, [s.slot for s in seqs]],
                                              device=self.engine.device)  # one host-to-device copy for the inputs
            tokens, parents, depth, mask = self.draft_pass(len(seqs), max(c), scores0, hidden0, root, c_t, slots_t)
        with self.profiler.phase("verify"):
            argmax, logits, aux = self.verify_pass(len(seqs), max(c), tokens, depth, mask, c_t, slots_t)
        return tokens, parents, depth, argmax, logits, aux, c_t, slots_t

    # The passes of a cycle as graphs, for B sequences whose longest holds at most `c` cached tokens; inputs may
    # come padded to the batch bucket, padding rows at the scratch slot (spec_ahead.py keeps them so).
    def draft_pass(self, B, c, scores0, hidden0, root, c_t, slots_t):
        """The drafted tree (tokens, parents, depth, mask), rows padded to the batch bucket."""
        tokens, parents, depth, mask = self.run_padded("tree", self.draft_fn, B, self.kv, c + self.reach["tree"],
                                                       [scores0, hidden0, root, c_t, slots_t],
                                                       [0, 0, 0, 0, self.engine.runner.scratch_slot], padded=True)
        # Read after the verify graph replays, which may keep its temporaries where these live (graphs.py):
        # a chain's verify pass crosses a length bucket two columns before its draft does, so its graph is
        # captured first and the draft's is then free to reuse that memory. Copies, outside the pool.
        return tokens.clone(), parents.clone(), depth.clone(), mask

    def verify_pass(self, B, c, tokens, depth, mask, c_t, slots_t, padded=False):
        """The target's greedy tokens, logits and features over the tree. The tree's outputs go straight in,
        padding rows included (they write only the scratch row)."""
        runner = self.engine.runner
        return self.run_padded("verify", self.verify_body, B, runner.kv, c + self.reach["verify"],
                               [tokens, depth, mask, c_t, slots_t], [0, 0, True, 0, runner.scratch_slot],
                               padded=padded)

    def commit_pass(self, B, c, tokens, parents, depth, argmax, aux, c_t, slots_t, padded=False):
        """Greedy acceptance and the draft's extend pass (one graph), then a tree's KV compaction (eager:
        moving columns is not idempotent). Returns new tokens, accepted counts and the draft's output."""
        new, accepted, sel, h, scores = self.run_padded("commit", self.commit_body, B, self.kv,
                                                        c + self.reach["commit"],
                                                        [tokens, parents, depth, argmax, aux, c_t, slots_t],
                                                        [0, 0, 0, 0, 0, 0, self.engine.runner.scratch_slot],
                                                        padded=padded)
        self.compact_paths(slots_t, c_t, sel, accepted)
        return new, accepted, h, scores

    def plain_step(self, seqs):
        """One plain decode step; the draft catches up later (see the module docstring), so speculation
        can resume on any later step. Greedy batches decode ahead of the host (decode_ahead.py), which
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
            self.catch_up([s for s in seqs if len(s.draft_state.lag_tokens) >= lag.LAG_FLUSH and not s.finished])

    def catch_up(self, seqs):
        """Catch the draft up on the pairs these sequences hold back (catch_up.py)."""
        lag.catch_up(self, seqs)
