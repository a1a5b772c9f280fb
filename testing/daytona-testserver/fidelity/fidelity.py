"""Fidelity check: the official Daytona Python SDK (pinned in requirements.txt) against the
Daytona test server (testing/daytona-testserver). Reads DAYTONA_API_URL and DAYTONA_API_KEY
(as the SDK does), prints one line per check and exits non-zero when any fails.

Run by `cargo xtask daytona-fidelity` (and `cargo xtask test`)."""

import os
import sys
import time
import traceback

from daytona import (
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaConfig,
    ListSandboxesQuery,
    SessionExecuteRequest,
)

FAILED = []


def check(name, fn):
    started = time.monotonic()
    try:
        detail = fn()
        print(f"ok   {name} ({time.monotonic() - started:.2f} s){': ' + detail if detail else ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the run fails
        FAILED.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    daytona = Daytona(
        DaytonaConfig(api_key=os.environ["DAYTONA_API_KEY"], api_url=os.environ["DAYTONA_API_URL"])
    )
    marker = f"fidelity-{os.getpid()}"
    state = {}

    def create():
        sb = daytona.create(
            CreateSandboxFromSnapshotParams(
                labels={"suite": "fidelity", "run": marker},
                env_vars={"FIDELITY_GREETING": "hello from env"},
                auto_stop_interval=0,
            ),
            timeout=120,
        )
        state["sb"] = sb
        expect(sb.state == "started", f"state {sb.state}")
        expect(sb.labels.get("run") == marker, f"labels {sb.labels}")
        return f"id {sb.id}"

    check("create with labels and env, waits until started", create)
    sb = state.get("sb")
    if sb is None:
        return

    def get_by_id():
        again = daytona.get(sb.id)
        expect(again.id == sb.id and again.state == "started", f"{again.id} {again.state}")

    check("get by id", get_by_id)

    def list_by_label():
        found = [s.id for s in daytona.list(ListSandboxesQuery(labels={"run": marker}))]
        expect(found == [sb.id], f"list by label found {found}")

    check("list filtered by labels (JSON string)", list_by_label)

    def exec_output():
        r = sb.process.exec("echo out; echo err >&2; echo $FIDELITY_GREETING; exit 3")
        expect(r.exit_code == 3, f"exit code {r.exit_code}")
        for want in ("out", "err", "hello from env"):
            expect(want in r.result, f"{want!r} not in {r.result!r}")

    check("process.exec: exit code, combined output, sandbox env", exec_output)

    def exec_cwd_env():
        r = sb.process.exec("pwd; echo $ONE", cwd="/tmp", env={"ONE": "uno"})
        expect(r.exit_code == 0, f"exit code {r.exit_code}")
        expect(r.result.split() == ["/tmp", "uno"], f"result {r.result!r}")

    check("process.exec with cwd and env", exec_cwd_env)

    def exec_timeout():
        started = time.monotonic()
        try:
            r = sb.process.exec("sleep 30", timeout=1)
        except Exception as e:  # the daemon answers 408
            took = time.monotonic() - started
            expect(took < 15, f"took {took:.1f} s")
            return f"{type(e).__name__}: {str(e)[:80]}"
        raise AssertionError(f"no error, got exit code {r.exit_code}")

    check("process.exec over its timeout fails (408)", exec_timeout)

    def files():
        payload = bytes(range(256)) * 64
        sb.fs.upload_file(payload, "/tmp/fidelity/data.bin")
        got = sb.fs.download_file("/tmp/fidelity/data.bin")
        expect(got == payload, f"downloaded {len(got)} bytes, differ")
        names = {f.name: f for f in sb.fs.list_files("/tmp/fidelity")}
        expect("data.bin" in names, f"list {sorted(names)}")
        expect(names["data.bin"].size == len(payload), f"size {names['data.bin'].size}")
        info = sb.fs.get_file_info("/tmp/fidelity")
        expect(info.is_dir, "info of a directory: is_dir false")

    check("fs.upload_file / download_file (binary) / list_files / get_file_info", files)

    def folder_move_delete():
        sb.fs.create_folder("/tmp/fidelity/sub", "755")
        sb.fs.move_files("/tmp/fidelity/data.bin", "/tmp/fidelity/sub/moved.bin")
        names = [f.name for f in sb.fs.list_files("/tmp/fidelity/sub")]
        expect(names == ["moved.bin"], f"after move {names}")
        sb.fs.delete_file("/tmp/fidelity", recursive=True)
        r = sb.process.exec("test -e /tmp/fidelity && echo still || echo gone")
        expect(r.result.strip() == "gone", f"after delete: {r.result!r}")

    check("fs.create_folder / move_files / delete_file", folder_move_delete)

    def missing_file():
        try:
            sb.fs.download_file("/no/such/file")
        except Exception as e:
            return f"{type(e).__name__}"
        raise AssertionError("downloading a missing file did not fail")

    check("fs.download_file of a missing file fails", missing_file)

    def sessions():
        sb.process.create_session("s1")
        r = sb.process.execute_session_command("s1", SessionExecuteRequest(command="echo sync-out"))
        expect(r.exit_code == 0 and "sync-out" in (r.output or r.stdout), f"sync {r}")
        a = sb.process.execute_session_command(
            "s1", SessionExecuteRequest(command="sleep 0.5; echo async-out", run_async=True)
        )
        deadline = time.monotonic() + 20
        while True:
            cmd = sb.process.get_session_command("s1", a.cmd_id)
            if cmd.exit_code is not None:
                break
            expect(time.monotonic() < deadline, "async command did not finish")
            time.sleep(0.2)
        logs = sb.process.get_session_command_logs("s1", a.cmd_id)
        expect("async-out" in logs.stdout, f"logs {logs}")
        sb.process.execute_session_command("s1", SessionExecuteRequest(command="cd /tmp && export SV=kept"))
        r = sb.process.execute_session_command("s1", SessionExecuteRequest(command='echo "$(pwd) $SV"'))
        expect((r.stdout or "").strip() == "/tmp kept", f"session state did not carry over: {r}")
        sess = sb.process.get_session("s1")
        expect(len(sess.commands) == 4, f"session commands {sess.commands}")
        sb.process.delete_session("s1")

    check("sessions: create, exec sync and async, command status, logs, cwd/env carry over, delete", sessions)

    def stop_start():
        sb.stop(timeout=60)
        expect(sb.state == "stopped", f"after stop {sb.state}")
        sb.start(timeout=60)
        expect(sb.state == "started", f"after start {sb.state}")
        r = sb.process.exec("echo back")
        expect(r.result.strip() == "back", f"after restart {r.result!r}")

    check("stop and start", stop_start)

    def delete():
        daytona.delete(sb)
        try:
            daytona.get(sb.id)
        except Exception as e:
            return f"get after delete: {type(e).__name__}"
        raise AssertionError("the sandbox is still there after delete")

    check("delete, then get fails", delete)


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        FAILED.append("setup")
    if FAILED:
        print(f"daytona fidelity: {len(FAILED)} check(s) failed: {', '.join(FAILED)}")
        sys.exit(1)
    print("daytona fidelity: all checks passed")
