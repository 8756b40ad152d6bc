"""Who serves a port, and what each process of a server started with, read on the serving host itself.

Usage (stdlib only: imported here, or its source fed on stdin to the host's Python over ssh):
    python - port 8000 [SNAPDIR]    < procprobe.py -> the process listening there, its parents, its process tree
    python - session SID [SNAPDIR]  < procprobe.py -> every process of a session (how `eyas launch` starts servers)

Each process comes with its command line and its starting environment, from one of two sources:
- "snapshot": the file the process wrote itself at interpreter start (eyas.launch.envhook puts that hook on a
  launched server's PYTHONPATH). It survives anything the process does to its memory later.
- "proc": /proc/PID/environ. vLLM's EngineCore and workers and SGLang's scheduler and detokenizer retitle
  themselves with the setproctitle library, which (unless SPT_NOENV is set) moves the environment and reuses its
  memory for the title: the file then holds the title and zeros.
- "memory": for such a process, the environment the library moved, as the process holds it now: libc's
  `__environ` array, found through libc's symbol table and read from /proc/PID/mem (which needs the right to
  trace the process: the same user, or root). It includes what the program itself set after it started.
A process none of these can read is reported as unreadable, with the reason; never as "every variable unset".
"""

import json
import os
import struct
import sys

HOOK_VAR = "EYAS_ENV_SNAPSHOT_DIR"  # where the interpreter-start hook writes its snapshots
OVERWRITTEN = ("overwritten: the process reused its environment's memory (setproctitle without SPT_NOENV "
               "retitles processes that way)")


def stat(pid):
    """{state, ppid, pgrp, session, starttime} of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or ')': split after the last one.
    fields = text.rsplit(")", 1)[1].split()
    return {"state": fields[0], "ppid": int(fields[1]), "pgrp": int(fields[2]), "session": int(fields[3]),
            "starttime": int(fields[19])}


def _pids():
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def parse_environ(raw):
    """(environment, None) from the bytes of /proc/PID/environ, or (None, why) when they are not one.

    A real environment is `KEY=VALUE` entries, each ended by one NUL. An empty entry or one without `=` inside the
    area means something else was written there (a process title and its zero padding)."""
    if not raw:
        return {}, None
    entries = raw[:-1].split(b"\0") if raw.endswith(b"\0") else raw.split(b"\0")
    env = {}
    for entry in entries:
        key, sep, value = entry.partition(b"=")
        if not sep or not key:
            return None, OVERWRITTEN
        env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env, None


def environ(pid):
    """(environment the process started with, None), or (None, why it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError as e:  # gone meanwhile, or another user's process
        return None, e.strerror or type(e).__name__
    return parse_environ(raw)


_SYMBOLS = {}  # libc path -> address of __environ relative to where libc is mapped


def _environ_symbol(path):
    """st_value of `__environ` in a 64-bit little-endian ELF's dynamic symbol table, or None."""
    if path not in _SYMBOLS:
        with open(path, "rb") as f:
            data = f.read()
        value = None
        if data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1:
            shoff, = struct.unpack_from("<Q", data, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
            sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
            for sh in sections:
                if sh[1] != 11:  # SHT_DYNSYM
                    continue
                strings = sections[sh[6]][4]
                for off in range(sh[4], sh[4] + sh[5], 24):
                    name, _, _, _, sym_value, _ = struct.unpack_from("<IBBHQQ", data, off)
                    if data[strings + name:data.index(b"\0", strings + name)] == b"__environ":
                        value = sym_value
                        break
        _SYMBOLS[path] = value
    return _SYMBOLS[path]


def memory_environ(pid, most=20000):
    """(the environment `pid` holds now, None) read from its libc's `__environ`, or (None, why not)."""
    try:
        libc = None
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                cols = line.split()
                if (len(cols) >= 6 and os.path.basename(cols[5]).startswith(("libc.so", "libc-"))
                        and int(cols[2], 16) == 0):
                    libc = int(cols[0].split("-")[0], 16), cols[5]
                    break
        if libc is None:
            return None, "no libc mapped"
        value = _environ_symbol(f"/proc/{pid}/root{libc[1]}")
        if value is None:
            return None, "no __environ in its libc"
        env = {}
        with open(f"/proc/{pid}/mem", "rb") as mem:
            def read(address, n):
                mem.seek(address)
                return mem.read(n)

            array, = struct.unpack("<Q", read(libc[0] + value, 8))
            for i in range(most):
                pointer, = struct.unpack("<Q", read(array + 8 * i, 8))
                if not pointer:
                    return env, None
                text = b""
                while b"\0" not in text and len(text) < 1 << 20:
                    text += read(pointer + len(text), 4096 - (pointer + len(text)) % 4096)
                key, _, val = text.split(b"\0", 1)[0].partition(b"=")
                env[key.decode(errors="replace")] = val.decode(errors="replace")
        return None, f"more than {most} entries"
    except (OSError, ValueError, struct.error, IndexError) as e:
        return None, getattr(e, "strerror", None) or type(e).__name__


def session(sid):
    """Live members of session `sid`, leader first; zombies run nothing and have no environment."""
    members = [(p, st) for p in _pids() for st in [stat(p)] if st and st["session"] == sid]
    return sorted((p for p, st in members if st["state"] not in ("Z", "X")), key=lambda p: (p != sid, p))


def tree(pid):
    """`pid` and all its live descendants, parents before children."""
    children = {}
    for p in _pids():
        st = stat(p)
        if st and st["state"] not in ("Z", "X"):
            children.setdefault(st["ppid"], []).append(p)
    out, queue = [], ([pid] if stat(pid) else [])
    while queue:
        p = queue.pop(0)
        out.append(p)
        queue += sorted(children.get(p, []))
    return out


def _socket_inodes(port):
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            # local_address is HEXADDR:HEXPORT; state 0A is LISTEN
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def listeners(port):
    """Pids holding a listening TCP socket on `port` (any address), found through their open file descriptors."""
    wanted = {f"socket:[{i}]" for i in _socket_inodes(port)}
    found = []
    for pid in _pids() if wanted else []:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    found.append(pid)
                    break
            except OSError:
                continue
    return sorted(found)


def snapshots(folder):
    """{pid: snapshot} of the hook's files in `folder`; a snapshot counts only for the process that wrote it."""
    out = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                snap = json.load(f)
            st = stat(snap["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if st and snap.get("starttime") == st["starttime"]:  # not an earlier process that had the same pid
            out[snap["pid"]] = snap
    return out


def describe(pids, folder=None):
    """Command line and starting environment of each pid, from its snapshot when there is one, else /proc."""
    found = {pid: environ(pid) for pid in pids}
    if folder is None:  # a server eyas launched names the folder in the environment of its readable processes
        folder = next((env[HOOK_VAR] for env, _ in found.values() if env and env.get(HOOK_VAR)), None)
    snaps = snapshots(folder) if folder else {}
    out = []
    for pid in pids:
        st = stat(pid) or {}
        env, problem = found[pid]
        proc = {"pid": pid, "ppid": st.get("ppid"), "cmdline": cmdline(pid)}
        if pid in snaps:
            proc.update(env=snaps[pid].get("env", {}), env_source="snapshot",
                        argv=" ".join(snaps[pid].get("argv") or []))
            if problem:
                proc["proc_environ"] = problem
        elif env is not None:
            proc.update(env=env, env_source="proc")
        elif problem == OVERWRITTEN:
            live, why = memory_environ(pid)
            if live is not None:
                proc.update(env=live, env_source="memory", proc_environ=problem)
            else:
                proc["error"] = f"{problem}; its memory could not be read either ({why})"
        else:
            proc["error"] = problem
        out.append(proc)
    return out


def parents(pid, limit=8):
    """The chain above `pid` (nearest first) with command lines: how it was started (a shell, nohup, ssh)."""
    out, st = [], stat(pid)
    while st and st["ppid"] > 1 and len(out) < limit:
        out.append({"pid": st["ppid"], "cmdline": cmdline(st["ppid"])})
        st = stat(st["ppid"])
    return out


def port_owner(port, folder=None):
    """The process tree listening on `port`: its root is the listener whose parent is not one."""
    pids = listeners(port)
    if not pids:
        return {"port": port, "listeners": []}
    ppids = {p: (stat(p) or {}).get("ppid") for p in pids}
    root = next((p for p in pids if ppids[p] not in pids), pids[0])
    return {"port": port, "listeners": pids, "root": root, "parents": parents(root),
            "processes": describe(tree(root), folder)}


def answer(action, args):
    """The report for one action: `port PORT [SNAPDIR]`, `session SID [SNAPDIR]` or `listeners PORT`."""
    folder = args[1] if len(args) > 1 else None
    if action == "port":
        return port_owner(int(args[0]), folder)
    if action == "session":
        return describe(session(int(args[0])), folder)
    if action == "listeners":
        return listeners(int(args[0]))
    raise SystemExit(f"procprobe: unknown action {action!r}")


def main(argv):
    print(json.dumps(answer(argv[0], argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
