//! The object store behind the API server: namespaced custom resources with one global
//! resourceVersion counter, a bounded event log for watches, optimistic concurrency, the
//! status subresource and ownerReference cascade on delete.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use base64::Engine as _;
use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use crate::error::ApiError;
use crate::selector::Selectors;

/// A served resource type.
#[derive(Debug, PartialEq, Eq)]
pub struct ResourceDef {
    /// API group.
    pub group: &'static str,
    /// Served version.
    pub version: &'static str,
    /// Plural (the path segment).
    pub plural: &'static str,
    /// Singular name.
    pub singular: &'static str,
    /// Kind.
    pub kind: &'static str,
    /// Short names (discovery).
    pub short_names: &'static [&'static str],
}

impl ResourceDef {
    /// `group/version`.
    pub fn api_version(&self) -> String {
        format!("{}/{}", self.group, self.version)
    }
}

/// `agents.x-k8s.io/v1beta1` Sandbox.
pub const SANDBOX: ResourceDef = ResourceDef {
    group: "agents.x-k8s.io",
    version: "v1beta1",
    plural: "sandboxes",
    singular: "sandbox",
    kind: "Sandbox",
    short_names: &["sandbox"],
};
/// `extensions.agents.x-k8s.io/v1beta1` SandboxClaim.
pub const CLAIM: ResourceDef = ResourceDef {
    group: "extensions.agents.x-k8s.io",
    version: "v1beta1",
    plural: "sandboxclaims",
    singular: "sandboxclaim",
    kind: "SandboxClaim",
    short_names: &[],
};
/// `extensions.agents.x-k8s.io/v1beta1` SandboxTemplate.
pub const TEMPLATE: ResourceDef = ResourceDef {
    group: "extensions.agents.x-k8s.io",
    version: "v1beta1",
    plural: "sandboxtemplates",
    singular: "sandboxtemplate",
    kind: "SandboxTemplate",
    short_names: &[],
};
/// `extensions.agents.x-k8s.io/v1beta1` SandboxWarmPool.
pub const WARM_POOL: ResourceDef = ResourceDef {
    group: "extensions.agents.x-k8s.io",
    version: "v1beta1",
    plural: "sandboxwarmpools",
    singular: "sandboxwarmpool",
    kind: "SandboxWarmPool",
    short_names: &[],
};
/// `gateway.networking.k8s.io/v1` Gateway.
pub const GATEWAY: ResourceDef = ResourceDef {
    group: "gateway.networking.k8s.io",
    version: "v1",
    plural: "gateways",
    singular: "gateway",
    kind: "Gateway",
    short_names: &["gtw"],
};

/// Every served resource.
pub static RESOURCES: [&ResourceDef; 5] = [&SANDBOX, &CLAIM, &TEMPLATE, &WARM_POOL, &GATEWAY];

/// The resource served at `/apis/<group>/<version>/.../<plural>`.
pub fn find_resource(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .copied()
        .find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// A watch event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Created.
    Added,
    /// Changed.
    Modified,
    /// Deleted.
    Deleted,
}

impl EventType {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One change of one object, at one resourceVersion.
#[derive(Debug)]
pub struct Event {
    /// The resourceVersion this change produced.
    pub rv: u64,
    /// The resource type.
    pub res: &'static ResourceDef,
    /// What happened.
    pub kind: EventType,
    /// The object after the change (before it, for a delete, with the delete's version).
    pub object: Value,
}

/// How a delete treats the object's dependents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Propagation {
    /// Delete dependents (after the owner; the default for custom resources).
    #[default]
    Background,
    /// Delete dependents; this server does it the same way as Background.
    Foreground,
    /// Keep dependents and drop their ownerReference to the deleted object.
    Orphan,
}

/// Preconditions and propagation of a delete.
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    /// `preconditions.uid`.
    pub uid: Option<String>,
    /// `preconditions.resourceVersion`.
    pub resource_version: Option<String>,
    /// `propagationPolicy`.
    pub propagation: Propagation,
}

/// One page of a list.
#[derive(Debug)]
pub struct ListPage {
    /// The matching objects of this page.
    pub items: Vec<Value>,
    /// The list's resourceVersion.
    pub resource_version: u64,
    /// The token for the next page, when there is one.
    pub continue_token: Option<String>,
    /// How many matching objects follow this page.
    pub remaining: usize,
}

/// What a watch starts with: the events to send first and the live feed.
pub struct WatchStart {
    /// Events to send before the live feed (the current state as ADDED, or the kept events
    /// after the requested resourceVersion).
    pub initial: Vec<Arc<Event>>,
    /// The resourceVersion everything up to which is covered by `initial`.
    pub rv: u64,
    /// Every later event, for every resource; the watcher filters.
    pub feed: broadcast::Receiver<Arc<Event>>,
}

type Key = (&'static str, String, String);

struct Inner {
    objects: BTreeMap<Key, Value>,
    rv: u64,
    log: VecDeque<Arc<Event>>,
    /// Events at or below this version are gone from the log.
    compacted: u64,
    window: usize,
}

/// The store. Cheap to share behind an `Arc`.
pub struct Store {
    inner: Mutex<Inner>,
    feed: broadcast::Sender<Arc<Event>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHABET[fastrand::usize(..ALPHABET.len())] as char)
        .collect()
}

/// DNS-1123 subdomain, as the API server requires of custom resource names.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric()
}

/// Everything but `metadata` and `status`: a change here bumps `metadata.generation`.
fn spec_part(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
        m.remove("apiVersion");
        m.remove("kind");
    }
    o
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            let t = target.as_object_mut().expect("made an object above");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// RFC 6902 JSON patch (`add`, `remove`, `replace`, `test`, `copy`, `move`).
pub fn json_patch(target: &mut Value, ops: &Value) -> Result<(), ApiError> {
    let ops = ops
        .as_array()
        .ok_or_else(|| ApiError::bad_request("a JSON patch must be an array"))?;
    let bad = |m: String| ApiError::bad_request(format!("json patch: {m}"));
    for op in ops {
        let name = op.get("op").and_then(Value::as_str).unwrap_or("");
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing path".into()))?;
        match name {
            "add" | "replace" | "test" => {
                let value = op
                    .get("value")
                    .cloned()
                    .ok_or_else(|| bad(format!("{name} without value")))?;
                if name == "test" {
                    if target.pointer(path) != Some(&value) {
                        return Err(ApiError::invalid(
                            "",
                            "",
                            "",
                            format!("test failed at {path}"),
                        ));
                    }
                } else {
                    pointer_set(target, path, value, name == "add").map_err(bad)?;
                }
            }
            "remove" => {
                pointer_remove(target, path).map_err(bad)?;
            }
            "copy" | "move" => {
                let from = op
                    .get("from")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("missing from".into()))?;
                let v = target
                    .pointer(from)
                    .cloned()
                    .ok_or_else(|| bad(format!("no value at {from}")))?;
                if name == "move" {
                    pointer_remove(target, from).map_err(bad)?;
                }
                pointer_set(target, path, v, true).map_err(bad)?;
            }
            other => return Err(bad(format!("unknown op `{other}`"))),
        }
    }
    Ok(())
}

fn split_pointer(path: &str) -> Result<(String, String), String> {
    let idx = path
        .rfind('/')
        .ok_or_else(|| format!("bad path `{path}`"))?;
    let last = path[idx + 1..].replace("~1", "/").replace("~0", "~");
    Ok((path[..idx].to_owned(), last))
}

fn pointer_set(target: &mut Value, path: &str, value: Value, add: bool) -> Result<(), String> {
    if path.is_empty() {
        *target = value;
        return Ok(());
    }
    let (parent, last) = split_pointer(path)?;
    let p = target
        .pointer_mut(&parent)
        .ok_or_else(|| format!("no parent at `{parent}`"))?;
    match p {
        Value::Object(m) => {
            if !add && !m.contains_key(&last) {
                return Err(format!("no value at `{path}` to replace"));
            }
            m.insert(last, value);
        }
        Value::Array(a) => {
            if last == "-" && add {
                a.push(value);
            } else {
                let i: usize = last.parse().map_err(|_| format!("bad index `{last}`"))?;
                if add && i <= a.len() {
                    a.insert(i, value);
                } else if !add && i < a.len() {
                    a[i] = value;
                } else {
                    return Err(format!("index {i} out of range"));
                }
            }
        }
        _ => return Err(format!("`{parent}` is not a container")),
    }
    Ok(())
}

fn pointer_remove(target: &mut Value, path: &str) -> Result<(), String> {
    let (parent, last) = split_pointer(path)?;
    let p = target
        .pointer_mut(&parent)
        .ok_or_else(|| format!("no parent at `{parent}`"))?;
    let removed = match p {
        Value::Object(m) => m.remove(&last).is_some(),
        Value::Array(a) => match last.parse::<usize>() {
            Ok(i) if i < a.len() => {
                a.remove(i);
                true
            }
            _ => false,
        },
        _ => false,
    };
    if removed {
        Ok(())
    } else {
        Err(format!("no value at `{path}` to remove"))
    }
}

/// Which part of an object a write changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The main resource: everything but `status`.
    Main,
    /// The `status` subresource: only `status`.
    Status,
}

impl Store {
    /// An empty store keeping the last `window` events for watches.
    pub fn new(window: usize) -> Self {
        let (feed, _) = broadcast::channel(8192);
        Self {
            inner: Mutex::new(Inner {
                objects: BTreeMap::new(),
                rv: 0,
                log: VecDeque::new(),
                compacted: 0,
                window: window.max(1),
            }),
            feed,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Forget every kept event: a watch or continue from any earlier version gets 410.
    pub fn compact(&self) {
        let mut inner = self.lock();
        inner.compacted = inner.rv;
        inner.log.clear();
    }

    /// A receiver of every later event.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.feed.subscribe()
    }

    /// Record a change: bump the version, stamp it on the object, log and broadcast it.
    fn commit(
        &self,
        inner: &mut Inner,
        res: &'static ResourceDef,
        kind: EventType,
        mut obj: Value,
    ) -> Value {
        inner.rv += 1;
        let rv = inner.rv;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = (
            res.plural,
            meta_str(&obj, "namespace").unwrap_or("").to_owned(),
            meta_str(&obj, "name").unwrap_or("").to_owned(),
        );
        if kind == EventType::Deleted {
            inner.objects.remove(&key);
        } else {
            inner.objects.insert(key, obj.clone());
        }
        let event = Arc::new(Event {
            rv,
            res,
            kind,
            object: obj.clone(),
        });
        inner.log.push_back(event.clone());
        while inner.log.len() > inner.window {
            if let Some(old) = inner.log.pop_front() {
                inner.compacted = old.rv;
            }
        }
        // Nobody listening is fine.
        let _ = self.feed.send(event);
        obj
    }

    /// Create (POST). Fills `metadata.name` from `generateName`, uid, creationTimestamp,
    /// generation, resourceVersion; the name must be free.
    pub fn create(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        mut obj: Value,
    ) -> Result<Value, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        if let Some(av) = obj.get("apiVersion").and_then(Value::as_str)
            && av != res.api_version()
        {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({})",
                res.api_version()
            )));
        }
        if let Some(k) = obj.get("kind").and_then(Value::as_str)
            && k != res.kind
        {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                res.kind
            )));
        }
        obj["apiVersion"] = json!(res.api_version());
        obj["kind"] = json!(res.kind);
        if !obj.get("metadata").is_some_and(Value::is_object) {
            obj["metadata"] = json!({});
        }
        if let Some(n) = meta_str(&obj, "namespace")
            && n != ns
        {
            return Err(ApiError::bad_request(format!(
                "the namespace of the provided object ({n}) does not match the namespace sent on the request ({ns})"
            )));
        }
        let mut inner = self.lock();
        let name = match meta_str(&obj, "name").filter(|n| !n.is_empty()) {
            Some(n) => n.to_owned(),
            None => {
                let prefix = meta_str(&obj, "generateName").unwrap_or("").to_owned();
                if prefix.is_empty() {
                    return Err(ApiError::invalid(
                        res.group,
                        res.plural,
                        "",
                        "metadata.name: Required value: name or generateName is required",
                    ));
                }
                let mut tries = 0;
                loop {
                    let candidate = format!("{prefix}{}", random_suffix());
                    if !inner
                        .objects
                        .contains_key(&(res.plural, ns.to_owned(), candidate.clone()))
                    {
                        break candidate;
                    }
                    tries += 1;
                    if tries > 10 {
                        return Err(ApiError::already_exists(res.group, res.plural, &candidate));
                    }
                }
            }
        };
        if !valid_name(&name) {
            return Err(ApiError::invalid(
                res.group,
                res.plural,
                &name,
                format!(
                    "metadata.name: Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
                ),
            ));
        }
        if inner
            .objects
            .contains_key(&(res.plural, ns.to_owned(), name.clone()))
        {
            return Err(ApiError::already_exists(res.group, res.plural, &name));
        }
        let m = &mut obj["metadata"];
        m["name"] = json!(name);
        m["namespace"] = json!(ns);
        m["uid"] = json!(uuid::Uuid::new_v4().to_string());
        m["creationTimestamp"] = json!(now_rfc3339());
        m["generation"] = json!(1);
        if let Some(mm) = m.as_object_mut() {
            mm.remove("deletionTimestamp");
            mm.remove("resourceVersion");
        }
        Ok(self.commit(&mut inner, res, EventType::Added, obj))
    }

    /// Get one object.
    pub fn get(&self, res: &'static ResourceDef, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.lock()
            .objects
            .get(&(res.plural, ns.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(res.group, res.plural, name))
    }

    /// List (one namespace or all), filtered, paged by `limit` and `continue`.
    pub fn list(
        &self,
        res: &'static ResourceDef,
        ns: Option<&str>,
        sel: &Selectors,
        limit: Option<usize>,
        continue_token: Option<&str>,
    ) -> Result<ListPage, ApiError> {
        let inner = self.lock();
        let start = match continue_token.filter(|t| !t.is_empty()) {
            Some(t) => {
                let (rv, after) = decode_continue(t)?;
                if rv < inner.compacted {
                    return Err(ApiError::expired(
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    ));
                }
                Some(after)
            }
            None => None,
        };
        let mut items = Vec::new();
        let mut remaining = 0usize;
        let mut last_key: Option<String> = None;
        for ((plural, ons, name), obj) in &inner.objects {
            if *plural != res.plural || ns.is_some_and(|n| n != ons) {
                continue;
            }
            let key = format!("{ons}/{name}");
            if start.as_ref().is_some_and(|s| key.as_str() <= s.as_str()) {
                continue;
            }
            if !sel.matches(obj) {
                continue;
            }
            if limit.is_some_and(|l| l > 0 && items.len() >= l) {
                remaining += 1;
                continue;
            }
            last_key = Some(key);
            items.push(obj.clone());
        }
        let continue_token = (remaining > 0)
            .then(|| last_key.map(|k| encode_continue(inner.rv, &k)))
            .flatten();
        Ok(ListPage {
            items,
            resource_version: inner.rv,
            continue_token,
            remaining,
        })
    }

    /// Replace (PUT) the main resource or the status subresource. `metadata.resourceVersion`
    /// is required and must be current (409 otherwise).
    pub fn replace(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        body: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        self.replace_locked(&mut inner, res, ns, name, body, part, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn replace_locked(
        &self,
        inner: &mut Inner,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        mut body: Value,
        part: Part,
        rv_required: bool,
    ) -> Result<Value, ApiError> {
        if !body.is_object() {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        let old = inner
            .objects
            .get(&(res.plural, ns.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(res.group, res.plural, name))?;
        if let Some(n) = meta_str(&body, "name")
            && n != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({n}) does not match the name on the URL ({name})"
            )));
        }
        match meta_str(&body, "resourceVersion").filter(|v| !v.is_empty()) {
            Some(v) if Some(v) != meta_str(&old, "resourceVersion") => {
                return Err(ApiError::conflict(
                    res.group,
                    res.plural,
                    name,
                    "the object has been modified; please apply your changes to the latest version and try again",
                ));
            }
            Some(_) => {}
            None if rv_required => {
                return Err(ApiError::invalid(
                    res.group,
                    res.plural,
                    name,
                    "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
                ));
            }
            None => {}
        }
        if let Some(u) = meta_str(&body, "uid").filter(|u| !u.is_empty())
            && Some(u) != meta_str(&old, "uid")
        {
            return Err(ApiError::conflict(
                res.group,
                res.plural,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {u}, UID in object meta: {}",
                    meta_str(&old, "uid").unwrap_or("")
                ),
            ));
        }
        let new = match part {
            Part::Status => {
                let mut new = old.clone();
                match body.get("status") {
                    Some(s) => new["status"] = s.clone(),
                    None => {
                        if let Some(m) = new.as_object_mut() {
                            m.remove("status");
                        }
                    }
                }
                new
            }
            Part::Main => {
                body["apiVersion"] = json!(res.api_version());
                body["kind"] = json!(res.kind);
                if !body.get("metadata").is_some_and(Value::is_object) {
                    body["metadata"] = json!({});
                }
                let m = &mut body["metadata"];
                for field in [
                    "name",
                    "namespace",
                    "uid",
                    "creationTimestamp",
                    "generation",
                    "deletionTimestamp",
                ] {
                    match old["metadata"].get(field) {
                        Some(v) => m[field] = v.clone(),
                        None => {
                            if let Some(mm) = m.as_object_mut() {
                                mm.remove(field);
                            }
                        }
                    }
                }
                match old.get("status") {
                    Some(s) => body["status"] = s.clone(),
                    None => {
                        if let Some(b) = body.as_object_mut() {
                            b.remove("status");
                        }
                    }
                }
                if spec_part(&body) != spec_part(&old) {
                    let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
                    body["metadata"]["generation"] = json!(g + 1);
                }
                body
            }
        };
        let mut cmp = new.clone();
        cmp["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if cmp == old {
            // A no-op write: no new version, no event (as on a real API server).
            return Ok(old);
        }
        Ok(self.commit(inner, res, EventType::Modified, new))
    }

    /// Patch: apply `f` to the current object and write the result (main resource or status).
    /// A resourceVersion the patch sets is a precondition.
    pub fn patch(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        part: Part,
        f: impl FnOnce(&mut Value) -> Result<(), ApiError>,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let mut obj = inner
            .objects
            .get(&(res.plural, ns.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(res.group, res.plural, name))?;
        f(&mut obj)?;
        self.replace_locked(&mut inner, res, ns, name, obj, part, false)
    }

    /// Delete one object, with preconditions; cascades to the objects it owns.
    pub fn delete(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let old = inner
            .objects
            .get(&(res.plural, ns.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(res.group, res.plural, name))?;
        if let Some(u) = &opts.uid
            && Some(u.as_str()) != meta_str(&old, "uid")
        {
            return Err(ApiError::conflict(
                res.group,
                res.plural,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {u}, UID in object meta: {}",
                    meta_str(&old, "uid").unwrap_or("")
                ),
            ));
        }
        if let Some(v) = &opts.resource_version
            && Some(v.as_str()) != meta_str(&old, "resourceVersion")
        {
            return Err(ApiError::conflict(
                res.group,
                res.plural,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {v}, ResourceVersion in object meta: {}",
                    meta_str(&old, "resourceVersion").unwrap_or("")
                ),
            ));
        }
        let mut gone = old.clone();
        gone["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        let deleted = self.commit(&mut inner, res, EventType::Deleted, gone);
        let uid = meta_str(&old, "uid").unwrap_or("").to_owned();
        self.cascade(&mut inner, &uid, opts.propagation);
        Ok(deleted)
    }

    /// Delete (or orphan) every object with an ownerReference to `uid`, recursively.
    fn cascade(&self, inner: &mut Inner, uid: &str, propagation: Propagation) {
        let dependents: Vec<(Key, Value)> = inner
            .objects
            .iter()
            .filter(|(_, o)| {
                o.pointer("/metadata/ownerReferences")
                    .and_then(Value::as_array)
                    .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
            })
            .map(|(k, o)| (k.clone(), o.clone()))
            .collect();
        for ((plural, _, _), mut obj) in dependents {
            let Some(res) = RESOURCES.iter().copied().find(|r| r.plural == plural) else {
                continue;
            };
            if propagation == Propagation::Orphan {
                if let Some(refs) = obj["metadata"]["ownerReferences"].as_array_mut() {
                    refs.retain(|r| r["uid"] != uid);
                }
                self.commit(inner, res, EventType::Modified, obj);
            } else {
                obj["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
                let child_uid = meta_str(&obj, "uid").unwrap_or("").to_owned();
                self.commit(inner, res, EventType::Deleted, obj);
                self.cascade(inner, &child_uid, propagation);
            }
        }
    }

    /// Start a watch: `rv` None/""/"0" sends the current state as ADDED first; a number
    /// replays the kept events after it (410 if they are gone).
    pub fn watch(
        &self,
        res: &'static ResourceDef,
        ns: Option<&str>,
        sel: &Selectors,
        rv: Option<&str>,
    ) -> Result<WatchStart, ApiError> {
        let inner = self.lock();
        let feed = self.feed.subscribe();
        let matches = |e: &Event| {
            e.res.plural == res.plural
                && ns.is_none_or(|n| meta_str(&e.object, "namespace") == Some(n))
                && sel.matches(&e.object)
        };
        let initial = match rv.filter(|v| !v.is_empty() && *v != "0") {
            None => inner
                .objects
                .iter()
                .filter(|((p, ons, _), o)| {
                    *p == res.plural && ns.is_none_or(|n| n == ons) && sel.matches(o)
                })
                .map(|(_, o)| {
                    Arc::new(Event {
                        rv: o["metadata"]["resourceVersion"]
                            .as_str()
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(0),
                        res,
                        kind: EventType::Added,
                        object: o.clone(),
                    })
                })
                .collect(),
            Some(v) => {
                let from: u64 = v
                    .parse()
                    .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion `{v}`")))?;
                if from < inner.compacted {
                    return Err(ApiError::expired(format!(
                        "too old resource version: {from} ({})",
                        inner.compacted + 1
                    )));
                }
                inner
                    .log
                    .iter()
                    .filter(|e| e.rv > from && matches(e))
                    .cloned()
                    .collect()
            }
        };
        Ok(WatchStart {
            initial,
            rv: inner.rv,
            feed,
        })
    }

    /// Every object of a type in every namespace (for the controller).
    pub fn all(&self, res: &'static ResourceDef) -> Vec<Value> {
        self.lock()
            .objects
            .iter()
            .filter(|((p, _, _), _)| *p == res.plural)
            .map(|(_, o)| o.clone())
            .collect()
    }
}

fn encode_continue(rv: u64, after: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(json!({"rv": rv, "start": after}).to_string())
}

fn decode_continue(token: &str) -> Result<(u64, String), ApiError> {
    let bad = || ApiError::bad_request("invalid continue token");
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
    Ok((
        v["rv"].as_u64().ok_or_else(bad)?,
        v["start"].as_str().ok_or_else(bad)?.to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut t, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(t, json!({"a": "z", "c": {"d": "e"}}));
    }

    #[test]
    fn json_patch_applies_ops_in_order() {
        let mut t = json!({"metadata": {"labels": {"a": "1"}}, "list": [1, 2]});
        json_patch(
            &mut t,
            &json!([
                {"op": "add", "path": "/metadata/labels/b", "value": "2"},
                {"op": "remove", "path": "/metadata/labels/a"},
                {"op": "replace", "path": "/list/0", "value": 9},
                {"op": "add", "path": "/list/-", "value": 3},
                {"op": "test", "path": "/list/2", "value": 3}
            ]),
        )
        .unwrap();
        assert_eq!(
            t,
            json!({"metadata": {"labels": {"b": "2"}}, "list": [9, 2, 3]})
        );
        assert!(json_patch(&mut t, &json!([{"op": "remove", "path": "/nope"}])).is_err());
    }
}
