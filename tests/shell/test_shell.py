"""Every claim about shell behaviour is checked against a real bash running the same line."""

import json
import os
import shlex
import stat
import subprocess
import sys
import time

import pytest

from eyas.errors import EyasError
from eyas.shell.shell import command_line, parse_shell_line, quote
from eyas.shell.shell_lexer import tokenize

SHOW = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))"
# Variables bash itself puts into a child's environment; they are not set by the line.
BASH_OWN = {"PWD", "SHLVL", "_", "PATH", "OLDPWD"}

HOSTILE = ["plain", "two words", "it's", 'say "hi"', "$HOME", "`id`", "$(id)", "back\\slash", "new\nline", "",
           "-n", "--flag=1", "tab\there", "*", "~", "a;b", "a&&b", "a|b", "#x", "!x", "\\", "'", '"', "{a,b}",
           "héllo ünï", "trailing\\"]


def bash(line, tmp_path, env_extra=None):
    """Run `line` in a clean bash; returns (returncode, stdout, stderr)."""
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", **(env_extra or {})}
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=30)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def show(tmp_path):
    """A program (quoted for the shell) that prints its argv and environment as JSON."""
    (tmp_path / "bin").mkdir()
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    return f"{quote(sys.executable)} {quote(str(script))}"


def fake_program(tmp_path, name):
    """An executable called `name` (any characters) on the test PATH that prints its argv and environment."""
    path = tmp_path / "bin" / name
    path.write_text(f"#!{sys.executable}\n{SHOW}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def received(stdout):
    out = json.loads(stdout)
    return out["argv"], {k: v for k, v in out["env"].items() if k not in BASH_OWN and not k.startswith("LC_")}


@pytest.mark.parametrize("value", HOSTILE)
def test_quote_round_trips_through_bash(value, tmp_path, show):
    rc, out, err = bash(f"{show} {quote(value)} {quote(value)}x", tmp_path)
    assert rc == 0, err
    assert received(out)[0] == [value, value + "x"]


def test_command_line_reproduces_argv_and_env_exactly(tmp_path, show):
    env = {f"EYAS_V{i}": v for i, v in enumerate(HOSTILE)}
    argv = shlex.split(show) + HOSTILE
    line = command_line(argv, env)
    assert line.startswith("env ") and "\n" not in line.split("'")[0]
    rc, out, err = bash(line, tmp_path)
    assert rc == 0, err
    got_argv, got_env = received(out)
    assert got_argv == HOSTILE
    assert got_env == env
    assert command_line(["eyas", "runs", "list"], {}) == "eyas runs list"
    assert command_line(["eyas"], {"A": "x y", "B": "1"}) == "env 'A=x y' B=1 eyas"


def test_lexer_agrees_with_shlex_on_plain_words():
    for line in ["a 'b c' \"d e\" f\\ g", "x=1 'y=2' \"z\"=3", "--model-path /m --tp 8", "a\\\\b 'it'\"'\"'s'"]:
        assert [t.text for t in tokenize(line)] == shlex.split(line)


def check_against_bash(line, tmp_path, expect_env, expect_argv_tail, *, dropped=(), env_extra=None):
    parsed = parse_shell_line(line)
    rc, out, err = bash(line, tmp_path, env_extra)
    assert rc == 0, err
    got_argv, got_env = received(out.strip().splitlines()[-1])
    assert parsed.env == expect_env == got_env
    assert got_argv == expect_argv_tail
    assert parsed.argv[len(parsed.argv) - len(expect_argv_tail):] == expect_argv_tail
    assert {d.name for d in parsed.dropped} == set(dropped)
    for name in dropped:
        assert name not in got_env
    return parsed


@pytest.mark.parametrize("prefix,env,tail,dropped", [
    ("A=1 B='x y' C=\"q\\\"d\" D=", {"A": "1", "B": "x y", "C": 'q"d', "D": ""}, [], ()),
    ("A=1;", {}, [], ("A",)),
    ("export A=1; B=2;", {"A": "1"}, [], ("B",)),
    ("A=1; export A; B=2 C=3", {"A": "1", "B": "2", "C": "3"}, [], ()),
    ("A=1; export A=2; A=3;", {"A": "3"}, [], ()),  # assigning an exported variable updates what is exported
    ("export A=1 B=2; unset A;", {"B": "2"}, [], ()),
    ("A=$'tab\\there\\nnl'", {"A": "tab\there\nnl"}, [], ()),
    ("A=1 nohup", {"A": "1"}, [], ()),
    ("A=1 B=2 env -u A C=3", {"B": "2", "C": "3"}, [], ("A",)),
    ("A=1 env -i B=2", {"B": "2"}, [], ("A",)),
    ("A=1 timeout 20", {"A": "1"}, [], ()),
    ("time A=1", {"A": "1"}, [], ()),
    ("X=2 bash -c 'A=1 \"$0\" \"$1\" z' ", {"X": "2", "A": "1"}, ["z"], ()),
])
def test_assignments_match_bash(prefix, env, tail, dropped, tmp_path, show):
    if prefix.startswith("X=2 bash -c"):  # the program path goes in as $0/$1 of the inner shell
        line = prefix + show
    else:
        line = " ".join([prefix, show] + tail)
    parsed = check_against_bash(line, tmp_path, env, tail, dropped=dropped)
    if "env -i" in prefix:
        assert parsed.main.inherits_env is False


def test_words_operators_and_redirections_match_bash(tmp_path, show):
    log = tmp_path / "log"
    line = f"A=1 {show} ';' '&' x\\ y \"\" # comment > nowhere\n"
    check_against_bash(line, tmp_path, {"A": "1"}, [";", "&", "x y", ""])
    line = f"A=1 nohup {show} 1 2 > {quote(str(log))} 2>&1 & wait; cat {quote(str(log))}"
    parsed = check_against_bash(line, tmp_path, {"A": "1"}, ["1", "2"])
    main = parsed.main
    assert main.redirections == [f"> {log}", "2>&1"] and main.background and main.wrappers == ["nohup"]
    assert [c.program for c in parsed.commands][1:] == ["wait", "cat"]


@pytest.mark.parametrize("line,program,name", [
    ("nohup A=1 {show}", "A=1", "A"),
    ('"A"=1 {show}', "A=1", "A"),
    ("A=0 \\ B=2 {show}", " B=2", "B"),
])
def test_assignment_in_command_position_fails_like_bash(line, program, name, tmp_path, show):
    parsed = parse_shell_line(line.format(show=show))
    assert parsed.main.program == program and parsed.main.problem
    assert name in {d.name for d in parsed.dropped}
    rc, _, err = bash(line.format(show=show), tmp_path)
    assert rc == 127 and program in err  # bash: "command not found"; nohup: "failed to run command"
    fake_program(tmp_path, program)  # once a program of that odd name exists, bash runs exactly it
    rc, out, err = bash(line.format(show=show), tmp_path)
    assert rc == 0, err
    got_argv, got_env = received(out)
    assert got_env == parsed.main.env and name not in got_env
    assert got_argv == parsed.main.argv[1:]


def stand_in_ssh(tmp_path):
    """`ssh HOST WORDS...` as a real ssh behaves: WORDS joined by spaces, run by a shell that has none of our env."""
    (tmp_path / "bin").mkdir()
    ssh = tmp_path / "bin" / "ssh"
    ssh.write_text('#!/bin/bash\nshift\nexec env -i PATH="$PATH" bash -c "$*"\n')
    ssh.chmod(0o755)


USER_LINE = ("ssh root@10.0.0.1 'NCCL_PROTO=LL NCCL_ALGO=Ring \\ NCCL_BUFFSIZE=16777216 \\ nohup python -m "
             "sglang.launch_server --model-path /m --tp-size 8 > /tmp/log 2>&1 &'")


def test_user_line_backslash_space_trap():
    parsed = parse_shell_line(USER_LINE)
    main = parsed.main
    # bash on the remote host applies NCCL_PROTO and NCCL_ALGO... to a command named " NCCL_BUFFSIZE=16777216".
    assert main.host == "root@10.0.0.1" and main.wrappers == ["ssh root@10.0.0.1"]
    assert main.argv == [" NCCL_BUFFSIZE=16777216", " nohup", "python", "-m", "sglang.launch_server",
                         "--model-path", "/m", "--tp-size", "8"]
    assert main.env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}
    assert main.redirections == ["> /tmp/log", "2>&1"] and main.background
    assert "command not found" in main.problem and "`python` never starts" in main.problem
    [lost] = parsed.dropped
    assert (lost.name, lost.value) == ("NCCL_BUFFSIZE", "16777216") and "`\\ `" in lost.reason
    # What the user meant: the `\ ` were `\`+newline continuations flattened by a paste.
    meant = parsed.as_intended.main
    assert meant.argv == ["python", "-m", "sglang.launch_server", "--model-path", "/m", "--tp-size", "8"]
    assert meant.env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_BUFFSIZE": "16777216"}
    assert meant.wrappers == ["ssh root@10.0.0.1", "nohup"] and not parsed.as_intended.dropped
    assert "PROBLEM" in parsed.explain() and "probably meant" in parsed.explain()


def test_user_line_through_real_bash_and_a_stand_in_ssh(tmp_path):
    stand_in_ssh(tmp_path)
    fake_program(tmp_path, " NCCL_BUFFSIZE=16777216")
    log = tmp_path / "log"
    line = USER_LINE.replace("/tmp/log", str(log))
    rc, _, err = bash(line, tmp_path, {"NCCL_DEBUG": "INFO"})  # a local variable ssh must not carry over
    assert rc == 0, err
    deadline = time.time() + 20
    while not log.exists() or not log.read_text().strip():  # the remote command ran in the background
        assert time.time() < deadline, "the background command never wrote its log"
        time.sleep(0.05)
    time.sleep(0.05)
    argv, env = received(log.read_text())
    parsed = parse_shell_line(line)
    assert argv == parsed.main.argv[1:] and env == parsed.main.env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}


def test_user_line_never_starts_python_in_real_bash(tmp_path):
    stand_in_ssh(tmp_path)
    log = tmp_path / "log"
    rc, _, err = bash(USER_LINE.replace("/tmp/log", str(log)), tmp_path)
    assert rc == 0, err
    deadline = time.time() + 20
    while "command not found" not in (log.read_text() if log.exists() else ""):
        assert time.time() < deadline, "bash did not report the odd command name"
        time.sleep(0.05)
    assert " NCCL_BUFFSIZE=16777216: command not found" in log.read_text()


def test_seed_line_reports_every_lost_variable():
    line = ("ssh root@10.1.230.174 'NCCL_PROTO=LL NCCL_ALGO=Ring NCCL_P2P_LEVEL=SYS NCCL_MAX_NCHANNELS=16 \\ "
            "NCCL_BUFFSIZE=16777216 NCCL_NTHREADS=512 \\ EAGLE3_PROFILE=1 \\ SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_"
            "LEN=1 \\ nohup ~/ml-env/bin/python3 -m sglang.launch_server \\ --model-path /shared/kimi-k2.5-int4 \\ "
            "--tp-size 8 \\ --speculative-num-steps 2 \\ > /data/log 2>&1 &' echo \"EAGLE3 2-step + NCCL starting...\"")
    parsed = parse_shell_line(line)
    assert parsed.main.env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS",
                               "NCCL_MAX_NCHANNELS": "16"}
    assert [d.name for d in parsed.dropped] == ["NCCL_BUFFSIZE", "NCCL_NTHREADS", "EAGLE3_PROFILE",
                                                "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"]
    # ssh joins the trailing words too: the echo runs on the remote host, after the backgrounded command.
    assert [c.program for c in parsed.commands] == [" NCCL_BUFFSIZE=16777216", "echo"]
    assert parsed.commands[1].host == "root@10.1.230.174"
    meant = parsed.as_intended.main
    assert meant.argv[:3] == ["~/ml-env/bin/python3", "-m", "sglang.launch_server"]
    assert "--model-path" in meant.argv and len(meant.env) == 8 and meant.env["EAGLE3_PROFILE"] == "1"
    assert any("~" in note for note in parsed.notes)


def test_wrappers_without_bash():
    p = parse_shell_line("A=1 sudo B=2 python x.py")
    assert p.env == {"B": "2"} and p.dropped[0].name == "A" and "env_reset" in p.dropped[0].reason
    assert not p.main.inherits_env
    p = parse_shell_line("A=1 LD_LIBRARY_PATH=/x sudo -E python x.py")
    assert p.env == {"A": "1"} and [d.name for d in p.dropped] == ["LD_LIBRARY_PATH"] and p.main.inherits_env
    p = parse_shell_line("A=1 B=2 sudo --preserve-env=A -u root python x.py")
    assert p.env == {"A": "1"} and p.argv == ["python", "x.py"]
    p = parse_shell_line("A=1 ssh -p 22 -t host 'B=2 python x.py'")
    assert p.env == {"B": "2"} and p.main.host == "host" and p.dropped[0].name == "A"
    assert "ssh does not carry" in p.dropped[0].reason
    p = parse_shell_line("echo start; cd /w && B=2 python x.py | tee log; echo done")
    assert p.argv == ["python", "x.py"] and p.env == {"B": "2"}
    assert parse_shell_line("ssh host").main.argv == ["ssh", "host"]


def test_bad_lines_are_one_line_errors():
    for line in ["echo 'open", 'echo "open', "cmd >", "echo $(open"]:
        with pytest.raises(EyasError):
            parse_shell_line(line)


# The everyday forms of the trap: a `\` meant to continue a multi-line command, with a blank typed after it.
VAR_LINE = "NCCL_PROTO=LL NCCL_ALGO=Ring \\ \n{show} --tp-size 8 \\\n  --port 8000\n"
FLAG_LINE = "NCCL_PROTO=LL {show} --model-path /m \\ \n  --tp-size 8 \\\n  --port 8000\n"


def test_trap_backslash_space_newline_on_a_variable_line(tmp_path, show):
    """bash runs the next line without the variables: they were set for a command named ' ', which fails."""
    line = VAR_LINE.format(show=show)
    rc, out, err = bash(line, tmp_path)
    assert ": command not found" in err  # the ' ' command
    argv, env = received(out)
    assert argv == ["--tp-size", "8", "--port", "8000"] and "NCCL_PROTO" not in env and "NCCL_ALGO" not in env
    parsed = parse_shell_line(line)
    assert parsed.main.argv[2:] == argv and parsed.main.env == env == {}  # show = python + script
    assert [d.name for d in parsed.dropped] == ["NCCL_PROTO", "NCCL_ALGO"]
    assert "never gets it" in parsed.dropped[0].reason
    assert parsed.as_intended.main.env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}


def test_trap_backslash_space_newline_on_a_flag_line(tmp_path, show):
    """The command ends at that line with a stray ' ' argument; the next lines' flags run as a 'command'."""
    line = FLAG_LINE.format(show=show)
    rc, out, err = bash(line, tmp_path)
    assert "--tp-size: command not found" in err
    argv, env = received(out)
    assert argv == ["--model-path", "/m", " "] and env == {"NCCL_PROTO": "LL"}
    parsed = parse_shell_line(line)
    assert parsed.main.argv[2:] == argv
    assert "stray ' ' argument" in parsed.main.problem and "--tp-size 8 --port 8000" in parsed.main.problem
    assert parsed.commands[1].not_a_program and "is a flag, not a program" in parsed.commands[1].problem
    assert parsed.as_intended.main.argv[2:] == ["--model-path", "/m", "--tp-size", "8", "--port", "8000"]


@pytest.mark.parametrize("blank", [" ", "\t"])
def test_trap_backslash_blank_between_flags_and_backslash_tab(blank, tmp_path, show):
    """`\\ ` (or `\\<tab>`) joined into one line glues a blank onto the next flag: ' --tp-size' is no flag."""
    line = f"{show} --model-path /m \\{blank}--tp-size 8 \\{blank}--port 8000"
    rc, out, err = bash(line, tmp_path)
    argv, _ = received(out)
    assert argv == ["--model-path", "/m", f"{blank}--tp-size", "8", f"{blank}--port", "8000"]
    parsed = parse_shell_line(line)
    assert parsed.main.argv[2:] == argv and "start with a blank" in parsed.main.problem
    assert parsed.as_intended.main.argv[2:] == ["--model-path", "/m", "--tp-size", "8", "--port", "8000"]
    # The `\<tab>` forms of the other two traps are repaired the same way.
    tabbed = parse_shell_line(f"A=1 \\\tB=2 {show}")
    assert tabbed.main.problem and tabbed.as_intended.main.env == {"A": "1", "B": "2"}
    tabbed = parse_shell_line(f"{show} --m /m \\\t\n --tp 8")
    assert tabbed.main.problem and tabbed.as_intended.main.argv[-2:] == ["--tp", "8"]


def _from_shell(capsys, line, *extra):
    from eyas.cli import main

    code = main(["launch", "--from-shell", line, *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_from_shell_first_line_says_whether_the_pasted_line_starts_a_server(capsys, tmp_path):
    from eyas.launch.launch_config import load_config

    server = "python -m sglang.launch_server --model-path /m"
    out = _from_shell(capsys, f"NCCL_PROTO=LL NCCL_ALGO=Ring \\ \n{server} \\\n  --tp-size 8\n",
                      "--write", str(tmp_path / "v.toml"))
    assert out.splitlines()[0] == ("as pasted, the line starts the sglang server, but without NCCL_PROTO=LL, "
                                   "NCCL_ALGO=Ring")
    config = load_config(tmp_path / "v.toml")
    assert config.env == {} and config.tp == 8  # what really runs; --as-intended adds the variables
    out = _from_shell(capsys, f"{server} \\ \n  --tp-size 8 \\\n  --port 8000\n", "--write", str(tmp_path / "f.toml"))
    first = out.splitlines()[0]
    assert first.startswith("as pasted, the line starts no server: the line ends in `\\ `") and "--tp-size 8" in first
    config = load_config(tmp_path / "f.toml")
    assert (config.tp, config.port, config.extra_args) == (8, 8000, [])  # never extra_args = [" "]
    out = _from_shell(capsys, f"{server} \\ --tp-size 8 \\ --port 8000", "--write", str(tmp_path / "b.toml"))
    assert out.startswith("as pasted, the line starts no server: arguments ' --tp-size', ' --port'")
    assert load_config(tmp_path / "b.toml").extra_args == []
    assert _from_shell(capsys, server).splitlines()[0] == "as pasted, the line starts the sglang server"


def test_from_shell_reads_vllm_api_server_and_carries_ssh_options(capsys):
    out = _from_shell(capsys, "ssh -p 2222 -i ~/.ssh/k -l ubuntu -o 'ServerAliveInterval 30' gpu1 "
                              "'python -m vllm.entrypoints.openai.api_server --model /m --tensor-parallel-size 2'")
    assert "as pasted, the line starts the vllm server" in out and 'backend = "vllm"' in out and "tp = 2" in out
    assert ("eyas launch CONFIG.toml --host ubuntu@gpu1 --ssh-option Port=2222 --ssh-option 'IdentityFile=~/.ssh/k' "
            "--ssh-option ServerAliveInterval=30") in out


def test_from_shell_leaves_unnamed_speculative_numbers_to_the_engine(capsys):
    from eyas.launch.from_shell import SGLANG_TOPK1_WARNING, import_line
    from eyas.launch.launch_backends import build_command

    line = ("python -m sglang.launch_server --model-path /m --speculative-algorithm EAGLE3 "
            "--speculative-draft-model-path /d")
    imported = import_line(line)
    config = imported.config()
    assert (config.spec_steps, config.spec_topk, config.spec_draft_tokens) == (None, None, None)
    assert "names no speculative numbers" in imported.explain() and "SGLang's defaults" in imported.explain()
    assert not any(a.startswith("--speculative-num") or a == "--speculative-eagle-topk"
                   for a in build_command(config, "python"))
    vllm = import_line("vllm serve /m --speculative-config '{\"method\": \"eagle3\", \"model\": \"/d\"}'").config()
    assert vllm.spec_steps is None and '"num_speculative_tokens"' not in " ".join(build_command(vllm, "python"))
    # SGLang turns draft tokens 3 at topk 1 and 3 steps into 4, with a warning: the launch config does the same,
    # and says so.
    imported = import_line(f"{line} --speculative-eagle-topk 1 --speculative-num-steps 3 "
                           f"--speculative-num-draft-tokens 3")
    config = imported.config()
    assert (config.spec_steps, config.spec_topk, config.spec_draft_tokens) == (3, 1, 4)
    assert SGLANG_TOPK1_WARNING in imported.explain()


def test_clip_command_cuts_between_arguments_only():
    from eyas.shell.shell import clip_command

    argv = ["python3", "-m", "sglang.launch_server", "--model-path", "/shared/kimi k2.5", "--tp-size", "8"]
    assert clip_command(argv, 500) == " ".join(quote(a) for a in argv)
    short = clip_command(argv, 50)
    assert short == "python3 -m sglang.launch_server --model-path ... (+3 more arguments)"
    assert clip_command(["x" * 300], 10) == "x" * 300  # one argument longer than the width is still whole
