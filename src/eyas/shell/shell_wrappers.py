"""What each simple command of a pasted line hands its program.

Bash rules modelled here: leading NAME=value words are a per-command environment; `A=1;` alone sets an unexported
shell variable; `export` makes it reach later programs. Then the wrappers people put in front of servers: nohup,
setsid, nice, timeout, ... pass everything through but take their first argument as the program (so
`nohup A=1 python` runs a program called "A=1"); `env` adds, unsets or clears (-i); `sudo` resets the environment
unless told otherwise; `ssh host cmd...` joins its words with spaces and hands them to a remote shell, carrying no
local variables; `bash -c STRING` is a new shell that inherits everything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from eyas.shell.shell_command import Command, Dropped, SimpleCommand, split_simple_commands
from eyas.shell.shell_lexer import Word, tokenize

_NAME_EQ = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")

# wrapper -> (options that take a separate argument, positional arguments before the program)
_WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "nohup": (frozenset(), 0),
    "setsid": (frozenset(), 0),
    "exec": (frozenset({"-a"}), 0),
    "time": (frozenset({"-f", "-o"}), 0),
    "nice": (frozenset({"-n"}), 0),
    "stdbuf": (frozenset({"-i", "-o", "-e"}), 0),
    "timeout": (frozenset({"-s", "-k"}), 1),
    "taskset": (frozenset(), 1),
}
_SSH_FLAGS_WITH_ARG = set("BbcDEeFIiJLlmOopQRSWw")
# ssh's own flags for settings a launch needs again, as the `-o` options eyas passes with --ssh-option.
_SSH_OPTION_OF = {"p": "Port", "i": "IdentityFile", "J": "ProxyJump", "c": "Ciphers", "m": "MACs",
                  "b": "BindAddress", "B": "BindInterface", "S": "ControlPath"}
_SSH_SWITCHES = {"4": "AddressFamily=inet", "6": "AddressFamily=inet6", "A": "ForwardAgent=yes", "C": "Compression=yes"}
_SUDO_FLAGS_WITH_ARG = set("ughprtTCDRU")
_SHELLS = {"bash", "sh", "zsh", "dash", "ksh"}


@dataclass
class Context:
    """Findings that belong to the whole line rather than one command, shared by nested shells."""

    dropped: list[Dropped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def run_simple_commands(simples: list[SimpleCommand], host: str | None, exported: dict[str, str],
                        ctx: Context) -> list[Command]:
    exported = dict(exported)
    unexported: dict[str, str] = {}
    commands: list[Command] = []
    broken_above: Command | None = None  # the command whose line ended in `\\ `+newline: later flag lines are its
    for simple in simples:
        words, wrappers = list(simple.words), []
        if any(w.expands for w in words):
            ctx.note("$VAR, $(...), `...` and ~ are shown unexpanded")
        if words and words[0].text == "time" and not any(words[0].quoted):
            # `time` is a bash keyword here, not a program: NAME=value words after it are still assignments.
            words, wrappers = [w for w in words[1:2] if w.text != "-p"] + words[2:], ["time"]
        prefix: dict[str, str] = {}
        while words and (assign := words[0].assignment()):
            prefix[assign[0]] = assign[1]
            words.pop(0)
        if not words:
            for k, v in prefix.items():
                (exported if k in exported else unexported)[k] = v
            continue
        if words[0].text == "export":
            for w in words[1:]:
                m = _NAME_EQ.match(w.text)
                if m:
                    exported[m.group(1)] = w.text[m.end():]
                    unexported.pop(m.group(1), None)
                elif w.text in unexported:
                    exported[w.text] = unexported.pop(w.text)
            continue
        if words[0].text == "unset":
            for w in words[1:]:
                exported.pop(w.text, None)
                unexported.pop(w.text, None)
            continue
        cmd = Command(argv=[], env={**exported, **prefix}, host=host, wrappers=wrappers,
                      redirections=list(simple.redirections), background=simple.terminator == "&")
        if _blank(words[0]):
            _blank_command(cmd, words, prefix, simple.terminator)
            commands.append(cmd)
            continue
        if broken_above is not None and words[0].text.startswith("-") and not any(words[0].quoted):
            cmd.argv = [w.text for w in words]
            cmd.problem = (f"'{words[0].text}' is a flag, not a program: the shell fails with 'command not found'. "
                           f"It was meant for `{broken_above.program}` above, whose line ends in `\\ ` instead of "
                           f"`\\`")
            broken_above.problem += f" {' '.join(w.text for w in words)}"
            commands.append(cmd)
            continue
        broken_above = None
        unwrapped = _unwrap(cmd, words, ctx)
        if len(unwrapped) == 1 and unwrapped[0] is cmd and cmd.argv and not cmd.problem:
            if _stray_escapes(cmd, words[len(words) - len(cmd.argv):], simple.terminator):
                broken_above = cmd if simple.terminator == "\n" else None
        commands.extend(unwrapped)
    for k, v in unexported.items():
        ctx.dropped.append(Dropped(k, v, f"`{k}=...` stands alone (ended by ';' or a newline): it sets a shell "
                                         f"variable that is not exported, so programs started later on the line do "
                                         f"not receive it (write `export {k}=...` or put it in front of the command)"))
    return commands


def _blank(word: Word) -> bool:
    """A word that is only escaped blanks: what `\\ ` (or `\\<tab>`) alone makes."""
    return bool(word.text) and not word.text.strip() and all(word.quoted)


def _blank_command(cmd: Command, words: list[Word], prefix: dict[str, str], terminator: str) -> None:
    """`A=1 B=2 \\ ` then a newline: the assignments belong to a command named ' ', which is never found."""
    cmd.argv = [w.text for w in words]
    line_end = terminator == "\n" and len(words) == 1
    where = ("the `\\ ` at the end of the line escapes the space, not the newline, so the line is a command of "
             "its own" if line_end else "a `\\ ` makes a word of a lone space")
    cmd.problem = (f"the command name is {words[0].text!r}: {where}, and the shell fails with 'command not found'")
    cmd.dropped += [Dropped(k, v, f"set only for the command {words[0].text!r}, which fails ({where}); a program "
                                  f"started on a later line never gets it (delete the space after the backslash)")
                    for k, v in prefix.items()]


def _stray_escapes(cmd: Command, words: list[Word], terminator: str) -> bool:
    """Arguments a `\\ ` or `\\<tab>` made: a lone ' ', or a flag with a space glued on (' --tp-size').

    The server's argument parser reads neither as a flag and rejects the stray word, so the server exits at once.
    Records why on `cmd` and returns True when there is one.
    """
    blank_at_end = terminator == "\n" and _blank(words[-1])
    glued = [w.text for w in words[1:] if w.escaped_leading_space and w.text.strip()]
    if blank_at_end:
        cmd.problem = (f"the line ends in `\\ `: the backslash escapes the space, not the newline, so the command "
                       f"ends there with a stray {words[-1].text!r} argument (its parser rejects it and exits) and "
                       f"the flags on the next lines never reach it:")
    elif glued or any(_blank(w) for w in words[1:]):
        shown = ", ".join(repr(g) for g in glued) or "' '"
        cmd.problem = (f"arguments {shown} start with a blank that a `\\ ` escaped (a `\\`+newline continuation "
                       f"joined into one line): the parser does not read them as flags, rejects them and exits")
    return bool(cmd.problem)


def _unwrap(cmd: Command, words: list[Word], ctx: Context) -> list[Command]:
    while words:
        if _command_name_trap(cmd, words):
            break
        base = words[0].text.rsplit("/", 1)[-1]
        if base in _WRAPPERS:
            n = _skip_options(words, *_WRAPPERS[base])
            cmd.wrappers.append(" ".join(w.text for w in words[:n]))
            words = words[n:]
        elif base == "env":
            words = _env(cmd, words, ctx)
        elif base == "sudo":
            words = _sudo(cmd, words)
        elif base == "ssh":
            return _ssh(cmd, words, ctx)
        elif base in _SHELLS and (inner := _shell_c(cmd, words, ctx)) is not None:
            return inner
        else:
            break
    cmd.argv = [w.text for w in words]
    return [cmd]


def _command_name_trap(cmd: Command, words: list[Word]) -> bool:
    """A word that reads as NAME=value but sits where the program name goes; records why and returns True."""
    w0 = words[0]
    looks = w0.looks_like_assignment()
    if not looks:
        return False
    name, value = looks
    later = [w.text.strip() for w in words[1:]
             if not w.looks_like_assignment() and w.text.strip() not in _WRAPPERS]
    intended = f"`{later[0]}`" if later else "the intended program"
    if w0.escaped_leading_space:
        reason = (f"the `\\ ` before it escapes the space, so the shell reads '{w0.text}' (leading space "
                  f"included) as the command name, not as an assignment")
        cmd.problem = (f"the command name is '{w0.text}' (a `\\ ` glued a space to it): the shell fails with "
                       f"'command not found' and {intended} never starts. `\\`+newline line continuations turn "
                       f"into this when a paste joins the lines: delete those backslashes")
    elif w0.assignment() is None:
        reason = f"part of '{name}=' is quoted, so the shell reads '{w0.text}' as the command name"
        cmd.problem = f"the command name is '{w0.text}': the shell fails with 'command not found'"
    elif cmd.wrappers:
        wrapper = cmd.wrappers[-1].split()[0]
        reason = (f"`{wrapper}` takes its first argument as the program, so '{w0.text}' is a program name, not "
                  f"an assignment (write `{wrapper} env {name}=...`)")
        cmd.problem = f"`{wrapper}` tries to run a program called '{w0.text}' and fails"
    else:
        return False
    cmd.dropped.append(Dropped(name, value, reason))
    for w in words[1:]:  # the NAME=value words glued on after it are only arguments of the failed command
        more = w.looks_like_assignment()
        if not more:
            break
        cmd.dropped.append(Dropped(more[0], more[1], f"'{w.text}' comes after the command name '{w0.text}', so "
                                                     f"it is passed as an argument, not set"))
    return True


def _skip_options(words: list[Word], with_arg: frozenset[str], positional: int) -> int:
    i = 1
    while i < len(words) and words[i].text.startswith("-") and words[i].text != "-":
        text = words[i].text
        i += 1
        if text == "--":
            break
        if text in with_arg:
            i += 1
    return min(i + positional, len(words))


def _env(cmd: Command, words: list[Word], ctx: Context) -> list[Word]:
    i, label = 1, ["env"]
    while i < len(words) and words[i].text.startswith("-"):
        text = words[i].text
        i += 1
        if text == "--":
            break
        if text in ("-i", "-", "--ignore-environment"):
            label.append("-i")
            cmd.dropped += [Dropped(k, v, "`env -i` starts the program with an empty environment")
                            for k, v in cmd.env.items()]
            cmd.env, cmd.inherits_env = {}, False
        elif text in ("-u", "--unset") or text.startswith(("-u", "--unset=")):
            if text in ("-u", "--unset"):
                name, i = (words[i].text if i < len(words) else ""), i + 1
            else:
                name = text.split("=", 1)[1] if text.startswith("--") else text[2:]
            if name in cmd.env:
                cmd.dropped.append(Dropped(name, cmd.env.pop(name), "removed by `env -u`"))
        elif text in ("-C", "--chdir"):
            i += 1
        elif text in ("-S", "--split-string") or text.startswith("-S"):
            ctx.note("`env -S` splitting is not modelled")
    while i < len(words) and "=" in words[i].text and not words[i].text.startswith("="):
        name, value = words[i].text.split("=", 1)
        cmd.env[name] = value
        i += 1
    cmd.wrappers.append(" ".join(label))
    return words[i:]


def _sudo(cmd: Command, words: list[Word]) -> list[Word]:
    i, keep_all, keep, login = 1, False, set(), False
    while i < len(words) and words[i].text.startswith("-"):
        text = words[i].text
        i += 1
        if text == "--":
            break
        if text == "--preserve-env":
            keep_all = True
        elif text.startswith("--preserve-env="):
            keep |= set(text.split("=", 1)[1].split(","))
        elif text == "--login":
            login = True
        elif text.startswith("--"):
            i += text in ("--user", "--group", "--host", "--prompt", "--chdir", "--chroot", "--other-user")
        else:
            for j, ch in enumerate(text[1:]):
                keep_all |= ch == "E"
                login |= ch == "i"
                if ch in _SUDO_FLAGS_WITH_ARG:
                    i += j + 2 == len(text)  # the argument is the next word unless glued on (-uroot)
                    break
    for k in list(cmd.env):
        if login:
            why = "`sudo -i` starts a login shell with a fresh environment"
        elif k.startswith("LD_"):
            why = "sudo removes LD_* variables even with -E (they are on its env_delete list)"
        elif keep_all or k in keep:
            continue
        else:
            why = ("sudo resets the environment (env_reset, the default), so variables set before `sudo` are "
                   "dropped; use `sudo -E`, `sudo --preserve-env=NAME` or `sudo NAME=value cmd`")
        cmd.dropped.append(Dropped(k, cmd.env.pop(k), why))
    cmd.inherits_env = keep_all and not login
    while i < len(words) and (m := _NAME_EQ.match(words[i].text)):
        cmd.env[m.group(1)] = words[i].text[m.end():]  # sudo sets these itself (if sudoers allows SETENV)
        i += 1
    cmd.wrappers.append(" ".join(w.text for w in words[:1]) + (" -E" if keep_all else ""))
    return words[i:]


def _ssh(cmd: Command, words: list[Word], ctx: Context) -> list[Command]:
    i, options, user = 1, [], None
    while i < len(words) and words[i].text.startswith("-"):
        text = words[i].text
        i += 1
        if text == "--":
            break
        for j, ch in enumerate(text[1:]):
            if ch in _SSH_SWITCHES:
                options.append(_SSH_SWITCHES[ch])
            if ch in _SSH_FLAGS_WITH_ARG:
                glued = text[j + 2:]
                value = glued or (words[i].text if i < len(words) else "")
                i += not glued
                if ch == "l":
                    user = value
                elif ch in _SSH_OPTION_OF:
                    options.append(f"{_SSH_OPTION_OF[ch]}={value}")
                elif ch == "o":
                    options.append("=".join(value.split(None, 1)) if "=" not in value else value)
                elif ch == "F":
                    ctx.note(f"ssh -F {value}: eyas passes no config file; give its settings as --ssh-option")
                break
    if i + 1 >= len(words):  # no remote command: an interactive login, ssh itself is the program
        cmd.argv = [w.text for w in words]
        return [cmd]
    host = words[i].text
    if user and "@" not in host:
        host = f"{user}@{host}"
    ctx.dropped += [Dropped(k, v, f"ssh does not carry local variables to the command on {host} (only names in "
                                  f"SendEnv/AcceptEnv, off by default): set them inside the remote command")
                    for k, v in cmd.env.items()]
    if cmd.redirections or cmd.background:
        ctx.note(f"{' '.join(cmd.redirections + (['&'] if cmd.background else []))} applies to ssh on this machine")
    # ssh joins its remaining words with spaces and the remote login shell parses the result again.
    remote = " ".join(w.text for w in words[i + 1:])
    inner = run_simple_commands(split_simple_commands(tokenize(remote)), host, {}, ctx)
    for c in inner:
        c.wrappers = cmd.wrappers + [f"ssh {host}"] + c.wrappers
        c.ssh_options = options + c.ssh_options
    return inner


def _shell_c(cmd: Command, words: list[Word], ctx: Context) -> list[Command] | None:
    """`bash -c STRING`: a new shell that inherits cmd.env; None when it is not a -c invocation."""
    has_c, i = False, 1
    while i < len(words) and words[i].text.startswith("-"):
        has_c |= not words[i].text.startswith("--") and "c" in words[i].text
        i += 1
    if not has_c or i >= len(words):
        return None
    inner = run_simple_commands(split_simple_commands(tokenize(words[i].text)), cmd.host, cmd.env, ctx)
    for c in inner:
        c.wrappers = cmd.wrappers + [f"{words[0].text} -c"] + c.wrappers
        c.inherits_env = c.inherits_env and cmd.inherits_env
    return inner
