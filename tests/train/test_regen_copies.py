"""[regen] sampled_copies: each training prompt also gets N conversations "<id>~s1".."<id>~sN" with every turn
sampled, beside its greedy one, which stays as it was. Copies are deterministic, resumable, split across ranks,
and never made of held-out prompts."""

import json

import pytest

from eyas.cli import main
from eyas.train.pipeline import Pipeline
from eyas.train.prompts import build_pool, read_conversations
from eyas.train.recipe import parse_recipe
from eyas.train.regen import regen_files, regenerate
from tests.train.conftest import write_sharegpt


def _recipe(target, sharegpt, out, **regen):
    return parse_recipe({"target": str(target), "out_dir": str(out), "device": "cpu",
                         "data": {"sharegpt": [str(sharegpt)], "heldout": 2, "max_len": 256, "max_turns": 2,
                                  "eval_sets": []},
                         "regen": {"temperature": 0.0, "max_tokens": 8, "batch": 4, **regen}})


def _regen(recipe, rank: int = 0, world: int = 1) -> dict:
    """Pipeline.regen as rank `rank` of `world` (without torchrun's barrier)."""
    p = Pipeline(recipe, progress=False)
    pool = build_pool(recipe, write=True)
    engine = p.engine(recipe.regen.batch, recipe.data.max_len)
    return regenerate(recipe, engine, p.tokenizer, pool.train, rank, world, progress=False)


def _rows(recipe) -> dict[str, dict]:
    """Every row the regen files hold, by id; an id written twice fails the test."""
    rows = [json.loads(line) for f in regen_files(recipe) for line in f.read_text().splitlines() if line.strip()]
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "an id was written twice"
    return by_id


def _replies(row) -> list[str]:
    return [t["value"] for t in row.get("conversations", []) if t["from"] == "gpt"]


def _expected_ids(recipe, copies: int) -> set[str]:
    train = build_pool(recipe, write=False).train
    return {c.id + (f"~s{j}" if j else "") for c in train for j in range(copies + 1)}


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory):
    return write_sharegpt(tmp_path_factory.mktemp("prompts") / "sharegpt.jsonl", n=6)


@pytest.fixture(scope="module")
def with_copies(tiny_target, sharegpt, tmp_path_factory):
    recipe = _recipe(tiny_target, sharegpt, tmp_path_factory.mktemp("copies"), sampled_copies=2)
    return recipe, _regen(recipe)


def test_each_prompt_gets_its_greedy_reply_and_two_sampled_copies(tiny_target, sharegpt, with_copies, tmp_path):
    recipe, stats = with_copies
    rows = _rows(recipe)
    train = [c.id for c in build_pool(recipe, write=False).train]
    assert set(rows) == _expected_ids(recipe, 2) and len(rows) == 3 * len(train) == 12
    assert all(_replies(r) for r in rows.values())  # this target never ends a turn early: nothing dropped
    assert stats["conversations"] == 12 and stats["sampled_replies"] == sum(
        len(_replies(r)) for i, r in rows.items() if "~s" in i)

    # The greedy conversations are exactly those of a run without copies.
    plain = _recipe(tiny_target, sharegpt, tmp_path / "plain")
    _regen(plain)
    assert _rows(plain) == {i: rows[i] for i in train}

    # Copies are deterministic, and sampled: they differ from the greedy reply and from each other.
    again = _recipe(tiny_target, sharegpt, tmp_path / "again", sampled_copies=2)
    _regen(again)
    assert _rows(again) == rows
    assert any(_replies(rows[f"{i}~s1"]) != _replies(rows[i]) for i in train)
    assert any(_replies(rows[f"{i}~s1"]) != _replies(rows[f"{i}~s2"]) for i in train)
    # Every turn of a copy is sampled: a two-turn prompt's second reply differs from the greedy one too.
    two = [i for i in train if len(_replies(rows[i])) == 2 and len(_replies(rows[f"{i}~s1"])) == 2]
    assert two and any(_replies(rows[f"{i}~s1"])[1] != _replies(rows[i])[1] for i in two)

    # Held-out prompts get no reply, neither greedy nor sampled.
    heldout = {c.id for c in read_conversations(recipe.out / "data" / "heldout.jsonl")}
    assert len(heldout) == 2 and not heldout & {i.split("~s")[0] for i in rows}


def test_an_interrupted_run_resumes_without_repeating_or_losing_copies(tiny_target, sharegpt, with_copies, tmp_path):
    full, _ = with_copies
    recipe = _recipe(tiny_target, sharegpt, tmp_path / "out", sampled_copies=2, max_samples=2)
    _regen(recipe)
    first = {c.id for c in build_pool(recipe, write=False).train[:2]}  # max_samples caps prompts, not copies
    assert set(_rows(recipe)) == {i for i in _expected_ids(full, 2) if i.split("~s")[0] in first}
    # Killed in the middle of an append: the last row is torn.
    path = recipe.out / "data" / "regen-r0.jsonl"
    text = path.read_text()
    path.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 10])
    recipe.regen.max_samples = 0
    stats = _regen(recipe)
    assert stats["skipped_done"] == 5 and stats["conversations"] == 7
    assert set(_rows(recipe)) == set(_rows(full))


def test_ranks_split_prompts_and_copies_between_them(tiny_target, sharegpt, with_copies, tmp_path):
    full, _ = with_copies
    written = []
    for rank in (0, 1):
        recipe = _recipe(tiny_target, sharegpt, tmp_path / f"r{rank}", sampled_copies=2)
        _regen(recipe, rank, world=2)
        written.append(set(_rows(recipe)))
    assert written[0] and written[1] and not written[0] & written[1]
    assert written[0] | written[1] == set(_rows(full))


@pytest.mark.parametrize("line, match", [("sampled_copies = -1", "[regen] sampled_copies must be >= 0"),
                                         ("sampled_temperature = 0", "[regen] sampled_temperature must be positive")])
def test_bad_copy_settings_are_one_line_errors(tmp_path, capsys, line, match):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'target = "x"\n[regen]\n{line}\n')
    assert main(["train", "regen", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err


def test_training_leaves_out_replies_of_prompts_a_new_split_holds_out(tiny_target, sharegpt, with_copies, tmp_path):
    """A pool that changes between runs (here: another shuffle seed) moves prompts into the held-out set; their
    replies and copies, written before, must not reach training."""
    import dataclasses
    import shutil

    from eyas.train.regen import prompt_id, read_regenerated

    recipe, _ = with_copies
    moved = dataclasses.replace(recipe, out_dir=str(tmp_path / "moved"),
                                data=dataclasses.replace(recipe.data, seed=recipe.data.seed + 1))
    (moved.out / "data").mkdir(parents=True)
    for f in regen_files(recipe):
        shutil.copy(f, moved.out / "data" / f.name)
    before = {c.id for c in read_regenerated(moved)}  # no heldout.jsonl in the new directory yet: all of them
    heldout = {c.id for c in build_pool(moved, write=True).heldout}
    after = {c.id for c in read_regenerated(moved)}
    assert after == {i for i in before if prompt_id(i) not in heldout}
    assert before - after, "the new shuffle should move at least one regenerated prompt into the held-out set"


@pytest.mark.parametrize("conv_id,prompt", [("sharegpt-3", "sharegpt-3"), ("sharegpt-3~s2", "sharegpt-3"),
                                            ("a~s", "a~s"), ("a~sb", "a~sb"), ("x~s1~s12", "x~s1")])
def test_prompt_id_inverts_copy_id(conv_id, prompt):
    from eyas.train.regen import prompt_id

    assert prompt_id(conv_id) == prompt
