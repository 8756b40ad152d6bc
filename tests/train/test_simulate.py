"""Acceptance read off one teacher-forced pass equals what the Engine's greedy chain accepts, cycle for cycle:
the TTT unroll that training runs and the chain that inference runs are the same computation."""

import pytest
import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from eyas.models.draft_io import load_draft
from eyas.models.loader import load_model
from eyas.train.simulate import draft_predictions, simulate_chain, teacher_forced_accuracy


@torch.no_grad()
@pytest.mark.parametrize("spec_steps", [1, 3, 5])
def test_simulated_chain_equals_the_engines_verify_passes(pair, spec_steps):
    target_dir, draft_dir = pair
    g = torch.Generator().manual_seed(spec_steps)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 40)]
    engine = Engine(str(target_dir), dtype="fp32", device="cpu", draft=str(draft_dir),
                    spec=SpecConfig(spec_steps, 1, adaptive=False),
                    max_batch=3, max_len=256)
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (33, 50, 21)])

    target = load_model(str(target_dir), "fp32", "cpu")
    draft = load_draft(draft_dir, target.config)
    target.capture_layers = draft.config.capture_layers(target.config.num_layers)
    accepted_more_than_one = False
    for prompt, seq in zip(prompts, seqs):
        ids = torch.tensor(prompt + seq.output_ids)
        preds = draft_predictions(target, draft, ids, spec_steps)
        generated, passes = simulate_chain(preds, ids, len(prompt), spec_steps)
        assert (generated, passes) == (len(seq.output_ids) - 1, seq.verify_passes)
        accepted_more_than_one |= generated > passes

        right, total = teacher_forced_accuracy(preds, ids, len(prompt))
        assert total[0] == len(seq.output_ids) - 1
        assert right[0] == total[0]  # the pair's first guess is always the target's next token
    assert accepted_more_than_one or spec_steps == 1


def test_simulated_chain_stops_at_the_first_wrong_guess_and_at_the_end():
    ids = torch.arange(10)
    preds = torch.full((3, 10), -1)
    preds[0, 3:8] = ids[5:10]          # step 0 right at indices 3..7
    preds[1, 3] = ids[6]               # step 1 right at index 3 only
    preds[2, 3] = ids[7]               # and step 2 too: the cycle at index 3 accepts three guesses
    # prompt of 4: x_4 comes from the prefill; cycles start with 5, 9 committed tokens -> index 3, then 7.
    assert simulate_chain(preds, ids, 4, 3) == (5, 2)     # 4 tokens (3 guesses + 1), then the last one
    assert simulate_chain(preds, ids, 4, 1) == (5, 3)     # index 3: 2 tokens; index 5: 2; index 7: the last
    assert teacher_forced_accuracy(preds, ids, 4) == ([5, 1, 1], [5, 4, 3])
    # A reply of one token (the prefill's) or two leaves nothing, or only step 0, to guess.
    assert simulate_chain(preds[:, :5], ids[:5], 4, 3) == (0, 0)
    assert teacher_forced_accuracy(preds[:, :5], ids[:5], 4) == ([0, 0, 0], [0, 0, 0])
    assert teacher_forced_accuracy(preds[:, :6], ids[:6], 4) == ([1, 0, 0], [1, 0, 0])


def test_training_evals_score_their_heldout_replies(pair):
    """AcceptanceEval's heldout_acc_k is the teacher-forced accuracy of the replies it generated: the pair's
    draft guesses the next token right every time at step 0, and mostly wrong deeper."""
    from eyas.train.evaluate import AcceptanceEval

    target_dir, draft_dir = pair
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 13)]
    draft = load_draft(draft_dir, load_model(str(target_dir), "fp32", "cpu").config)
    result = AcceptanceEval(str(target_dir), prompts, device="cpu", dtype="fp32", max_tokens=30, spec_steps=3,
                            ignore_eos=True)(draft)
    assert result["heldout_acc_k"][0] == 1.0 and result["heldout_acc_k"][1] < 1.0
    assert result["accept_length"] > 1.5
