"""Drives a running sandboxd with the official Python SDK (k8s-agent-sandbox 1.0.8).

Usage: python official_sdk.py REST_PORT GRPC_PORT LEGACY_PORT BASE_DIR
Every check is an assert; the process exits non-zero on the first failure.
"""
import io
import os
import sys

from k8s_agent_sandbox.commands.command_executor import CommandExecutor
from k8s_agent_sandbox.connector import SandboxConnector
from k8s_agent_sandbox.exceptions import SandboxRequestError
from k8s_agent_sandbox.files.filesystem import Filesystem
from k8s_agent_sandbox.models import (
    SandboxDirectConnectionConfig,
    SandboxdInClusterConnectionConfig,
)

rest, grpc, legacy, base = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
base = os.path.realpath(base)

# sandboxd mode: REST files and gRPC ProcessService on the "pod IP".
config = SandboxdInClusterConnectionConfig(mode="in-cluster-pod-ip", rest_port=rest, grpc_port=grpc)
conn = SandboxConnector("sbx", "default", config, k8s_helper=None, get_pod_ip=lambda: "127.0.0.1")
assert conn.is_sandboxd()
fs = Filesystem(conn, None, "test")
cmd = CommandExecutor(conn, None, "test")

fs.write("dir/a.txt", b"hello sdk")
fs.write("dir/stream.bin", io.BytesIO(b"x" * 200_000))
assert fs.read("dir/a.txt") == b"hello sdk"
entries = {(e.name, e.type, e.size, e.mode) for e in fs.list("dir")}
assert entries == {("a.txt", "file", 9, "0644"), ("stream.bin", "file", 200_000, "0644")}, entries
assert [(e.name, e.type) for e in fs.list(".")] == [("dir", "directory")]
assert fs.exists("dir/a.txt") and not fs.exists("nope")
sink = io.BytesIO()
assert fs.read_to("dir/stream.bin", sink) == 200_000 and sink.getvalue() == b"x" * 200_000

r = cmd.run("cat a.txt; echo \"$X\" >&2; pwd; exit 3", env={"X": "from env"}, cwd="dir")
assert (r.stdout, r.stderr, r.exit_code) == (f"hello sdk{base}/dir\n", "from env\n", 3), r
r = cmd.run("sleep 30", command_timeout=1)
assert r.timed_out and r.exit_code == 124, r

fs.delete("dir/a.txt")
try:
    fs.delete("dir")
    raise AssertionError("deleting a non-empty directory succeeded")
except SandboxRequestError as e:
    assert e.status_code == 409, e.status_code
fs.delete("dir", recursive=True)
assert not fs.exists("dir")
try:
    fs.read("../etc/passwd", allow_unsafe_paths=True)
    raise AssertionError("an escape was served")
except SandboxRequestError as e:
    assert e.status_code == 403, e.status_code

# Legacy python-runtime mode, direct URL.
lconn = SandboxConnector(
    "sbx", "default", SandboxDirectConnectionConfig(api_url=f"http://127.0.0.1:{legacy}"), k8s_helper=None
)
assert not lconn.is_sandboxd()
lfs = Filesystem(lconn, None, "test")
lcmd = CommandExecutor(lconn, None, "test")
lfs.write("leg/x.txt", b"legacy")
assert lfs.read("leg/x.txt") == b"legacy"
assert lfs.exists("leg/x.txt") and not lfs.exists("leg/nope")
assert [(e.name, e.type, e.size) for e in lfs.list("leg")] == [("x.txt", "file", 6)]
r = lcmd.run("ls leg")
assert (r.stdout, r.exit_code) == ("x.txt\n", 0), r
r = lcmd.run("sleep 20", command_timeout=1)
assert r.timed_out and r.exit_code == 124, r
print("official SDK checks passed")
