"""The tool layer (issue 29 item 3): tool-call parsing, the calculator, the Python sandbox's limits, the registry.

The sandbox tests run real untrusted-looking code (an infinite loop, a 4 GiB allocation, a fork bomb, sockets,
reading the driver's secrets) inside the sandbox only, with small limits, and check the driver afterwards.
"""

import json
import os
import socket
import subprocess
import threading
import time

import pytest

from chatlearn.tools.calculator import calculate
from chatlearn.tools.calls import CallError, ToolCall, parse_tool_calls, render_tool_response, tool_message
from chatlearn.tools.registry import default_registry
from chatlearn.tools.sandbox import Sandbox

SCHEMAS = {"calculator": {"type": "object", "properties": {"expression": {"type": "string"}},
                          "required": ["expression"], "additionalProperties": False}}


def call(name, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---------------------------------------------------------------- parsing


def test_parses_one_and_several_calls_in_order():
    text = "Let me compute.\n" + call("calculator", {"expression": "1+1"}) + "\nand\n" + \
        call("calculator", {"expression": "2*3"})
    calls = parse_tool_calls(text, SCHEMAS)
    assert calls == [ToolCall("calculator", {"expression": "1+1"}, calls[0].raw),
                     ToolCall("calculator", {"expression": "2*3"}, calls[1].raw)]
    assert parse_tool_calls("no calls here", SCHEMAS) == []


def test_arguments_written_as_a_json_string_are_accepted():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
    assert parse_tool_calls(text, SCHEMAS) == [ToolCall("calculator", {"expression": "3"}, text[11:-12])]


@pytest.mark.parametrize("body, says", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
    ('["calculator"]', "must be a JSON object, got list"),
    ('{"arguments": {"expression": "1"}}', 'no "name"'),
    ('{"name": "search", "arguments": {}}', "unknown tool 'search'; the tools are 'calculator'"),
    ('{"name": "calculator", "arguments": {}}', "missing required argument(s) 'expression'"),
    ('{"name": "calculator", "arguments": {"expression": 1}}', "'expression' must be of type string, got int"),
    ('{"name": "calculator", "arguments": {"expression": "1", "x": 2}}', "has no argument(s) 'x'"),
    ('{"name": "calculator", "arguments": [1]}', "must be a JSON object, got list"),
    ('{"name": "calculator", "arguments": "not json"}', "string that is not a JSON object"),
    ('{"name": "calculator", "arguments": {"expression": "1"}, "id": 3}', "unexpected key(s) 'id'"),
])
def test_a_malformed_call_is_an_observation_saying_what_is_wrong(body, says):
    [parsed] = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>", SCHEMAS)
    assert isinstance(parsed, CallError)
    assert parsed.observation.startswith("Error: ") and says in parsed.observation, parsed.observation


def test_an_unclosed_block_is_an_error_and_does_not_swallow_the_next_call():
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}\n' + \
        call("calculator", {"expression": "2"}) + '\n<tool_call>{"name": "calculator"'
    parsed = parse_tool_calls(text, SCHEMAS)
    assert [type(p) for p in parsed] == [CallError, ToolCall, CallError]
    assert "not closed" in parsed[0].observation and parsed[1].arguments == {"expression": "2"}


def test_tool_results_render_in_the_templates_format():
    assert render_tool_response("4") == "<tool_response>\n4\n</tool_response>"
    assert tool_message("4", "calculator") == {"role": "tool", "content": "4", "name": "calculator"}


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize("expr, value", [("1+2*3", "7"), ("(1+2)*3", "9"), ("7/2", "3.5"), ("7//2", "3"),
                                         ("-7 % 3", "2"), ("2**10", "1024"), ("2**3**2", "512"), ("-2**2", "-4"),
                                         ("2**-1", "0.5"), ("1.5e3 + 0.5", "1500.5"), ("10**100", str(10**100))])
def test_calculator_values_and_precedence(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr, says", [
    ("1/0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"), ("9**9**9", "exponent"), ("10**101", "larger than"),
    ("(10**60)*(10**60)", "larger than"), ("1e400", "not a finite number"), ("(-8)**0.5", "not a real number"),
    ("__import__('os').system('x')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("'a' * 3", "literal 'a' is not allowed"), ("1 < 2", "Compare is not allowed"), ("1 +", "not a valid"),
    ("1" + "+1" * 300, "longer than"), ("True + 1", "literal True"), ("2 << 3", "operator LShift"),
])
def test_calculator_refuses_with_a_message_and_quickly(expr, says):
    start = time.monotonic()
    out = calculate(expr)
    assert time.monotonic() - start < 0.5
    assert out.startswith("Error: ") and says in out, out


# ---------------------------------------------------------------- the sandbox


def nobody_processes(uid: int = 65534) -> list[str]:
    out = subprocess.run(["ps", "-u", str(uid), "-o", "pid=,stat=,args="], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def box():
    return Sandbox(cpu_seconds=2, timeout=8, memory_bytes=256 << 20, max_processes=16, output_bytes=4096)


@pytest.fixture(scope="module")
def isolation(box):
    return box.isolation


def needs(isolation, *names):
    missing = [n for n in names if not isolation[n]]
    if missing:
        pytest.skip(f"not enforceable on this machine: {missing} (reported by Sandbox.isolation)")


def test_normal_code_prints_its_result_in_a_fresh_scratch_dir(box):
    r = box.run("import os\nprint(sum(range(10)))\nopen('f.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    assert r.ok and r.output == "45\n['f.txt', 'main.py']\n"
    assert r.observation() == "45\n['f.txt', 'main.py']"
    r = box.run("import os\nprint(sorted(os.listdir('.')))")  # the next call starts clean
    assert r.output == "['main.py']\n"


def test_an_exception_is_the_observation(box):
    r = box.run("1/0")
    assert r.exit_code == 1 and "ZeroDivisionError" in r.observation() and "[exit code 1]" in r.observation()


def test_the_scratch_dir_is_removed_afterwards(box, monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    r = box.run("open('left.txt', 'w').write('x' * 1000)\nprint('ok')")
    assert r.output == "ok\n" and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    # the wall clock far above the CPU limit: a loaded machine gives the loop a fraction of a core (2 CPU-s took
    # 8.1 s of wall beside another suite), and the wall clock must not be what stops it
    box = Sandbox(cpu_seconds=2, timeout=60)
    r = box.run("while True:\n    pass")
    assert not r.timed_out
    assert r.signal == 9 and "[killed: CPU time or resource limit]" in r.observation()


def test_a_sleeping_program_is_stopped_by_the_wall_clock():
    start = time.monotonic()
    r = Sandbox(timeout=1.5).run("import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert 1.4 < time.monotonic() - start < 5 and r.timed_out
    assert r.observation() == "started\n[stopped: wall-clock timeout]"


def test_a_memory_bomb_is_a_memory_error_and_the_driver_is_unaffected(box):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = box.run("x = bytearray(4 << 30)\nprint('allocated')")
    assert "MemoryError" in r.observation() and "allocated" not in r.output
    r = box.run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")  # a growing one, too
    assert "MemoryError" in r.observation()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB: the driver did not grow


@pytest.mark.slow
def test_a_fork_bomb_is_contained_and_nothing_is_left(box, isolation):
    needs(isolation, "unprivileged_uid")
    assert nobody_processes() == []
    start = time.monotonic()
    r = Sandbox(cpu_seconds=2, timeout=3, max_processes=16).run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert time.monotonic() - start < 6 and (r.timed_out or r.signal == 9)
    assert nobody_processes() == []  # every forked process is gone (and reaped: no zombies)
    assert box.run("print('next call fine')").output == "next call fine\n"


def test_forks_are_refused_past_the_process_limit(box, isolation):
    needs(isolation, "unprivileged_uid")
    r = box.run("import os, time\nkids = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
                "    except OSError as e:\n        print('refused after', kids, type(e).__name__)\n        break\n"
                "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    kids += 1")
    assert "refused after" in r.output and "BlockingIOError" in r.output
    assert int(r.output.split()[2]) < 16
    assert nobody_processes() == []


def test_a_child_that_escapes_its_session_dies_with_the_call(box, isolation):
    needs(isolation, "pid_namespace", "unprivileged_uid")
    r = box.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')")
    assert r.output == "parent done\n" and r.seconds < 5
    assert nobody_processes() == []


@pytest.fixture
def loopback_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


def test_no_network_not_even_the_drivers_loopback(box, isolation, loopback_server):
    needs(isolation, "network_namespace")
    port, accepted = loopback_server
    probe = socket.create_connection(("127.0.0.1", port), timeout=2)  # the server works from the driver
    probe.close()
    time.sleep(0.3)
    assert len(accepted) == 1
    r = box.run(f"import socket\ns = socket.socket()\ns.settimeout(2)\ntry:\n    s.connect(('127.0.0.1', {port}))\n"
                "    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e)\n"
                "try:\n    socket.getaddrinfo('example.com', 80)\n    print('RESOLVED')\nexcept OSError as e:\n"
                "    print('no dns', e)\n"
                "import fcntl, struct\nprint(sorted(n for _, n in socket.if_nameindex()))")
    assert "CONNECTED" not in r.output and "refused" in r.output and "RESOLVED" not in r.output, r.output
    assert "['lo']" in r.output  # the only interface is the namespace's own loopback, and it is down
    time.sleep(0.3)
    assert len(accepted) == 1


def test_the_drivers_files_and_environment_are_out_of_reach(box, isolation, tmp_path, monkeypatch):
    needs(isolation, "private_root", "private_proc", "unprivileged_uid")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    os.chmod(secret, 0o600)
    readable = tmp_path / "readable.txt"  # world-readable: only the private root keeps it out of reach
    readable.write_text("READABLE")
    os.chmod(readable, 0o644)
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("CHATLEARN_SECRET", "hunter2")
    repo_file = os.path.abspath(__file__)
    code = "import os\n" + "".join(
        f"try:\n    print({label!r}, open({path!r}).read()[:40])\nexcept OSError as e:\n"
        f"    print({label!r}, 'DENIED', type(e).__name__)\n"
        for label, path in [("secret", str(secret)), ("environ", f"/proc/{os.getpid()}/environ"),
                            ("repo", repo_file), ("shadow", "/etc/shadow"), ("readable", str(readable))]) + \
        "print('env', dict(os.environ))\nprint('pids', sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
    r = box.run(code)
    lines = dict(line.split(" ", 1) for line in r.output.splitlines())
    for label in ("secret", "environ", "repo", "shadow", "readable"):
        assert lines[label].startswith("DENIED"), (label, lines[label])
    assert "hunter2" not in r.output and "TOPSECRET" not in r.output and "READABLE" not in r.output
    assert "HOME" not in lines["env"]
    assert lines["pids"] == "['1']"  # only the sandbox itself


def test_the_0600_file_is_protected_by_the_uid_alone(isolation, tmp_path):
    # without the private root (a bind of the file's directory is the only thing visible), the uid still holds
    needs(isolation, "unprivileged_uid")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    os.chmod(secret, 0o600)
    os.chmod(tmp_path, 0o755)
    box = Sandbox(timeout=5, extra_ro_binds=(str(tmp_path),))
    r = box.run(f"import os\nprint(os.path.exists({str(secret)!r}))\nprint(open({str(secret)!r}).read())")
    assert r.output.startswith("True\n") and "PermissionError" in r.output and "TOPSECRET" not in r.output


def test_output_over_the_cap_is_truncated_and_stopped(box):
    start = time.monotonic()
    r = box.run("while True:\n    print('x' * 1000)")
    assert time.monotonic() - start < 5 and r.truncated and len(r.output) == 4096
    assert r.observation().endswith("[output truncated: over the sandbox's output limit]")


def test_file_size_limit(box):
    r = Sandbox(file_size_bytes=1 << 20, timeout=5).run("open('big', 'wb').write(b'x' * (2 << 20))")
    assert "File too large" in r.output


def test_isolation_is_reported_and_can_be_required():
    plain = Sandbox(namespaces=False, timeout=5)
    held = plain.isolation
    assert not held["network_namespace"] and not held["private_root"] and not held["pid_namespace"]
    refused = Sandbox(namespaces=False, require=("network_namespace",), timeout=5).run("print('ran')")
    assert "ran" not in refused.output and "not enforceable here: network_namespace" in refused.output
    with pytest.raises(ValueError, match="unknown isolation"):
        Sandbox(require=("magic",))


def test_this_machine_enforces_everything(isolation):
    # measured on the development machine (root in a container with CAP_SYS_ADMIN). A machine without namespaces
    # (Docker's default capabilities) skips, naming what is missing: the tests of each protection above skip
    # alike, and Sandbox(require=...) refuses to run there. CHATLEARN_SANDBOX_REQUIRED=1 makes it a failure.
    if os.geteuid() != 0:
        pytest.skip("the driver is not root: the uid drop cannot hold")
    missing = sorted(k for k, v in isolation.items() if k != "user_namespace" and not v)
    if missing and not os.environ.get("CHATLEARN_SANDBOX_REQUIRED"):
        pytest.skip(f"this machine cannot enforce: {', '.join(missing)}")
    assert missing == []


# ---------------------------------------------------------------- the registry


def test_registry_describes_and_calls_the_tools():
    reg = default_registry(Sandbox(timeout=5))
    assert reg.names == ["calculator", "python"]
    assert [s["function"]["name"] for s in reg.schemas()] == ["calculator", "python"]
    assert reg.schemas()[0]["function"]["parameters"]["required"] == ["expression"]
    assert reg.call("calculator", {"expression": "6*7"}) == "42"
    assert reg.call("python", {"code": "print(6*7)"}) == "42"
    assert reg.call("nope", {}).startswith("Error: unknown tool 'nope'")
    assert reg.call("calculator", {"expr": "1"}).startswith("Error: tool 'calculator' is missing")
    assert reg.call("calculator", "1+1").startswith("Error: ")
    text = call("calculator", {"expression": "1/0"}) + call("python", {"code": "print('hi')"}) + \
        "<tool_call>{oops}</tool_call>"
    obs = reg.observe(text)
    assert obs[:2] == ["Error: division by zero", "hi"] and obs[2].startswith("Error: the tool call is not valid JSON")
