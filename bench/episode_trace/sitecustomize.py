"""Which functions of the project's library files run in this process, and when: `bench/episode_files.py`'s
recorder. Python imports this at start-up from any folder on PYTHONPATH; it does nothing unless
``EPISODE_FILES_TRACE_DIR`` is set, and then it records, in every thread, each call of a function defined in a
file under one of ``EPISODE_FILES_ROOTS`` (os.pathsep-separated folders).

What is recorded, per (function, its caller, 100 ms bucket of wall time): the first and the last call's wall
time, so a reader can tell exactly whether a function ran in any window longer than a bucket. The caller is the
nearest library function on the thread's stack; for the outermost library call of a thread, the library
function that handed the thread its work (started the thread, or submitted the work item to a
``concurrent.futures.ThreadPoolExecutor``: Prefect's task runners, the project's own pools), marked as a hop.
Stacks are stitched across those hops the same way (the thread's library frames, then the stack that handed it
its work). Two kinds of stacks are kept, per 100 ms: those from which Ray actor methods are sent
(``ActorMethod._remote``), with the method's name and its leading text arguments (a generic entry such as
``Worker.run(model, method, ...)`` is told apart by them); and those of each call of the functions named in
``EPISODE_FILES_STACKS`` (``file:qualname``, comma-separated: the loss), with the thread's outermost library
function and its leading text arguments. Matching the two ties the driver's call path to what runs in an actor.
And the start and end of each call that enters the library from outside (Ray calling an actor method, a
non-library thread calling back), with its leading text arguments: what ran during the actor call that reached
the loss.

Threads a C library starts (not through ``threading``) run without the tracer (``sys.settrace`` cannot reach
them); every flush samples all threads' stacks and writes the library frames of any untraced thread, so a
reader knows whether it missed any.

How: ``sys.settrace`` and ``threading.settrace`` with a global trace function that returns None (no line events):
one Python call per Python call, and no result changes. A daemon thread appends what is new to
``<dir>/trace-<pid>.tsv`` every ``EPISODE_FILES_FLUSH_S`` seconds (0.5) and at exit: Ray kills its workers
without running atexit, so the file must be current all along. A forked child writes a file of its own.

Lines of the file, tab-separated:
    P  pid  ppid  command line (space-joined; Ray's process title once it sets one)
    C  code id  file (relative to the roots' parent)  qualified name  first line  m (module body), c (class body) or
       f (function, lambda, comprehension)
    E  callee code id  caller code id (or -)  hop (1: the caller handed this thread its work)  bucket  first  last
    R  method  text arguments (JSON)  first  code ids of the stitched library stack, innermost first (comma-joined)
    S  code id of the outermost frame  its text arguments (JSON)  first  code ids of the stitched stack (as R)
    X  code id of a call with no library caller (nor hand-over)  its text arguments (JSON)  start  end
    U  thread id  time  code ids of the library frames of an untraced thread, innermost first (comma-joined)
"""

import os
import sys

_DIR = os.environ.get("EPISODE_FILES_TRACE_DIR")
_MAX_CHAIN = 400  # frames of a stitched stack kept (a pool thread submitting to itself nests one level a time)


def _command_line() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return " ".join(sys.argv)


def _install(out_dir: str, roots: list[str]) -> None:
    import atexit
    import json
    import threading
    import time

    roots = [os.path.join(os.path.abspath(r), "") for r in roots]
    base = os.path.dirname(os.path.dirname(roots[0]))  # file names relative to the checkout
    # the non-library functions the recorder watches (negative ids): a Ray actor method sent, work handed over
    special = {(os.path.join("ray", "actor.py"), "ActorMethod._remote"): -1,
               (os.path.join("concurrent", "futures", "thread.py"), "ThreadPoolExecutor.submit"): -2,
               (os.path.join("concurrent", "futures", "thread.py"), "_WorkItem.run"): -3,
               ("threading.py", "Thread.start"): -4}
    now = time.time
    get_ident = threading.get_ident
    active = threading._active  # read only: threading.current_thread() would register C threads as dummies
    codes: dict = {}  # code object -> id (> 0 library code, 0 other code, < 0 special)
    names: list = []  # id - 1 -> (file, qualname, line, kind)
    calls: dict = {}  # (callee, caller, hop, bucket) -> [first, last]
    remotes: dict = {}  # (method, its leading text arguments, stitched stack, bucket) -> first
    targets = set(os.environ.get("EPISODE_FILES_STACKS", "").split(","))  # "file:qualname" whose stacks to keep
    target_ids: set = set()
    stacks: dict = {}  # (target, stitched stack, `entry`, bucket) -> first
    entries: dict = {}  # (code id, `arguments`, start) -> end of each call from outside the library
    handed: dict = {}  # id(work item's fn or Thread) -> the stitched stack that handed it over
    parents: dict = {}  # thread id -> (id of its Thread object, the stitched stack that handed it its work)
    traced: set = set()  # thread ids that ran under the tracer
    naming = threading.Lock()
    state = {"pid": os.getpid(), "codes": 0, "written": {}, "remotes": set(), "stacks": set(), "entries": set(),
             "untraced": set(), "title": None}

    def classify(code) -> int:
        path = code.co_filename
        cid = 0
        for root in roots:
            if path.startswith(root):
                with naming:  # once per code object; two threads must not get each other's id
                    cid = codes.get(code) or 0
                    if not cid:
                        kind = "m" if code.co_name == "<module>" else "f" if code.co_flags & 2 else "c"  # NEWLOCALS
                        names.append((os.path.relpath(path, base), code.co_qualname, code.co_firstlineno, kind))
                        cid = len(names)
                        if f"{names[-1][0]}:{code.co_qualname}" in targets:
                            target_ids.add(cid)
                break
        else:
            for (suffix, qualname), sid in special.items():
                if code.co_qualname == qualname and path.endswith(os.sep + suffix):
                    cid = sid
        codes[code] = cid
        return cid

    def chain(ident: int) -> tuple:
        """The stitched stack that handed this thread its current work ((): none known)."""
        thread = active.get(ident)
        entry = parents.get(ident)
        if entry is None or entry[0] != id(thread):  # a thread seen first, or a new one with a reused id
            entry = (id(thread), handed.pop(id(thread), ()) if thread is not None else ())
            parents[ident] = entry
        return entry[1]

    def own(frame) -> tuple:
        """The library frames of a stack, innermost first."""
        out = []
        while frame is not None:
            cid = codes.get(frame.f_code)
            if cid is None:
                cid = classify(frame.f_code)
            if cid > 0:
                out.append(cid)
            frame = frame.f_back
        return tuple(out)

    def stitched(frame, ident: int) -> tuple:
        return (own(frame) + chain(ident))[:_MAX_CHAIN]

    def texts(values) -> tuple:
        """The leading text values of a call's arguments (which model and method a generic entry serves)."""
        out = []
        for v in values:
            if not isinstance(v, str) or len(out) == 4:
                break
            out.append(v[:80])
        return tuple(out)

    def arguments(frame) -> tuple:
        """`texts` of a frame's arguments (at its call: what it was called with)."""
        code, local = frame.f_code, frame.f_locals
        params = code.co_varnames[:code.co_argcount]
        if params and params[0] in ("self", "cls"):
            params = params[1:]
        return texts(local.get(p) for p in params)

    def entry(frame) -> tuple:
        """The thread's outermost library frame (what Ray or a pool called): its code id and `arguments`."""
        outer = None
        while frame is not None:
            if codes.get(frame.f_code, 0) > 0:
                outer = frame
            frame = frame.f_back
        return (codes[outer.f_code], arguments(outer)) if outer is not None else (0, ())

    def tracer(frame, event, arg):
        code = frame.f_code
        cid = codes.get(code)
        if cid is None:
            cid = classify(code)
        if cid == 0:
            return None
        ident = get_ident()
        if cid < 0:
            if cid == -1:  # a Ray actor method sent: from which library stack
                local = frame.f_locals
                method = getattr(local.get("self"), "_method_name", "?")
                t = now()
                key = (method, texts(local.get("args") or ()), stitched(frame.f_back, ident), int(t * 10))
                if key not in remotes:
                    remotes[key] = t
            elif cid == -2:
                handed[id(frame.f_locals.get("fn"))] = stitched(frame.f_back, ident)
            elif cid == -3:
                fn = getattr(frame.f_locals.get("self"), "fn", None)
                parents[ident] = (id(active.get(ident)), handed.pop(id(fn), ()))
            else:
                handed[id(frame.f_locals.get("self"))] = stitched(frame.f_back, ident)
            return None
        t = now()
        traced.add(ident)
        caller, hop = 0, 0
        f = frame.f_back
        while f is not None:
            c = codes.get(f.f_code)
            if c is None:
                c = classify(f.f_code)
            if c > 0:
                caller = c
                break
            f = f.f_back
        if not caller:
            up = chain(ident)
            if up:
                caller, hop = up[0], 1
        key = (cid, caller, hop, int(t * 10))
        v = calls.get(key)
        if v is None:
            calls[key] = [t, t]
        else:
            v[1] = t
        if cid in target_ids:
            key = (cid, stitched(frame, ident), entry(frame), int(t * 10))
            if key not in stacks:
                stacks[key] = t
        if not caller:  # an entry from outside the library (Ray, a pool, Prefect): its end too
            args = arguments(frame)

            def ended(frame, event, arg):  # a local tracer: this frame's lines, and its return
                if event == "return":
                    entries[(cid, args, t)] = now()
                return ended

            return ended
        return None

    lock = threading.Lock()

    def flush() -> None:
        with lock:
            if state["pid"] != os.getpid():
                return
            lines = []
            title = _command_line()
            if title != state["title"]:
                state["title"] = title
                lines.append(f"P\t{os.getpid()}\t{os.getppid()}\t{title}\n")
            written, done_entries = state["written"], state["entries"]
            for key, (first, last) in calls.copy().items():
                if written.get(key) != last:
                    written[key] = last
                    callee, caller, hop, bucket = key
                    lines.append(f"E\t{callee}\t{caller or '-'}\t{hop}\t{bucket}\t{first!r}\t{last!r}\n")
            done = state["remotes"]
            for key, first in remotes.copy().items():
                if key not in done:
                    done.add(key)
                    method, args, stack, _ = key
                    lines.append(f"R\t{method}\t{json.dumps(args)}\t{first!r}\t{','.join(map(str, stack))}\n")
            for key, end in entries.copy().items():
                if key not in done_entries:
                    done_entries.add(key)
                    cid, args, start = key
                    lines.append(f"X\t{cid}\t{json.dumps(args)}\t{start!r}\t{end!r}\n")
            done = state["stacks"]
            for key, first in stacks.copy().items():
                if key not in done:
                    done.add(key)
                    _, stack, (outer, args), _ = key
                    lines.append(f"S\t{outer}\t{json.dumps(args)}\t{first!r}\t{','.join(map(str, stack))}\n")
            me = get_ident()
            for ident, frame in sys._current_frames().items():
                if ident in traced or ident == me:
                    continue
                stack = own(frame)
                if stack and (ident, stack) not in state["untraced"]:
                    state["untraced"].add((ident, stack))
                    lines.append(f"U\t{ident}\t{now()!r}\t{','.join(map(str, stack))}\n")
            n = len(names)  # the code table last: the stacks just sampled may have named more code
            for i in range(state["codes"], n):
                lines.append("C\t{}\t{}\t{}\t{}\t{}\n".format(i + 1, *names[i]))
            state["codes"] = n
            if lines:
                with open(os.path.join(out_dir, f"trace-{os.getpid()}.tsv"), "a") as f:
                    f.write("".join(lines))

    period = float(os.environ.get("EPISODE_FILES_FLUSH_S", "0.5"))

    def flusher() -> None:
        while True:
            time.sleep(period)
            try:
                flush()
            except Exception as exc:  # a recorder that fails must say so, not lose records silently
                with open(os.path.join(out_dir, f"trace-{os.getpid()}.error"), "a") as f:
                    f.write(f"{type(exc).__name__}: {exc}\n")

    def start() -> None:
        threading.Thread(target=flusher, name="episode-files-flush", daemon=True).start()

    def after_fork() -> None:  # the child's own file, with only its own calls
        calls.clear()
        remotes.clear()
        stacks.clear()
        entries.clear()
        traced.clear()
        parents.clear()
        state.update(pid=os.getpid(), codes=0, written={}, remotes=set(), stacks=set(), entries=set(), untraced=set(),
                     title=None)
        start()

    atexit.register(flush)
    os.register_at_fork(after_in_child=after_fork)
    threading.settrace(tracer)
    sys.settrace(tracer)
    start()


# Not in the Prefect server a run starts, nor in Ray's own daemons (dashboard, agents, monitors): they run none of
# the project's code, and tracing would only slow them. Ray's workers start as ray/_private/workers/*.py.
_NOT_TRACED = (" prefect server start", "/ray/dashboard/", "/ray/autoscaler/", "/ray/_private/log_monitor.py",
               "/ray/_private/runtime_env/agent/")
if _DIR and not any(part in _command_line() for part in _NOT_TRACED):
    _install(_DIR, os.environ.get("EPISODE_FILES_ROOTS", "").split(os.pathsep))
