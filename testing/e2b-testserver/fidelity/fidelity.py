"""Official-SDK fidelity check of the E2B test server.

Run by `cargo xtask e2b-fidelity`, which starts `e2b-testserver` and sets E2B_API_URL,
E2B_SANDBOX_URL, E2B_DOMAIN and E2B_API_KEY (never E2B_DEBUG: debug mode skips the API).
Uses the pinned official SDK (`e2b`, requirements.txt) the way an application does: create a
sandbox with metadata and envs, run commands (env, cwd, a timeout, a non-zero exit, a killed
background command), write/read/list files, list sandboxes by metadata, pause and connect,
snapshot and create from the snapshot, kill; then the server's faults (a 503 on create, a
429 with Retry-After, a rotated envd token, a Start stream cut mid-command, a sandbox whose
container vanished) through its test-only fault endpoint.

Every check prints one line; the first failure raises (non-zero exit). The last line is
`fidelity: N checks passed`.
"""

import os
import sys
import time
import uuid

import httpx
from e2b import (
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    Sandbox,
    SandboxNotRunningException,
    SandboxQuery,
    TimeoutException,
)

checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(f"fidelity check failed: {what}")
    checks += 1
    print(f"ok {checks}: {what}", flush=True)


def expect(exc_type, fn, what):
    try:
        fn()
    except exc_type as e:
        check(True, f"{what} -> {exc_type.__name__}")
        return e
    except Exception as e:  # noqa: BLE001 - report what came instead
        raise AssertionError(
            f"fidelity check failed: {what} raised {type(e).__name__}: {e}, not {exc_type.__name__}"
        ) from e
    raise AssertionError(f"fidelity check failed: {what} did not raise {exc_type.__name__}")


def fault(action):
    """Program the test server's fault plan (its test-only endpoint, same auth as the API)."""
    r = httpx.post(
        f"{os.environ['E2B_API_URL']}/e2b-testserver/v1/faults",
        json=action,
        headers={"X-API-Key": os.environ["E2B_API_KEY"]},
        timeout=10,
    )
    r.raise_for_status()
    return r.json() if r.content else None


def proto_codec(sbx):
    """The SDK's generated Connect clients with the binary codec (the Rust backend's), which
    checks the server's messages against the official descriptors. No compression, as the SDK
    itself sends."""
    from e2b.envd.filesystem import filesystem_connect, filesystem_pb
    from e2b.envd.process import process_connect, process_pb

    url = os.environ["E2B_SANDBOX_URL"]
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    plain = {"send_compression": None, "accept_compression": ()}
    p = process_connect.ProcessClientSync(url, **plain)
    req = process_pb.StartRequest(
        process=process_pb.ProcessConfig(cmd="/bin/sh", args=["-c", "echo proto; exit 4"]), stdin=False
    )
    events = [e.event.event for e in p.start(req, headers=headers)]
    kinds = [ev.field for ev in events]
    check(kinds[0] == "start" and kinds[-1] == "end", f"proto Start events {kinds}")
    out = b"".join(ev.value.output.value for ev in events if ev.field == "data")
    end = events[-1].value
    check(out == b"proto\n" and end.exit_code == 4 and end.status == "exit status 4",
          f"proto Start output and end ({end.exit_code}, {end.status!r})")
    f = filesystem_connect.FilesystemClientSync(url, **plain)
    st = f.stat(filesystem_pb.StatRequest(path="/etc/hostname"), headers=headers).entry
    check(st.name == "hostname" and st.size > 0 and st.type == filesystem_pb.FileType.FILE,
          "proto Stat entry")
    names = [e.name for e in f.list_dir(filesystem_pb.ListDirRequest(path="/etc", depth=1), headers=headers).entries]
    check("hostname" in names, f"proto ListDir ({len(names)} entries)")


def faults(run_id):
    """How the SDK copes with the server's failures."""
    # A 503 on create: the SDK retries (an Idempotency-Key makes that safe).
    fault({"action": "fail_next", "method": "POST", "path": "/v2/sandboxes", "status": 503, "count": 1})
    sbx = Sandbox.create(metadata={"fidelity": run_id, "faults": "yes"}, timeout=120)
    check(bool(sbx.sandbox_id), "Sandbox.create retried through a 503")
    # A 429 with Retry-After: waited for, then retried.
    fault({"action": "rate_limit_next", "method": "GET", "path": f"/sandboxes/{sbx.sandbox_id}",
           "retry_after_ms": 1000, "count": 1})
    started = time.monotonic()
    info = sbx.get_info()
    check(info.sandbox_id == sbx.sandbox_id and time.monotonic() - started >= 0.9,
          "get_info waited out a 429 Retry-After: 1")
    # A rotated envd token: the old one is refused.
    new = fault({"action": "rotate_envd_token", "sandboxID": sbx.sandbox_id})["envdAccessToken"]
    expect(AuthenticationException, lambda: sbx.commands.run("true"), "a command with a rotated envd token")
    fresh = Sandbox.connect(sbx.sandbox_id)
    check(fresh.commands.run("echo ok").stdout == "ok\n" and bool(new), "connect picks up the new token")
    # A Start stream cut mid-command: the SDK reports an error, the sandbox stays usable.
    fault({"action": "cut_next_start_stream", "after_outputs": 1})
    try:
        fresh.commands.run("echo one; sleep 0.3; echo two")
        raise AssertionError("fidelity check failed: a cut stream did not raise")
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - the type is what the SDK makes of a reset
        check(True, f"a cut Start stream -> {type(e).__name__}")
    check(fresh.commands.run("echo again").stdout == "again\n", "the next command works")
    # The container removed behind the API: the proxy's 502 "... was not found".
    fault({"action": "disappear", "sandboxID": sbx.sandbox_id})
    expect(SandboxNotRunningException, lambda: fresh.commands.run("true"), "a command in a vanished sandbox")
    check(fresh.kill() is True, "kill the vanished sandbox")


def main():
    for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        if not os.environ.get(var):
            raise SystemExit(f"{var} is not set (run through `cargo xtask e2b-fidelity`)")
    if os.environ.get("E2B_DEBUG", "").lower() == "true":
        raise SystemExit("E2B_DEBUG must not be set: debug mode skips the API")
    run_id = uuid.uuid4().hex[:8]

    sbx = Sandbox.create(
        metadata={"fidelity": run_id, "purpose": "e2b fidelity"},
        envs={"GREETING": "hello"},
        timeout=300,
    )
    check(bool(sbx.sandbox_id), f"Sandbox.create -> {sbx.sandbox_id}")
    info = sbx.get_info()
    check(info.metadata.get("fidelity") == run_id, "get_info has the metadata")
    check(str(getattr(info.state, "value", info.state)) == "running", "get_info state running")
    check(sbx.is_running(), "is_running (envd /health)")

    r = sbx.commands.run('echo "$GREETING $EXTRA"; pwd', envs={"EXTRA": "world"}, cwd="/tmp")
    check(r.exit_code == 0, "commands.run exit code 0")
    check(r.stdout == "hello world\n/tmp\n", f"commands.run env and cwd (stdout {r.stdout!r})")
    r = sbx.commands.run("echo to-stderr >&2")
    check(r.stderr == "to-stderr\n", "commands.run stderr")

    e = expect(CommandExitException, lambda: sbx.commands.run("echo partial; exit 3"), "non-zero exit")
    check(e.exit_code == 3 and e.stdout == "partial\n", f"CommandExitException exit_code 3 ({e.exit_code})")

    started = time.monotonic()
    expect(TimeoutException, lambda: sbx.commands.run("sleep 30", timeout=2), "a command over its timeout")
    check(time.monotonic() - started < 15, "the timeout ended the command early")

    h = sbx.commands.run("sleep 60", background=True)
    check(h.pid > 0, f"background command pid {h.pid}")
    listed = [p.pid for p in sbx.commands.list()]
    check(h.pid in listed, "commands.list has it")
    check(sbx.commands.kill(h.pid) is True, "commands.kill -> True")
    e = expect(CommandExitException, h.wait, "wait on a killed command")
    check(e.exit_code != 0, f"killed command exit code {e.exit_code} ({e.error or ''})")
    check(sbx.commands.kill(h.pid) is False, "commands.kill of a gone pid -> False")

    w = sbx.files.write("/tmp/fidelity/a.txt", "alpha")
    check(w.path == "/tmp/fidelity/a.txt", f"files.write -> {w.path}")
    check(sbx.files.read("/tmp/fidelity/a.txt") == "alpha", "files.read text")
    sbx.files.write("/tmp/fidelity/b.bin", b"\x00\x01\x02")
    check(sbx.files.read("/tmp/fidelity/b.bin", format="bytes") == b"\x00\x01\x02", "files.read bytes")
    names = sorted(e.name for e in sbx.files.list("/tmp/fidelity"))
    check(names == ["a.txt", "b.bin"], f"files.list -> {names}")
    check(sbx.files.exists("/tmp/fidelity/a.txt") and not sbx.files.exists("/tmp/nope"), "files.exists")
    check(sbx.files.make_dir("/tmp/fidelity/d") is True, "files.make_dir new -> True")
    check(sbx.files.make_dir("/tmp/fidelity/d") is False, "files.make_dir existing -> False")
    expect(NotFoundException, lambda: sbx.files.read("/tmp/nope"), "files.read of a missing file")
    rel = sbx.files.write("rel.txt", "home")
    check(rel.path == "/home/user/rel.txt", f"relative paths are under the home ({rel.path})")

    page = Sandbox.list(query=SandboxQuery(metadata={"fidelity": run_id})).next_items()
    check([s.sandbox_id for s in page] == [sbx.sandbox_id], "Sandbox.list by metadata")

    check(sbx.pause() is True, "pause -> True")
    paused = Sandbox.list(query=SandboxQuery(metadata={"fidelity": run_id})).next_items()
    check(str(getattr(paused[0].state, "value", paused[0].state)) == "paused", "listed as paused")
    again = Sandbox.connect(sbx.sandbox_id)
    check(again.commands.run("cat /tmp/fidelity/a.txt").stdout == "alpha", "connect resumes it")

    proto_codec(again)

    snap = again.create_snapshot()
    check(bool(snap.snapshot_id), f"create_snapshot -> {snap.snapshot_id}")
    from_snap = Sandbox.create(template=snap.snapshot_id, timeout=120)
    check(from_snap.files.read("/tmp/fidelity/a.txt") == "alpha", "a sandbox from the snapshot has the file")
    check(from_snap.kill() is True, "kill the snapshot's sandbox")
    check(Sandbox.delete_snapshot(snap.snapshot_id) is True, "delete_snapshot -> True")
    check(Sandbox.delete_snapshot(snap.snapshot_id) is False, "delete_snapshot again -> False")

    check(again.kill() is True, "kill -> True")
    check(Sandbox.kill(sbx.sandbox_id) is False, "kill again -> False")
    expect(NotFoundException, lambda: Sandbox.get_info(sbx.sandbox_id), "get_info of a killed sandbox")

    expect(
        AuthenticationException,
        lambda: Sandbox.create(api_key="e2b_" + "0" * 40),
        "a wrong API key",
    )
    faults(run_id)
    print(f"fidelity: {checks} checks passed", flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(1)
