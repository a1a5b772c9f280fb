"""Official-client fidelity check of the k8s test cluster.

Run by `cargo xtask k8s-fidelity` (which starts the cluster and sets the environment):
KUBECONFIG, ROUTER_URL, NAMESPACE and WARM_POOL (the pool whose pods serve the legacy
python-runtime API on port 8888).

1. The Python `kubernetes` client's CustomObjectsApi: create/get/list/patch/replace/watch/delete
   on SandboxClaims, with the errors a real API server gives (409, 404) and the watch stream
   the controller drives.
   Versions older than the event window (64 events under xtask) give 410 Gone to watches and
   list continuations.
2. The official SDK `k8s_agent_sandbox` in direct-connection mode (through the router): create
   a claim, wait for it, recover its claim watch from 410 Gone, run a command, write/read/list
   a file, terminate.

Every check raises on failure; the last line is `fidelity: N checks passed`.
"""

import os
import sys
import uuid

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

GROUP = "extensions.agents.x-k8s.io"
VERSION = "v1beta1"
PLURAL = "sandboxclaims"

checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(f"fidelity check failed: {what}")
    checks += 1
    print(f"ok {checks}: {what}", flush=True)


def expect_status(code, fn, what):
    try:
        fn()
    except ApiException as e:
        check(e.status == code, f"{what} -> HTTP {code} (got {e.status})")
        return
    raise AssertionError(f"fidelity check failed: {what} did not fail with {code}")


def fault(action):
    """Program the test cluster's fault plan (its test-only endpoint, same auth as the API)."""
    import requests
    conf = client.Configuration.get_default_copy()
    auth = conf.api_key.get("authorization") or conf.api_key.get("BearerToken") or ""
    if auth and not auth.startswith("Bearer "):
        auth = f"Bearer {auth}"
    r = requests.post(f"{conf.host}/k8s-testcluster/v1/faults", json=action,
                      headers={"Authorization": auth}, timeout=10)
    r.raise_for_status()


def ready_reason(obj):
    for c in (obj.get("status") or {}).get("conditions", []):
        if c.get("type") == "Ready":
            return c.get("status"), c.get("reason")
    return None, None


def custom_objects(ns):
    config.load_kube_config(config_file=os.environ["KUBECONFIG"])
    api = client.CustomObjectsApi()
    name = f"fidelity-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SandboxClaim",
        "metadata": {"name": name, "labels": {"fidelity": "yes"}},
        # A pool that does not exist: the controller answers with WarmPoolNotFound.
        "spec": {"warmPoolRef": {"name": "fidelity-no-such-pool"}},
    }
    created = api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    uid = created["metadata"]["uid"]
    check(created["metadata"]["name"] == name and uid, "create returns the object with a uid")
    expect_status(409, lambda: api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body), "create of a taken name")

    got = api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    check(got["metadata"]["uid"] == uid, "get returns the created claim")
    listed = api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, label_selector="fidelity=yes")
    check(name in [i["metadata"]["name"] for i in listed["items"]], "list with a label selector finds it")
    check(listed["metadata"]["resourceVersion"], "the list has a resourceVersion")

    # Watch from "0" as the SDK does: ADDED first, then the controller's status update.
    w = watch.Watch()
    seen = []
    for event in w.stream(api.list_namespaced_custom_object, group=GROUP, version=VERSION, namespace=ns,
                          plural=PLURAL, field_selector=f"metadata.name={name}", resource_version="0",
                          timeout_seconds=30):
        seen.append(event["type"])
        if ready_reason(event["object"]) == ("False", "WarmPoolNotFound"):
            w.stop()
            break
    check(seen and seen[0] == "ADDED", f"the watch starts with ADDED ({seen})")
    check(ready_reason(api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)) == ("False", "WarmPoolNotFound"),
          "the controller reports WarmPoolNotFound")

    patched = api.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, {"metadata": {"labels": {"patched": "1"}}})
    check(patched["metadata"]["labels"].get("patched") == "1", "merge patch adds a label")
    stale = dict(got)
    expect_status(409, lambda: api.replace_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, stale), "replace with a stale resourceVersion")

    api.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name,
                                        body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)))
    expect_status(404, lambda: api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name), "get after delete")
    expect_status(404, lambda: api.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name), "delete twice")

    # Resuming a watch from the create's version replays the rest, ending with DELETED.
    types = []
    w = watch.Watch()
    for event in w.stream(api.list_namespaced_custom_object, group=GROUP, version=VERSION, namespace=ns,
                          plural=PLURAL, field_selector=f"metadata.name={name}",
                          resource_version=created["metadata"]["resourceVersion"], timeout_seconds=5):
        types.append(event["type"])
        if event["type"] == "DELETED":
            w.stop()
            break
    check(types and types[-1] == "DELETED" and "MODIFIED" in types, f"a resumed watch replays to DELETED ({types})")


def gone(ns):
    """Versions pushed out of the server's event window (64 events under xtask) give 410."""
    api = client.CustomObjectsApi()
    name = f"fidelity-gone-{uuid.uuid4().hex[:8]}"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SandboxClaim", "metadata": {"name": name},
            "spec": {"warmPoolRef": {"name": "fidelity-no-such-pool"}}}
    created = api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    second = dict(body, metadata={"name": name + "-b"})
    api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, second)
    old_rv = created["metadata"]["resourceVersion"]
    page = api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, limit=1)
    token = page["metadata"].get("continue")
    check(bool(token) and len(page["items"]) == 1, "a limited list returns one item and a continue token")
    for i in range(80):
        api.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, {"metadata": {"labels": {"n": str(i)}}})

    def watch_old():
        for _ in watch.Watch().stream(api.list_namespaced_custom_object, group=GROUP, version=VERSION,
                                      namespace=ns, plural=PLURAL, resource_version=old_rv, timeout_seconds=5):
            pass
    expect_status(410, watch_old, "a watch from a version older than the event window")
    expect_status(410, lambda: api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, limit=1, _continue=token),
                  "a list continued with a token older than the event window")
    api.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    api.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name + "-b")
    return old_rv


def sdk(ns, pool, router_url, old_rv):
    from k8s_agent_sandbox import SandboxClient, SandboxRequestError
    from k8s_agent_sandbox.models import SandboxDirectConnectionConfig

    sc = SandboxClient(connection_config=SandboxDirectConnectionConfig(api_url=router_url))
    sandbox = sc.create_sandbox(warmpool=pool, namespace=ns, sandbox_ready_timeout=120)
    try:
        check(sandbox.is_active, "the SDK created a claim and connected")
        # The SDK's claim watch, started from an expired version, restarts from "0" on 410.
        resolved = sc.k8s_helper.resolve_sandbox_name(sandbox.claim_name, ns, timeout=30, resource_version=old_rv)
        check(resolved == sandbox.sandbox_id, f"the SDK's watch recovers from 410 Gone ({resolved})")
        result = sandbox.commands.run("echo hello-fidelity")
        check(result.exit_code == 0 and result.stdout.strip() == "hello-fidelity",
              f"the SDK ran a command ({result!r})")
        failing = sandbox.commands.run("ls /no/such/path")
        check(failing.exit_code != 0, f"a failing command reports its exit code ({failing.exit_code})")
        sandbox.files.write("fidelity/data.txt", b"written by the official SDK\n")
        data = sandbox.files.read("fidelity/data.txt")
        check(data == b"written by the official SDK\n", "the SDK wrote and read back a file")
        # The router's 503s: the SDK retries GETs (5 retries), so two are absorbed and six
        # are not.
        fault({"action": "fail_next", "method": "GET", "path": "/download/", "status": 503, "count": 2})
        check(sandbox.files.read("fidelity/data.txt") == data, "the SDK's read retried through two 503s")
        fault({"action": "fail_next", "method": "GET", "path": "/download/", "status": 503, "count": 6})
        try:
            sandbox.files.read("fidelity/data.txt")
            failure = None
        except SandboxRequestError as e:
            failure = e
        status = getattr(failure, "status_code", None)
        detail = failure.response.json().get("detail", "") if failure is not None and failure.response is not None else ""
        check(status == 503 and "injected" in detail,
              f"six 503s fail the SDK's read with the router's status and detail ({status}, {detail!r})")
        fault({"action": "clear"})
        check(sandbox.files.exists("fidelity/data.txt"), "exists() sees the file")
        names = [e.name for e in sandbox.files.list("fidelity")]
        check(names == ["data.txt"], f"list() shows the file ({names})")
        cat = sandbox.commands.run("cat fidelity/data.txt")
        check(cat.stdout == "written by the official SDK\n", "a command sees the file the SDK wrote")
    finally:
        claim = sandbox.claim_name
        sandbox.terminate()
    api = client.CustomObjectsApi()
    expect_status(404, lambda: api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, claim), "terminate deleted the claim")


def main():
    ns = os.environ.get("NAMESPACE", "default")
    custom_objects(ns)
    old_rv = gone(ns)
    sdk(ns, os.environ.get("WARM_POOL", "default"), os.environ["ROUTER_URL"], old_rv)
    print(f"fidelity: {checks} checks passed")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # report and fail
        print(f"fidelity: FAILED after {checks} checks: {type(e).__name__}: {e}", file=sys.stderr)
        raise
