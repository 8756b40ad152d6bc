"""speculators 0.9 and eyas run each other's EAGLE-3 drafts identically, fp32, first and second draft step.

speculators' own Eagle3DraftModel runs in its cached venv (tests/peers/envs.py), in a subprocess: it loads the
speculators layout eyas writes, and writes drafts with its save_pretrained that eyas loads. Its training forward
gives both steps at every position (step 2 teacher-forced, each row attending to the step-1 keys up to it and its
own step-2 key); eyas's are compared from its TTT unroll and from its inference path (KV cache, as served).
"""

import json
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from eyas.layers.kv_cache import KVCache
from eyas.layers.attention import AttentionBatch
from eyas.models.draft_io import load_draft, save_draft
from eyas.train.ttt import unroll
from tests.helpers import random_draft
from tests.peers.envs import peer_python

H, V, DRAFT_V, T, LAYERS = 64, 96, 40, 9, 7
TOL = 1e-5

# Run by speculators' python: `steps DIRS IO` loads each draft directory listed in the JSON file DIRS and writes
# its two steps' logits beside it; `write JOBS IO` builds, randomises and save_pretrained()s each job's draft and
# writes its logits beside it. One process per direction: each start imports speculators (about 25 s).
PEER = r'''
import json, sys, torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig

def eager(cfg):
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on the CPU
    return cfg

def steps(model, io):
    # The embedding eyas ships (speculators 0.9 under transformers 5 leaves a missing one uninitialised).
    assert torch.equal(model.embed_tokens.weight.float(), io["embed"]), "speculators' embedding is not the target's"
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().float()))
    with torch.no_grad():
        model(hidden_states=io["feats"], input_ids=io["ids"], document_ids=torch.zeros_like(io["ids"]),
              position_ids=torch.arange(io["ids"].shape[1])[None], ttt_steps=2)
    hook.remove()
    return logits

io = torch.load(sys.argv[3])
if sys.argv[1] == "steps":
    for path in json.loads(open(sys.argv[2]).read()):
        model = Eagle3DraftModel.from_pretrained(path, config=eager(Eagle3SpeculatorConfig.from_pretrained(path)))
        torch.save(steps(model.float().eval(), io), path + "/speculators_logits.pt")
else:
    for job in json.loads(open(sys.argv[2]).read()):
        layer = LlamaConfig(**job["layer"])
        cfg = Eagle3SpeculatorConfig(
            transformer_layer_config=layer, draft_vocab_size=job["draft_vocab_size"], **job["flags"],
            speculators_config=SpeculatorsConfig(
                algorithm="eagle3", default_proposal_method="greedy",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=job["speculative_tokens"])],
                verifier=VerifierConfig(name_or_path=job["verifier"], architectures=["LlamaForCausalLM"])))
        torch.manual_seed(job["seed"])
        model = Eagle3DraftModel(eager(cfg))
        model.load_vocab_mappings(io["t2d"], io["d2t"])
        model.load_verifier_weights()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.startswith(("embed_tokens", "verifier_")):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.05 * torch.randn_like(p))
        model.eval().save_pretrained(job["out"])
        torch.save(steps(model, io), job["out"] + "/speculators_logits.pt")
'''


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    python = peer_python("speculators")
    root = tmp_path_factory.mktemp("speculators")
    script = root / "peer.py"
    script.write_text(PEER)

    def run(*args):
        r = subprocess.run([python, str(script), *map(str, args)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    return run, root


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny HF Llama checkpoint as the verifier speculators reads the embedding from, and shared inputs."""
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(V, H, generator=g)
    root = tmp_path_factory.mktemp("target")
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 2 * H,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": V, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32"}))
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": torch.randn(V, H, generator=g),
               "model.norm.weight": torch.ones(H)}, str(root / "model.safetensors"))
    used = torch.randperm(V, generator=g)[:DRAFT_V].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    io = {"embed": embed, "feats": torch.randn(1, T, 3 * H, generator=g),
          "ids": torch.randint(0, V, (1, T), generator=g), "d2t": used - torch.arange(DRAFT_V), "t2d": t2d}
    torch.save(io, root / "io.pt")
    return root, io


def eyas_ttt_steps(draft, io):
    """Both steps at every position from eyas's TTT unroll (which pairs feature t with token t+1)."""
    ids = torch.cat([torch.zeros_like(io["ids"][:, :1]), io["ids"]], dim=1)[:, :T]  # unroll shifts by one
    with torch.no_grad():
        return [draft.logits(out) for out in unroll(draft, io["embed"][ids], io["feats"], 2)]


def eyas_served_steps(draft, io, p):
    """Step 1 over positions 0..p, then step 2 at p+1 from the output at p: the KV-cache path eyas serves."""
    draft.fuse_projections()
    cfg = draft.config
    kv = KVCache(1, 1, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    pos = torch.arange(p + 1)[None]
    with torch.no_grad():
        out = draft(io["embed"][io["ids"][:, :p + 1]], io["feats"][:, :p + 1], pos,
                    AttentionBatch(kv=kv, slots=torch.tensor([0]), starts=torch.tensor([0]), kv_len=32), fuse=True)
        nxt = draft(io["embed"][io["ids"][:, p + 1:p + 2]], out[:, p:p + 1], torch.tensor([[p + 1]]),
                    AttentionBatch(kv=kv, slots=torch.tensor([0]), starts=torch.tensor([p + 1]), kv_len=32))
        return draft.logits(out)[:, p], draft.logits(nxt)[:, 0]


def compare(ours_ttt, ours_served, theirs, p):
    """Max |diff| of each step over the positions that step predicts (speculators pads the last ones)."""
    diffs = [(ours_ttt[k][:, :T - 1 - k] - theirs[k][:, :T - 1 - k]).abs().max().item() for k in range(2)]
    diffs += [(ours_served[k] - theirs[k][:, p]).abs().max().item() for k in range(2)]
    return diffs


@pytest.fixture(scope="module")
def our_exports(peer, target, tmp_path_factory):
    """eyas's speculators export, as written and without norm_before_residual, each with speculators' logits."""
    run, root = peer
    tdir, io = target
    out = tmp_path_factory.mktemp("exports")
    draft = random_draft(H, V, draft_vocab=DRAFT_V)
    draft.d2t.copy_(io["d2t"])
    draft.t2d.copy_(io["t2d"])
    dirs = {}
    for name in ("as_written", "no_norm_before_residual"):
        save_draft(draft, out / name, layout="speculators", verifier=str(tdir), dtype=torch.float32,
                   speculative_tokens=3, embedding=io["embed"])
        dirs[name] = str(out / name)
    cfg = json.loads((out / "no_norm_before_residual" / "config.json").read_text())
    del cfg["norm_before_residual"]
    (out / "no_norm_before_residual" / "config.json").write_text(json.dumps(cfg))
    (out / "dirs.json").write_text(json.dumps(list(dirs.values())))
    run("steps", out / "dirs.json", tdir / "io.pt")
    return {name: (d, torch.load(d + "/speculators_logits.pt")) for name, d in dirs.items()}


def test_speculators_runs_our_export_as_eyas_does(our_exports, target):
    path, theirs = our_exports["as_written"]
    back = load_draft(path)
    io = target[1]
    diffs = compare(eyas_ttt_steps(back, io), eyas_served_steps(back, io, T - 3), theirs, T - 3)
    print(f"speculators 0.9.0 loads eyas export: max|diff| step1/step2 (ttt) {diffs[:2]}, (served) {diffs[2:]}")
    assert max(diffs) < TOL, diffs


FLAGS = [
    {"norm_before_residual": False, "norm_output": False},
    {"norm_before_residual": True, "norm_output": True, "norm_before_fc": True},
    {"norm_before_residual": False, "fc_norm": True},
]


def test_eyas_runs_drafts_speculators_saved(peer, target, tmp_path):
    run, root = peer
    tdir, io = target
    layer = {"model_type": "llama", "hidden_size": H, "intermediate_size": 2 * H, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False}
    jobs = [{"layer": layer, "draft_vocab_size": DRAFT_V, "flags": f, "speculative_tokens": 4, "verifier": str(tdir),
             "seed": i, "out": str(tmp_path / f"d{i}")} for i, f in enumerate(FLAGS)]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run("write", tmp_path / "jobs.json", tdir / "io.pt")
    for job in jobs:
        theirs = torch.load(job["out"] + "/speculators_logits.pt")
        back = load_draft(job["out"])
        for flag, value in job["flags"].items():
            assert getattr(back.config, flag) is value, flag
        assert back.config.speculative_tokens == 4 and torch.equal(back.d2t, io["d2t"])
        diffs = compare(eyas_ttt_steps(back, io), eyas_served_steps(back, io, T - 3), theirs, T - 3)
        print(f"eyas loads speculators save_pretrained {job['flags']}: max|diff| {diffs}")
        assert max(diffs) < TOL, (job["flags"], diffs)


def test_missing_norm_before_residual_means_speculators_default(our_exports, target):
    """speculators' config class defaults the key to False (vLLM's update_eagle3 would assume True)."""
    path, theirs = our_exports["no_norm_before_residual"]
    back = load_draft(path)
    io = target[1]
    assert back.config.norm_before_residual is False
    assert max(compare(eyas_ttt_steps(back, io), eyas_served_steps(back, io, T - 3), theirs, T - 3)) < TOL
