"""Loss masks from the chat template, the vocabulary mapping, conversation files and prompt filters."""

import json

import pytest
import torch

from eyas.errors import EyasError
from eyas.train.conversation import encode_all, encode_conversation, end_of_turn_ids, user_turn_prefix
from eyas.train.prompts import Conversation, ascii_ratio, contaminated, dedup, read_conversations
from eyas.train.synth import keep_question
from eyas.train.recipe import SynthConfig
from eyas.train.vocab import build_mapping, coverage_by_size, mapping_from_counts
from tests.train.conftest import CONVERSATIONS


def _masked_text(tok, sample, value=True):
    ids = sample.input_ids[sample.loss_mask == value].tolist()
    return tok.decode(ids)


def test_loss_mask_covers_only_assistant_turns(tokenizer):
    conv = [{"role": "system", "content": "Be kind."}, *CONVERSATIONS[1]]
    s = encode_conversation(tokenizer, conv, max_len=512)
    assert s.input_ids.shape == s.loss_mask.shape and s.loss_mask.dtype == torch.bool
    trained = _masked_text(tokenizer, s)
    # Exactly the two replies, each with its end-of-turn marker (the template's trailing newline too).
    assert trained == (conv[2]["content"] + "<|im_end|>\n" + conv[4]["content"] + "<|im_end|>\n")
    untrained = _masked_text(tokenizer, s, False)
    for m in conv:
        if m["role"] != "assistant":
            assert m["content"] in untrained
    assert "<|im_start|>assistant\n" in untrained  # the role header is the template's, not the assistant's


def test_loss_mask_truncates_with_the_sample(tokenizer):
    full = encode_conversation(tokenizer, CONVERSATIONS[1], max_len=10_000)
    cut = encode_conversation(tokenizer, CONVERSATIONS[1], max_len=50)
    assert len(cut) == 50
    assert torch.equal(cut.input_ids, full.input_ids[:50]) and torch.equal(cut.loss_mask, full.loss_mask[:50])


def test_batched_encoding_equals_one_conversation_at_a_time(tokenizer):
    """encode_all tokenizes chunks of conversations in one call; every sample must be the one a call of its
    own gives, across chunk boundaries, and samples cut before any reply must be dropped and counted."""
    msgs = [[{"role": "system", "content": "Be kind."}, *CONVERSATIONS[1]], *CONVERSATIONS,
            [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]]
    convs = [Conversation(str(i), m) for i, m in enumerate(msgs * 2)]
    dropped = {}
    for max_len in (512, 45):
        samples, stats = encode_all(tokenizer, convs, max_len, progress=False, chunk=3)
        one = [encode_conversation(tokenizer, c.messages, max_len) for c in convs]
        kept = [s for s in one if int(s.loss_mask[2:].sum()) > 0]
        assert stats["dropped_no_assistant_tokens"] == len(one) - len(kept)
        dropped[max_len] = len(one) - len(kept)
        assert len(samples) == len(kept) == stats["samples"]
        for a, b in zip(samples, kept):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert dropped[512] == 0 and dropped[45] > 0


def test_magpie_prefix_and_end_of_turn(tokenizer):
    prefix = tokenizer.decode(user_turn_prefix(tokenizer))
    assert prefix.endswith("<|im_start|>user\n") and "You are a test." in prefix
    assert end_of_turn_ids(tokenizer) == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_magpie_prefix_under_a_system_prompt(tokenizer):
    prefix = tokenizer.decode(user_turn_prefix(tokenizer, "The user asks for Python code."))
    assert prefix == "<|im_start|>system\nThe user asks for Python code.<|im_end|>\n<|im_start|>user\n"
    assert tokenizer.decode(user_turn_prefix(tokenizer, "")) == tokenizer.decode(user_turn_prefix(tokenizer))


def test_a_template_without_system_turns_is_one_clear_error(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                         + tokenizer.chat_template)
    with pytest.raises(EyasError, match="does not take a system message"):
        user_turn_prefix(tok, "Ask about math.")
    tok.chat_template = "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(EyasError, match="drops the system message"):
        user_turn_prefix(tok, "Ask about math.")


class QuestionEngine:
    """Stands in for the Engine in synth: records the prompts it is given and writes `text` and the row's
    number (counted over every call) as each question, ended by the end-of-turn token."""

    def __init__(self, tokenizer, text: str):
        from types import SimpleNamespace

        self.tokenizer, self.text, self.prompts = tokenizer, text, []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.config = SimpleNamespace(eos_token_ids=[self.end])

    def generate(self, prompts, params):
        from types import SimpleNamespace

        first = len(self.prompts)
        self.prompts.extend(prompts)
        return [SimpleNamespace(output_ids=self.tokenizer.encode(f"{self.text} {first + i}?") + [self.end],
                                finish_reason="stop") for i in range(len(prompts))]


def test_synth_takes_the_system_prompts_in_turn_and_keeps_only_the_question(tokenizer, tmp_path):
    from eyas.train.recipe import parse_recipe
    from eyas.train.synth import synthesize

    systems = ["", "The user asks for code.", "The user asks a math question."]
    recipe = parse_recipe({"target": "unused", "out_dir": str(tmp_path),
                           "synth": {"num": 7, "batch": 4, "system_prompts": systems}})
    engine = QuestionEngine(tokenizer, "Question number")
    out = synthesize(recipe, engine, tokenizer, progress=False)
    assert out["prompts"] == 7
    prefixes = [user_turn_prefix(tokenizer, s) for s in systems]
    assert engine.prompts[:6] == prefixes * 2
    rows = read_conversations(tmp_path / "data" / "synth-r0.jsonl")
    assert len(rows) == 7
    assert all(c.messages == [{"role": "user", "content": c.first_user()}] for c in rows)
    assert all(c.first_user().startswith("Question number") for c in rows)


def test_synth_starts_questions_with_the_openers_under_every_system_prompt(tokenizer, tmp_path):
    from eyas.train.recipe import parse_recipe
    from eyas.train.synth import synthesize

    systems, openers = ["", "The user asks for code."], ["", "Write", "Explain"]
    recipe = parse_recipe({"target": "unused", "out_dir": str(tmp_path),
                           "synth": {"num": 6, "batch": 6, "system_prompts": systems, "openers": openers}})
    engine = QuestionEngine(tokenizer, " a line number")
    synthesize(recipe, engine, tokenizer, progress=False)
    expected = [user_turn_prefix(tokenizer, s) + tokenizer.encode(o) for s in systems for o in openers]
    assert engine.prompts[:6] == expected
    questions = [c.first_user() for c in read_conversations(tmp_path / "data" / "synth-r0.jsonl")]
    assert questions == ["a line number 0?", "Write a line number 1?", "Explain a line number 2?",
                         "a line number 3?", "Write a line number 4?", "Explain a line number 5?"]


def test_synth_writes_plain_questions_between_the_opened_ones(tokenizer, tmp_path):
    from eyas.train.recipe import parse_recipe
    from eyas.train.synth import synthesize

    recipe = parse_recipe({"target": "unused", "out_dir": str(tmp_path),
                           "synth": {"num": 6, "batch": 6, "openers": ["Write", "Explain"], "plain_per_opener": 2}})
    engine = QuestionEngine(tokenizer, " a line number")
    synthesize(recipe, engine, tokenizer, progress=False)
    prefix = user_turn_prefix(tokenizer, "")
    assert engine.prompts[:6] == [prefix + tokenizer.encode("Write"), prefix, prefix,
                                  prefix + tokenizer.encode("Explain"), prefix, prefix]
    questions = [c.first_user() for c in read_conversations(tmp_path / "data" / "synth-r0.jsonl")]
    assert questions == ["Write a line number 0?", "a line number 1?", "a line number 2?",
                         "Explain a line number 3?", "a line number 4?", "a line number 5?"]


def test_vocab_counts_only_assistant_tokens(samples):
    m = build_mapping(samples, vocab_size=320, draft_vocab_size=40)
    counts = torch.zeros(320, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.input_ids[s.loss_mask], minlength=320)
    top = set(torch.sort(-counts, stable=True).indices[:40].tolist())
    used = m.d2t + torch.arange(40)
    assert set(used.tolist()) == top
    assert torch.all(used[1:] > used[:-1])  # ascending
    assert m.t2d.sum() == 40 and torch.all(m.t2d[used])
    # More distinct assistant tokens than draft slots: every slot holds a token the assistant wrote.
    assert int((counts > 0).sum()) > 40 and torch.all(counts[used] > 0)


def test_vocab_offsets_and_padding_with_lowest_unused_ids():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[7, 3, 9]] = torch.tensor([5, 9, 1])
    m = mapping_from_counts(counts, draft_vocab_size=5)
    used = (m.d2t + torch.arange(5)).tolist()
    assert used == [0, 1, 3, 7, 9]  # the three seen ids, padded with the lowest unused ids 0 and 1
    assert m.d2t.tolist() == [0, 0, 1, 4, 5]
    assert m.t2d.tolist() == [i in used for i in range(10)]
    assert m.coverage == 1.0
    assert coverage_by_size(counts, sizes=(1, 2, 3, 11)) == {1: 9 / 15, 2: 14 / 15, 3: 1.0}
    with pytest.raises(EyasError, match="draft_vocab_size"):
        mapping_from_counts(counts, draft_vocab_size=11)


def test_reads_sharegpt_and_openai_files(tmp_path):
    sg = tmp_path / "a.json"
    sg.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "hi"},
                                                             {"from": "gpt", "value": "hello"}]}]))
    oa = tmp_path / "b.jsonl"
    oa.write_text(json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}) + "\n")
    a, = read_conversations(sg)
    b, = read_conversations(oa)
    assert a.id == "x" and a.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert b.messages[0]["role"] == "system" and b.first_user() == "q"


@pytest.mark.parametrize("content, match", [
    ("", "is empty"),
    ("{not json\n", "line 1: not valid JSON"),
    ("[1, 2", "not valid JSON"),
    ('{"text": "no turns"}\n', "expected 'conversations'"),
    ('{"conversations": [{"from": "robot", "value": "x"}]}\n', "known speaker"),
    ("[]", "holds no conversations"),
])
def test_bad_conversation_files_are_one_clear_error(tmp_path, content, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(EyasError, match=match):
        read_conversations(f)
    with pytest.raises(EyasError, match="not found"):
        read_conversations(tmp_path / "missing.jsonl")


def test_filters_dedup_and_eval_contamination():
    from eyas.train.prompts import Conversation

    cfg = SynthConfig(min_chars=5, max_chars=50, min_ascii_ratio=0.8)
    assert keep_question("What is a prime number?", "stop", cfg)
    assert not keep_question("What is a prime number?", "length", cfg)  # ran out of tokens mid-question
    assert not keep_question("Hi", "stop", cfg) and not keep_question("x" * 51, "stop", cfg)
    assert not keep_question("Что такое простое число?", "stop", cfg)
    assert ascii_ratio("abc") == 1.0 and ascii_ratio("123") == 1.0
    evals = ["compose an engaging travel blog post about a recent trip to hawaii, highlighting cultural experiences."]
    assert contaminated("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
                        "cultural experiences.  ", evals)
    assert not contaminated("Write a blog post.", evals)
    convs = [Conversation(str(i), [{"role": "user", "content": t}]) for i, t in
             enumerate(["Hello there", "hello   THERE", evals[0], "Other"])]
    kept, stats = dedup(convs, evals)
    assert [c.id for c in kept] == ["0", "3"] and stats == {"duplicates": 1, "eval_overlap": 1}


def test_append_after_a_torn_line_keeps_every_complete_row(tmp_path):
    from eyas.train.prompts import write_jsonl

    path = tmp_path / "regen-r0.jsonl"
    write_jsonl(path, [{"id": "a"}, {"id": "b"}])
    with open(path, "a") as f:
        f.write('{"id": "c", "conv')  # a run killed in the middle of an append
    write_jsonl(path, [{"id": "d"}], append=True)
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "b", "d"]
