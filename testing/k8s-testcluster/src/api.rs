//! The API server: Kubernetes REST semantics for the served custom resources, discovery,
//! and chunked watch streams.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use crate::error::ApiError;
use crate::faults::Faults;
use crate::http_util::{Body, channel_body, full, json_response, parse_query};
use crate::selector::{FieldSelector, LabelSelector, Selectors};
use crate::store::{
    DeleteOptions, Event, Part, Propagation, RESOURCES, ResourceDef, Store, find_resource,
    json_patch, merge_patch,
};

/// What the API server needs.
pub(crate) struct ApiState {
    pub store: Arc<Store>,
    pub faults: Faults,
    pub token: Option<String>,
    pub bookmark_interval: Duration,
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.code, &e.status())
}

/// Serve one request.
pub(crate) async fn handle(st: Arc<ApiState>, req: Request<Incoming>) -> Response<Body> {
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".to_owned());
    if req.uri().path() == FAULTS_PATH {
        return match faults_endpoint(&st, req).await {
            Ok(r) => r,
            Err(e) => error_response(&e),
        };
    }
    let verdict = st.faults.verdict(req.method().as_str(), &pq);
    if let Some(d) = verdict.delay {
        tokio::time::sleep(d).await;
    }
    if let Some(code) = verdict.fail {
        return error_response(&ApiError::injected(code));
    }
    match route(&st, req).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(path = %pq, code = e.code, reason = e.reason, "api error");
            error_response(&e)
        }
    }
}

/// The test-only fault endpoint (not a Kubernetes path): `POST` a JSON action.
pub const FAULTS_PATH: &str = "/k8s-testcluster/v1/faults";

/// `POST /k8s-testcluster/v1/faults` with `{"action": ...}`: the [`Faults`] handle for
/// clients outside this process (the fidelity script, `cargo xtask k8s-up` users).
async fn faults_endpoint(
    st: &Arc<ApiState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    if !authorized(st, &req) {
        return Err(ApiError::unauthorized());
    }
    if req.method() != Method::POST {
        return Err(ApiError::method_not_allowed(req.method().as_str()));
    }
    let (_, body) = read_json(req).await?;
    let s = |k: &str| body[k].as_str().unwrap_or("").to_owned();
    let n = |k: &str| body[k].as_u64();
    let f = &st.faults;
    match s("action").as_str() {
        "fail_next" => {
            let status = n("status")
                .and_then(|c| u16::try_from(c).ok())
                .filter(|c| (500..600).contains(c))
                .ok_or_else(|| ApiError::bad_request("fail_next needs a 5xx `status`"))?;
            let count = n("count").unwrap_or(1);
            f.fail_next(
                &s("method"),
                &s("path"),
                status,
                usize::try_from(count).unwrap_or(usize::MAX),
            );
        }
        "delay" => {
            let ms = n("millis").ok_or_else(|| ApiError::bad_request("delay needs `millis`"))?;
            f.delay(&s("method"), &s("path"), Duration::from_millis(ms));
        }
        "clear" => f.clear(),
        "drop_watches" => f.drop_watches(),
        "expire_next_watch" => f.expire_next_watch(),
        "compact" => f.compact(),
        "kill_pod" => f
            .kill_pod(&s("namespace"), &s("name"))
            .await
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
        other => {
            return Err(ApiError::bad_request(format!(
                "unknown fault action `{other}`"
            )));
        }
    }
    Ok(json_response(200, &json!({"ok": true})))
}

fn authorized(st: &ApiState, req: &Request<Incoming>) -> bool {
    let Some(token) = &st.token else { return true };
    req.headers()
        .get("authorization")
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .is_some_and(|t| t.trim() == token)
}

/// A parsed resource path.
struct Target {
    res: &'static ResourceDef,
    ns: Option<String>,
    name: Option<String>,
    status: bool,
}

async fn route(st: &Arc<ApiState>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().to_owned();
    if matches!(path.as_str(), "/healthz" | "/livez" | "/readyz") {
        return Ok(Response::new(full("ok")));
    }
    if !authorized(st, &req) {
        return Err(ApiError::unauthorized());
    }
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let get_only = |m: &Method| {
        if m == Method::GET {
            Ok(())
        } else {
            Err(ApiError::method_not_allowed(m.as_str()))
        }
    };
    let target = match segs.as_slice() {
        ["version"] => {
            get_only(req.method())?;
            return Ok(json_response(200, &version_doc()));
        }
        ["api"] => {
            get_only(req.method())?;
            return Ok(json_response(
                200,
                &json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}),
            ));
        }
        ["api", "v1"] => {
            get_only(req.method())?;
            return Ok(json_response(
                200,
                &json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": [{"name": "namespaces", "singularName": "namespace", "namespaced": false, "kind": "Namespace", "verbs": ["get"]}]}),
            ));
        }
        ["api", "v1", "namespaces", ns] => {
            get_only(req.method())?;
            return Ok(json_response(
                200,
                &json!({"kind": "Namespace", "apiVersion": "v1", "metadata": {"name": ns}, "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}),
            ));
        }
        ["apis"] => {
            get_only(req.method())?;
            return Ok(json_response(200, &group_list()));
        }
        ["apis", g] => {
            get_only(req.method())?;
            let groups = group_list();
            let found = groups["groups"]
                .as_array()
                .and_then(|a| a.iter().find(|x| x["name"] == *g))
                .cloned()
                .ok_or_else(|| ApiError::no_route(&path))?;
            let mut doc = found;
            doc["kind"] = json!("APIGroup");
            doc["apiVersion"] = json!("v1");
            return Ok(json_response(200, &doc));
        }
        ["apis", g, v] => {
            get_only(req.method())?;
            return Ok(json_response(
                200,
                &resource_list(g, v).ok_or_else(|| ApiError::no_route(&path))?,
            ));
        }
        ["apis", g, v, plural] => Target {
            res: find_resource(g, v, plural).ok_or_else(|| ApiError::no_route(&path))?,
            ns: None,
            name: None,
            status: false,
        },
        ["apis", g, v, "namespaces", ns, plural, rest @ ..] if rest.len() <= 2 => {
            let res = find_resource(g, v, plural).ok_or_else(|| ApiError::no_route(&path))?;
            let status = match rest.get(1) {
                None => false,
                Some(&"status") => true,
                Some(_) => return Err(ApiError::no_route(&path)),
            };
            Target {
                res,
                ns: Some((*ns).to_owned()),
                name: rest.first().map(|n| (*n).to_owned()),
                status,
            }
        }
        _ => return Err(ApiError::no_route(&path)),
    };
    serve_resource(st, req, target).await
}

async fn read_json(req: Request<Incoming>) -> Result<(String, Value), ApiError> {
    let ct = req
        .headers()
        .get("content-type")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("application/json")
        .to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?
        .to_bytes();
    if body.is_empty() {
        return Ok((ct, Value::Null));
    }
    let v = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the body is not JSON: {e}")))?;
    Ok((ct, v))
}

fn list_doc(
    res: &ResourceDef,
    items: Vec<Value>,
    rv: u64,
    cont: Option<String>,
    remaining: usize,
) -> Value {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if let Some(c) = cont {
        meta["continue"] = json!(c);
        meta["remainingItemCount"] = json!(remaining);
    }
    json!({"apiVersion": res.api_version(), "kind": format!("{}List", res.kind), "metadata": meta, "items": items})
}

async fn serve_resource(
    st: &Arc<ApiState>,
    req: Request<Incoming>,
    t: Target,
) -> Result<Response<Body>, ApiError> {
    let query = parse_query(req.uri().query());
    let q = |k: &str| query.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.clone());
    let method = req.method().clone();
    let store = &st.store;
    let res = t.res;
    match (&t.ns, &t.name, t.status) {
        // Collections.
        (ns, None, false) => {
            let sel = Selectors {
                labels: LabelSelector::parse(&q("labelSelector").unwrap_or_default())?,
                fields: FieldSelector::parse(&q("fieldSelector").unwrap_or_default())?,
            };
            match method {
                Method::GET => {
                    if q("watch").is_some_and(|w| w == "1" || w == "true") {
                        let timeout = q("timeoutSeconds")
                            .map(|s| {
                                s.parse::<u64>()
                                    .map_err(|_| ApiError::bad_request("invalid timeoutSeconds"))
                            })
                            .transpose()?
                            .map(Duration::from_secs);
                        let bookmarks =
                            q("allowWatchBookmarks").is_some_and(|b| b == "true" || b == "1");
                        // Streaming lists: the current state, then a BOOKMARK marking its end.
                        let initial_end = q("sendInitialEvents").is_some_and(|b| b == "true");
                        if initial_end && !bookmarks {
                            return Err(ApiError::invalid(
                                res.group,
                                res.plural,
                                "",
                                "sendInitialEvents requires allowWatchBookmarks=true",
                            ));
                        }
                        let rv = if initial_end {
                            None
                        } else {
                            q("resourceVersion")
                        };
                        return Ok(watch(
                            st,
                            res,
                            ns.clone(),
                            sel,
                            rv,
                            timeout,
                            bookmarks,
                            initial_end,
                        ));
                    }
                    let limit = q("limit")
                        .map(|s| {
                            s.parse::<usize>()
                                .map_err(|_| ApiError::bad_request("invalid limit"))
                        })
                        .transpose()?;
                    let page =
                        store.list(res, ns.as_deref(), &sel, limit, q("continue").as_deref())?;
                    Ok(json_response(
                        200,
                        &list_doc(
                            res,
                            page.items,
                            page.resource_version,
                            page.continue_token,
                            page.remaining,
                        ),
                    ))
                }
                Method::POST => {
                    let ns = ns
                        .as_deref()
                        .ok_or_else(|| ApiError::method_not_allowed("POST"))?;
                    let (_, body) = read_json(req).await?;
                    Ok(json_response(201, &store.create(res, ns, body)?))
                }
                Method::DELETE => {
                    let page = store.list(res, ns.as_deref(), &sel, None, None)?;
                    let (_, body) = read_json(req).await?;
                    let opts = delete_options(&body, q("propagationPolicy"))?;
                    let mut deleted = Vec::new();
                    for o in page.items {
                        let ons = o["metadata"]["namespace"].as_str().unwrap_or("");
                        let name = o["metadata"]["name"].as_str().unwrap_or("");
                        match store.delete(
                            res,
                            ons,
                            name,
                            &DeleteOptions {
                                uid: None,
                                resource_version: None,
                                ..opts.clone()
                            },
                        ) {
                            Ok(d) => deleted.push(d),
                            Err(e) if e.code == 404 => {}
                            Err(e) => return Err(e),
                        }
                    }
                    Ok(json_response(
                        200,
                        &list_doc(res, deleted, store.resource_version(), None, 0),
                    ))
                }
                m => Err(ApiError::method_not_allowed(m.as_str())),
            }
        }
        (None, _, _) => Err(ApiError::no_route("a named object needs a namespace")),
        (Some(ns), Some(name), status) => {
            let part = if status { Part::Status } else { Part::Main };
            match method {
                Method::GET => Ok(json_response(200, &store.get(res, ns, name)?)),
                Method::PUT => {
                    let (_, body) = read_json(req).await?;
                    Ok(json_response(
                        200,
                        &store.replace(res, ns, name, body, part)?,
                    ))
                }
                Method::PATCH => {
                    let (ct, body) = read_json(req).await?;
                    if ct.contains("apply-patch") && !status {
                        // Server-side apply, approximated: create when missing, else merge.
                        if store.get(res, ns, name).is_err() {
                            let mut obj = body;
                            obj["metadata"]["name"] = json!(name);
                            return Ok(json_response(201, &store.create(res, ns, obj)?));
                        }
                    }
                    let kind = if ct.contains("json-patch+json") {
                        PatchKind::Json
                    } else if ct.contains("merge-patch+json") || ct.contains("apply-patch") {
                        PatchKind::Merge
                    } else {
                        return Err(ApiError::unsupported_media_type(&ct));
                    };
                    let out = store.patch(res, ns, name, part, |obj| match kind {
                        PatchKind::Json => json_patch(obj, &body),
                        PatchKind::Merge => {
                            merge_patch(obj, &body);
                            Ok(())
                        }
                    })?;
                    Ok(json_response(200, &out))
                }
                Method::DELETE if !status => {
                    let (_, body) = read_json(req).await?;
                    let opts = delete_options(&body, q("propagationPolicy"))?;
                    Ok(json_response(200, &store.delete(res, ns, name, &opts)?))
                }
                m => Err(ApiError::method_not_allowed(m.as_str())),
            }
        }
        (Some(_), None, true) => Err(ApiError::no_route("status of a collection")),
    }
}

#[derive(Clone, Copy)]
enum PatchKind {
    Json,
    Merge,
}

fn delete_options(body: &Value, query_policy: Option<String>) -> Result<DeleteOptions, ApiError> {
    let s = |p: &str| body.pointer(p).and_then(Value::as_str).map(str::to_owned);
    let policy = query_policy.or_else(|| s("/propagationPolicy"));
    let propagation = match policy.as_deref() {
        None | Some("Background") => Propagation::Background,
        Some("Foreground") => Propagation::Foreground,
        Some("Orphan") => Propagation::Orphan,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unknown propagationPolicy `{other}`"
            )));
        }
    };
    Ok(DeleteOptions {
        uid: s("/preconditions/uid"),
        resource_version: s("/preconditions/resourceVersion"),
        propagation,
    })
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn expired_line(msg: &str) -> Bytes {
    event_line("ERROR", &ApiError::expired(msg.to_owned()).status())
}

/// A chunked watch stream of newline-delimited `{"type","object"}` events.
#[allow(clippy::too_many_arguments)]
fn watch(
    st: &Arc<ApiState>,
    res: &'static ResourceDef,
    ns: Option<String>,
    sel: Selectors,
    rv: Option<String>,
    timeout: Option<Duration>,
    bookmarks: bool,
    initial_end: bool,
) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let start = st.store.watch(res, ns.as_deref(), &sel, rv.as_deref());
    let expire = st.faults.take_watch_expiry();
    let mut drop_signal = st.faults.drop_signal();
    let interval = st.bookmark_interval;
    tokio::spawn(async move {
        let start = match start {
            Ok(s) => s,
            Err(e) => {
                let _ = tx.send(event_line("ERROR", &e.status())).await;
                return;
            }
        };
        for e in &start.initial {
            if tx
                .send(event_line(e.kind.as_str(), &e.object))
                .await
                .is_err()
            {
                return;
            }
        }
        if initial_end {
            let obj = json!({"apiVersion": res.api_version(), "kind": res.kind, "metadata": {
                "resourceVersion": start.rv.to_string(),
                "annotations": {"k8s.io/initial-events-end": "true"}}});
            if tx.send(event_line("BOOKMARK", &obj)).await.is_err() {
                return;
            }
        }
        if expire {
            let _ = tx
                .send(expired_line(
                    "injected fault: the watch's resourceVersion is too old",
                ))
                .await;
            return;
        }
        let matches = |e: &Event| {
            e.res.plural == res.plural
                && ns
                    .as_deref()
                    .is_none_or(|n| e.object["metadata"]["namespace"] == n)
                && sel.matches(&e.object)
        };
        let mut feed = start.feed;
        let mut seen = start.rv;
        let deadline = tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(30 * 60)));
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        drop_signal.mark_unchanged();
        loop {
            tokio::select! {
                r = feed.recv() => match r {
                    Ok(e) => {
                        seen = seen.max(e.rv);
                        if e.rv > start.rv && matches(&e) && tx.send(event_line(e.kind.as_str(), &e.object)).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let _ = tx.send(expired_line("the watcher fell behind the event window")).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick(), if bookmarks => {
                    let obj = json!({"apiVersion": res.api_version(), "kind": res.kind, "metadata": {"resourceVersion": seen.to_string()}});
                    if tx.send(event_line("BOOKMARK", &obj)).await.is_err() {
                        return;
                    }
                }
                _ = &mut deadline => return,
                _ = drop_signal.changed() => return,
                _ = tx.closed() => return,
            }
        }
    });
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(channel_body(rx))
        .expect("static response parts are valid")
}

fn version_doc() -> Value {
    json!({
        "major": "1", "minor": "33", "gitVersion": "v1.33.0+k8s-testcluster",
        "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc",
        "platform": "linux/amd64"
    })
}

fn group_list() -> Value {
    let mut groups: Vec<Value> = Vec::new();
    for r in RESOURCES {
        if groups.iter().any(|g| g["name"] == r.group) {
            continue;
        }
        let gv = json!({"groupVersion": r.api_version(), "version": r.version});
        groups.push(json!({"name": r.group, "versions": [gv.clone()], "preferredVersion": gv}));
    }
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

fn resource_list(group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        resources.push(json!({
            "name": r.plural, "singularName": r.singular, "namespaced": true, "kind": r.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            "shortNames": r.short_names,
        }));
        resources.push(json!({
            "name": format!("{}/status", r.plural), "singularName": "", "namespaced": true,
            "kind": r.kind, "verbs": ["get", "patch", "update"],
        }));
    }
    (!resources.is_empty()).then(|| {
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{group}/{version}"), "resources": resources})
    })
}
