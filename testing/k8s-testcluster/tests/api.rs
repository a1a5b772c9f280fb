//! The API server's Kubernetes semantics (no Docker: the controller is off).

mod common;

use std::time::Duration;

use common::{CLAIMS, Client, SANDBOXES};
use k8s_testcluster::{TestCluster, TestClusterOptions};
use serde_json::{Value, json};

async fn cluster(window: usize) -> TestCluster {
    TestCluster::start(TestClusterOptions {
        controller: false,
        event_window: window,
        bookmark_interval: Duration::from_millis(100),
        ..TestClusterOptions::default()
    })
    .await
    .expect("cluster starts")
}

fn claim(name: &str) -> Value {
    json!({"apiVersion": "extensions.agents.x-k8s.io/v1beta1", "kind": "SandboxClaim",
           "metadata": {"name": name, "labels": {"app": "a", "tier": name}},
           "spec": {"warmPoolRef": {"name": "pool"}}})
}

fn rv(o: &Value) -> u64 {
    o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn create_get_list_and_already_exists() {
    let c = cluster(1000).await;
    let api = Client::new(&c);
    let (code, created) = api.post(CLAIMS, &claim("one")).await;
    assert_eq!(code, 201, "{created}");
    assert_eq!(created["metadata"]["generation"], 1);
    assert!(
        created["metadata"]["uid"]
            .as_str()
            .is_some_and(|u| u.len() == 36)
    );
    assert!(created["metadata"]["creationTimestamp"].is_string());
    let (code, again) = api.post(CLAIMS, &claim("one")).await;
    assert_eq!(
        (code, again["kind"].as_str(), again["reason"].as_str()),
        (409, Some("Status"), Some("AlreadyExists"))
    );

    let (code, got) = api.get(&format!("{CLAIMS}/one")).await;
    assert_eq!((code, &got), (200, &created));
    let (code, missing) = api.get(&format!("{CLAIMS}/nope")).await;
    assert_eq!((code, missing["reason"].as_str()), (404, Some("NotFound")));

    let mut gen_claim = claim("x");
    gen_claim["metadata"] = json!({"generateName": "gen-"});
    let (code, generated) = api.post(CLAIMS, &gen_claim).await;
    assert_eq!(code, 201);
    let name = generated["metadata"]["name"].as_str().unwrap();
    assert!(name.starts_with("gen-") && name.len() == 9, "{name}");

    let (code, bad) = api.post(CLAIMS, &claim("Bad_Name")).await;
    assert_eq!((code, bad["reason"].as_str()), (422, Some("Invalid")));

    let (code, list) = api.get(CLAIMS).await;
    assert_eq!(code, 200);
    assert_eq!(list["kind"], "SandboxClaimList");
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    assert_eq!(rv(&json!({"metadata": list["metadata"]})), rv(&generated));
    let (code, all_ns) = api
        .get("/apis/extensions.agents.x-k8s.io/v1beta1/sandboxclaims")
        .await;
    assert_eq!((code, all_ns["items"].as_array().unwrap().len()), (200, 2));

    let (code, _) = api
        .send(api.http.get(format!("{}{CLAIMS}", c.api_url())))
        .await;
    assert_eq!(code, 401, "no token");
}

#[tokio::test]
async fn selectors_and_paging() {
    let c = cluster(4).await;
    let api = Client::new(&c);
    for n in ["a", "b", "c", "d", "e"] {
        assert_eq!(api.post(CLAIMS, &claim(n)).await.0, 201);
    }
    let names = |l: &Value| -> Vec<String> {
        l["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let (_, l) = api
        .get(&format!("{CLAIMS}?labelSelector=tier%20in%20(a,c),app=a"))
        .await;
    assert_eq!(names(&l), ["a", "c"]);
    let (_, l) = api
        .get(&format!(
            "{CLAIMS}?labelSelector=tier!=a,tier%20notin%20(b)"
        ))
        .await;
    assert_eq!(names(&l), ["c", "d", "e"]);
    let (_, l) = api
        .get(&format!("{CLAIMS}?fieldSelector=metadata.name%3Dd"))
        .await;
    assert_eq!(names(&l), ["d"]);
    let (code, _) = api.get(&format!("{CLAIMS}?fieldSelector=spec.x%3Dd")).await;
    assert_eq!(code, 400);

    let (_, p1) = api.get(&format!("{CLAIMS}?limit=2")).await;
    assert_eq!(names(&p1), ["a", "b"]);
    assert_eq!(p1["metadata"]["remainingItemCount"], 3);
    let token = p1["metadata"]["continue"].as_str().unwrap().to_owned();
    let (_, p2) = api.get(&format!("{CLAIMS}?limit=2&continue={token}")).await;
    assert_eq!(names(&p2), ["c", "d"]);
    let t2 = p2["metadata"]["continue"].as_str().unwrap().to_owned();
    let (_, p3) = api.get(&format!("{CLAIMS}?limit=2&continue={t2}")).await;
    assert_eq!(names(&p3), ["e"]);
    assert!(p3["metadata"]["continue"].is_null());

    // Five more writes push the first page's version out of the 4-event window.
    for n in ["f", "g", "h", "i", "j"] {
        api.post(CLAIMS, &claim(n)).await;
    }
    let (code, gone) = api.get(&format!("{CLAIMS}?limit=2&continue={token}")).await;
    assert_eq!((code, gone["reason"].as_str()), (410, Some("Expired")));
}

#[tokio::test]
async fn optimistic_concurrency_and_status_subresource() {
    let c = cluster(1000).await;
    let api = Client::new(&c);
    let (_, created) = api.post(CLAIMS, &claim("one")).await;
    let path = format!("{CLAIMS}/one");

    // PUT with the current version changes spec, bumps generation, ignores status.
    let mut upd = created.clone();
    upd["spec"]["warmPoolRef"]["name"] = json!("other");
    upd["status"] = json!({"sneaky": true});
    let (code, updated) = api.put(&path, &upd).await;
    assert_eq!(code, 200, "{updated}");
    assert_eq!(updated["spec"]["warmPoolRef"]["name"], "other");
    assert_eq!(updated["metadata"]["generation"], 2);
    assert!(
        updated["status"].is_null(),
        "status is ignored on the main resource"
    );
    assert!(rv(&updated) > rv(&created));

    // The stale version is a 409 Conflict; no version is a 422.
    let (code, conflict) = api.put(&path, &upd).await;
    assert_eq!((code, conflict["reason"].as_str()), (409, Some("Conflict")));
    let mut no_rv = updated.clone();
    no_rv["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    assert_eq!(api.put(&path, &no_rv).await.0, 422);

    // The status subresource changes status only.
    let mut st = updated.clone();
    st["status"] = json!({"conditions": [{"type": "Ready", "status": "True"}]});
    st["spec"]["warmPoolRef"]["name"] = json!("ignored");
    let (code, with_status) = api.put(&format!("{path}/status"), &st).await;
    assert_eq!(code, 200, "{with_status}");
    assert_eq!(with_status["status"]["conditions"][0]["status"], "True");
    assert_eq!(with_status["spec"]["warmPoolRef"]["name"], "other");
    assert_eq!(
        with_status["metadata"]["generation"], 2,
        "status writes keep the generation"
    );
    let (_, s) = api.get(&format!("{path}/status")).await;
    assert_eq!(s, with_status);

    // Merge patch of status through /status; a merge patch of the main resource keeps it.
    let (code, p) = api
        .patch(
            &format!("{path}/status"),
            "application/merge-patch+json",
            &json!({"status": {"sandbox": {"name": "sb"}}, "spec": {"x": 1}}),
        )
        .await;
    assert_eq!(code, 200);
    assert_eq!(p["status"]["sandbox"]["name"], "sb");
    assert!(p["spec"]["x"].is_null());
    let (code, p) = api
        .patch(
            &path,
            "application/merge-patch+json",
            &json!({"metadata": {"labels": {"new": "1"}}, "status": null}),
        )
        .await;
    assert_eq!(code, 200);
    assert_eq!(p["metadata"]["labels"]["new"], "1");
    assert_eq!(p["status"]["sandbox"]["name"], "sb");
    // A strategic merge patch is served as a merge patch; a stale version in a patch is a 409.
    let (code, _) = api
        .patch(
            &path,
            "application/strategic-merge-patch+json",
            &json!({"metadata": {"labels": {"s": "1"}}}),
        )
        .await;
    assert_eq!(code, 200);
    let (code, _) = api
        .patch(
            &path,
            "application/merge-patch+json",
            &json!({"metadata": {"resourceVersion": "1", "labels": {"z": "1"}}}),
        )
        .await;
    assert_eq!(code, 409);
    let (code, p) = api
        .patch(
            &path,
            "application/json-patch+json",
            &json!([{"op": "replace", "path": "/spec/warmPoolRef/name", "value": "jp"}]),
        )
        .await;
    assert_eq!(
        (code, p["spec"]["warmPoolRef"]["name"].as_str()),
        (200, Some("jp"))
    );
    assert_eq!(api.patch(&path, "text/plain", &json!({})).await.0, 415);
}

#[tokio::test]
async fn delete_cascades_to_owned_objects_and_checks_preconditions() {
    let c = cluster(1000).await;
    let api = Client::new(&c);
    let (_, owner) = api.post(CLAIMS, &claim("owner")).await;
    let uid = owner["metadata"]["uid"].as_str().unwrap().to_owned();
    let sb = |name: &str| {
        json!({"metadata": {"name": name, "ownerReferences": [{"apiVersion": "extensions.agents.x-k8s.io/v1beta1",
               "kind": "SandboxClaim", "name": "owner", "uid": uid, "controller": true}]},
               "spec": {"podTemplate": {"spec": {"containers": []}}}})
    };
    assert_eq!(api.post(SANDBOXES, &sb("owned")).await.0, 201);
    assert_eq!(
        api.post(
            SANDBOXES,
            &json!({"metadata": {"name": "free"}, "spec": {}})
        )
        .await
        .0,
        201
    );

    let (code, _) = api
        .send(
            api.req(reqwest::Method::DELETE, &format!("{CLAIMS}/owner"))
                .json(&json!({"preconditions": {"uid": "wrong"}})),
        )
        .await;
    assert_eq!(code, 409, "a uid precondition mismatch");

    let (code, deleted) = api.delete(&format!("{CLAIMS}/owner")).await;
    assert_eq!(code, 200);
    assert_eq!(deleted["metadata"]["name"], "owner");
    assert_eq!(
        api.get(&format!("{SANDBOXES}/owned")).await.0,
        404,
        "the owned sandbox is deleted"
    );
    assert_eq!(api.get(&format!("{SANDBOXES}/free")).await.0, 200);
    assert_eq!(api.delete(&format!("{CLAIMS}/owner")).await.0, 404);

    // Orphan keeps the dependent and drops its ownerReference.
    let (_, owner) = api.post(CLAIMS, &claim("owner")).await;
    let uid2 = owner["metadata"]["uid"].as_str().unwrap().to_owned();
    let mut o = sb("kept");
    o["metadata"]["ownerReferences"][0]["uid"] = json!(uid2);
    api.post(SANDBOXES, &o).await;
    let (code, _) = api
        .delete(&format!("{CLAIMS}/owner?propagationPolicy=Orphan"))
        .await;
    assert_eq!(code, 200);
    let (code, kept) = api.get(&format!("{SANDBOXES}/kept")).await;
    assert_eq!(code, 200);
    assert_eq!(kept["metadata"]["ownerReferences"], json!([]));
}

#[tokio::test]
async fn watch_streams_changes_and_bookmarks() {
    let c = cluster(1000).await;
    let api = Client::new(&c);
    let (_, first) = api.post(CLAIMS, &claim("first")).await;
    let mut w = api
        .watch(&format!("{CLAIMS}?watch=1&resourceVersion=0&allowWatchBookmarks=true&fieldSelector=metadata.name%3Dfirst"))
        .await;
    let e = w.next_change().await.unwrap();
    assert_eq!((e["type"].as_str(), &e["object"]), (Some("ADDED"), &first));
    api.post(CLAIMS, &claim("other")).await; // filtered out by the field selector
    let (_, p) = api
        .patch(
            &format!("{CLAIMS}/first"),
            "application/merge-patch+json",
            &json!({"metadata": {"labels": {"x": "y"}}}),
        )
        .await;
    let e = w.next_change().await.unwrap();
    assert_eq!((e["type"].as_str(), &e["object"]), (Some("MODIFIED"), &p));
    // A bookmark carries a version at or past the last change.
    let bm = loop {
        let e = w.next().await.unwrap();
        if e["type"] == "BOOKMARK" {
            break e;
        }
    };
    assert_eq!(bm["object"]["kind"], "SandboxClaim");
    assert!(rv(&bm["object"]) >= rv(&p));
    api.delete(&format!("{CLAIMS}/first")).await;
    let e = w.next_change().await.unwrap();
    assert_eq!(e["type"], "DELETED");
    assert!(rv(&e["object"]) > rv(&p));

    // Resuming from a version replays what came after it.
    let mut w = api
        .watch(&format!(
            "{CLAIMS}?watch=true&resourceVersion={}",
            rv(&first)
        ))
        .await;
    let kinds: Vec<String> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(
                w.next_change().await.unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
        v
    };
    assert_eq!(kinds, ["ADDED", "MODIFIED", "DELETED"]);

    // A streaming list: the current state, then a BOOKMARK marking the end of it.
    let mut w = api
        .watch(&format!("{CLAIMS}?watch=1&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan"))
        .await;
    assert_eq!(w.next().await.unwrap()["type"], "ADDED"); // "other"
    let end = w.next().await.unwrap();
    assert_eq!(end["type"], "BOOKMARK");
    assert_eq!(
        end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );

    // timeoutSeconds ends the stream.
    let mut w = api
        .watch(&format!("{CLAIMS}?watch=1&timeoutSeconds=1"))
        .await;
    assert_eq!(w.next_change().await.unwrap()["type"], "ADDED"); // "other"
    assert!(w.next_change().await.is_none());
}

#[tokio::test]
async fn watch_from_a_version_older_than_the_window_is_gone() {
    let c = cluster(3).await;
    let api = Client::new(&c);
    let (_, first) = api.post(CLAIMS, &claim("a")).await;
    for n in ["b", "c", "d", "e"] {
        api.post(CLAIMS, &claim(n)).await;
    }
    let mut w = api
        .watch(&format!("{CLAIMS}?watch=1&resourceVersion={}", rv(&first)))
        .await;
    let e = w.next().await.unwrap();
    assert_eq!(e["type"], "ERROR");
    assert_eq!(
        (e["object"]["code"].as_u64(), e["object"]["reason"].as_str()),
        (Some(410), Some("Expired"))
    );
    assert!(w.next().await.is_none());
    // A version inside the window still works.
    let (_, l) = api.get(CLAIMS).await;
    let mut w = api
        .watch(&format!(
            "{CLAIMS}?watch=1&resourceVersion={}",
            rv(&json!({"metadata": l["metadata"]})) - 1
        ))
        .await;
    assert_eq!(w.next().await.unwrap()["type"], "ADDED");
}

#[tokio::test]
async fn injected_faults_fail_delay_drop_and_expire() {
    let c = cluster(1000).await;
    let api = Client::new(&c);
    c.faults().fail_next("POST", "sandboxclaims", 503, 2);
    assert_eq!(api.post(CLAIMS, &claim("a")).await.0, 503);
    assert_eq!(api.get(CLAIMS).await.0, 200, "GET does not match the rule");
    assert_eq!(api.post(CLAIMS, &claim("a")).await.0, 503);
    assert_eq!(
        api.post(CLAIMS, &claim("a")).await.0,
        201,
        "the rule is used up"
    );

    c.faults().expire_next_watch();
    let mut w = api.watch(&format!("{CLAIMS}?watch=1")).await;
    assert_eq!(w.next().await.unwrap()["type"], "ADDED");
    let e = w.next().await.unwrap();
    assert_eq!(
        (e["type"].as_str(), e["object"]["code"].as_u64()),
        (Some("ERROR"), Some(410))
    );
    assert!(w.next().await.is_none());

    let mut w = api.watch(&format!("{CLAIMS}?watch=1")).await;
    assert_eq!(w.next().await.unwrap()["type"], "ADDED");
    c.faults().drop_watches();
    assert!(w.next().await.is_none(), "dropped");

    // A delayed create lands after an undelayed one sent later.
    c.faults().delay("POST", "slow", Duration::from_millis(500));
    let slow = {
        let api = Client::new(&c);
        tokio::spawn(async move { api.post(&format!("{CLAIMS}?slow=1"), &claim("slow")).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (_, fast) = api.post(CLAIMS, &claim("fast")).await;
    let (code, slow) = slow.await.unwrap();
    assert_eq!(code, 201);
    assert!(rv(&slow) > rv(&fast), "the delayed request was served last");
    c.faults().clear();

    // The same plan over HTTP, for clients outside the process.
    let faults = "/k8s-testcluster/v1/faults";
    let (code, _) = api.post(faults, &json!({"action": "fail_next", "method": "GET", "path": "/version", "status": 502, "count": 1})).await;
    assert_eq!(code, 200);
    assert_eq!(api.get("/version").await.0, 502);
    assert_eq!(api.get("/version").await.0, 200);
    assert_eq!(
        api.post(faults, &json!({"action": "fail_next", "status": 404}))
            .await
            .0,
        400
    );
    assert_eq!(api.post(faults, &json!({"action": "nope"})).await.0, 400);
    let anonymous = reqwest::Client::new()
        .post(format!("{}{faults}", c.api_url()))
        .json(&json!({"action": "clear"}));
    assert_eq!(api.send(anonymous).await.0, 401);

    c.faults().compact();
    let (_, l) = api.get(CLAIMS).await;
    let old = rv(&json!({"metadata": l["metadata"]})) - 1;
    let mut w = api
        .watch(&format!("{CLAIMS}?watch=1&resourceVersion={old}"))
        .await;
    assert_eq!(w.next().await.unwrap()["object"]["code"], 410);
}

#[tokio::test]
async fn discovery_documents_and_gateway() {
    let c = cluster(1000).await;
    let api = Client::new(&c);
    let (code, v) = api.get("/version").await;
    assert_eq!((code, v["major"].as_str()), (200, Some("1")));
    let (_, groups) = api.get("/apis").await;
    let names: Vec<&str> = groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "agents.x-k8s.io",
            "extensions.agents.x-k8s.io",
            "gateway.networking.k8s.io"
        ]
    );
    let (_, rl) = api.get("/apis/extensions.agents.x-k8s.io/v1beta1").await;
    let res: Vec<&str> = rl["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(
        res.contains(&"sandboxclaims") && res.contains(&"sandboxclaims/status"),
        "{res:?}"
    );
    assert_eq!(rl["resources"][0]["namespaced"], true);
    assert_eq!(api.get("/apis/nope.io/v1").await.0, 404);
    let (code, gw) = api
        .get("/apis/gateway.networking.k8s.io/v1/namespaces/default/gateways/sandbox-gateway")
        .await;
    assert_eq!(code, 200);
    assert_eq!(
        gw["status"]["addresses"][0]["value"].as_str(),
        c.router_url().strip_prefix("http://")
    );
    let kc = c.kubeconfig();
    assert!(kc.contains(&c.api_url()) && kc.contains(c.token()));
}
