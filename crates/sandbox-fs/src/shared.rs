//! Mode 1: the shared store. Workspace paths of the routing table live in a [`KvStore`] under
//! the call's isolation namespace; everything else falls through to local files (no shell).
//!
//! | path | namespace segment | key |
//! | --- | --- | --- |
//! | `AGENTS.md`, `MEMORY.md`, `tools.json` | `root` | the name |
//! | `memory/…` | `memory` | the rest |
//! | `skills/…` | `skills` | the rest |
//! | `subagents/…` | `subagents` | the rest |
//! | `knowledge/…` | `knowledge` | the rest |
//! | `agents/<name>/sessions/…` | `sessions` | `<name>/` + the rest |
//! | `agents/<name>/tasks/…` | `tasks` | `<name>/` + the rest |
//! | each extra shared prefix `p/…` | `extra/p` | the rest |
//!
//! The namespace is `<isolation key>/<segment>`, the isolation key being core's
//! (`agents/<agent>/users/<uid>`, `agents/<agent>/sessions/<sid>`, `agents/<agent>/shared`,
//! `global/__global__`) with the anonymous user (or session) id standing in for a missing one.
//! So Alice's `memory/notes.md` is key `notes.md` in namespace
//! `agents/<agent>/users/alice/memory`.
//!
//! Routed reads try the store first, then the local file of the same path (the template);
//! writes go to the store; edits are compare-and-set loops.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use sandbox_core::{CallContext, Error, ErrorKind, IsolationKey, IsolationScope, RelPath, Result};

use crate::filesystem::{Filesystem, Shell, UpdateFn};
use crate::kv::{KvStore, Precondition};
use crate::local::{LocalFs, LocalOptions, is_dir, not_a_dir, not_found};
use crate::types::{FileInfo, FileKind, WriteOutcome};
use crate::work;

/// Options of the shared-store mode (the spec's `RemoteFilesystemSpec`).
///
/// | option | default |
/// | --- | --- |
/// | `scope` | [`IsolationScope::User`] |
/// | `anonymous_user_id` | `"_default"` (also stands in for a missing session id) |
/// | `shared_prefixes` | none |
/// | `local` | [`LocalOptions::default`], always without a shell |
/// | `max_retries` | 100 compare-and-set attempts per edit |
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SharedStoreOptions {
    /// Who shares a namespace.
    pub scope: IsolationScope,
    /// Id used when the call has no user (or, under `Session`, no session) id.
    pub anonymous_user_id: String,
    /// Extra workspace-relative prefixes routed to the store (`prompts/`, `configs/`).
    pub shared_prefixes: Vec<String>,
    /// The local files: templates of routed paths and home of unrouted ones.
    pub local: LocalOptions,
    /// Compare-and-set attempts before an edit gives up with [`Error::Conflict`].
    pub max_retries: usize,
}

impl Default for SharedStoreOptions {
    fn default() -> Self {
        SharedStoreOptions {
            scope: IsolationScope::User,
            anonymous_user_id: "_default".to_owned(),
            shared_prefixes: Vec::new(),
            local: LocalOptions::default(),
            max_retries: 100,
        }
    }
}

impl SharedStoreOptions {
    /// Set the isolation scope.
    pub fn scope(mut self, scope: IsolationScope) -> Self {
        self.scope = scope;
        self
    }

    /// Set the anonymous user id.
    pub fn anonymous_user_id(mut self, id: impl Into<String>) -> Self {
        self.anonymous_user_id = id.into();
        self
    }

    /// Route another prefix to the store.
    pub fn add_shared_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.shared_prefixes.push(prefix.into());
        self
    }

    /// Set the local files' options (the shell is always off in this mode).
    pub fn local(mut self, local: LocalOptions) -> Self {
        self.local = local;
        self
    }

    /// Set the compare-and-set attempt limit.
    pub fn max_retries(mut self, n: usize) -> Self {
        self.max_retries = n;
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Lit(String),
    Wild,
}

#[derive(Debug, Clone)]
struct Route {
    segment: String,
    mount: Vec<Seg>,
    /// For the root route: the only names it holds.
    files: Option<&'static [&'static str]>,
}

const ROOT_FILES: &[&str] = &["AGENTS.md", "MEMORY.md", "tools.json"];

impl Route {
    fn dir(name: &str) -> Route {
        Route {
            segment: name.to_owned(),
            mount: vec![Seg::Lit(name.to_owned())],
            files: None,
        }
    }

    fn agent_dir(name: &str) -> Route {
        Route {
            segment: name.to_owned(),
            mount: vec![
                Seg::Lit("agents".into()),
                Seg::Wild,
                Seg::Lit(name.to_owned()),
            ],
            files: None,
        }
    }

    fn key_of(&self, parts: &[&str]) -> Option<String> {
        if let Some(files) = self.files {
            return (parts.len() == 1 && files.contains(&parts[0])).then(|| parts[0].to_owned());
        }
        if parts.len() <= self.mount.len() {
            return None;
        }
        let mut key = Vec::new();
        for (seg, part) in self.mount.iter().zip(parts) {
            match seg {
                Seg::Lit(l) if l == part => {}
                Seg::Lit(_) => return None,
                Seg::Wild => key.push(*part),
            }
        }
        key.extend(&parts[self.mount.len()..]);
        Some(key.join("/"))
    }

    fn logical(&self, key: &str) -> Option<String> {
        if let Some(files) = self.files {
            return files.contains(&key).then(|| key.to_owned());
        }
        let mut parts = key.split('/');
        let mut out = Vec::new();
        for seg in &self.mount {
            match seg {
                Seg::Lit(l) => out.push(l.clone()),
                Seg::Wild => out.push(parts.next()?.to_owned()),
            }
        }
        let rest: Vec<&str> = parts.collect();
        if rest.is_empty() || rest.iter().any(|p| p.is_empty()) {
            return None;
        }
        out.extend(rest.iter().map(|s| (*s).to_owned()));
        Some(out.join("/"))
    }

    /// The key prefix to scan for everything under the logical directory `dir`, or `None` if
    /// this route holds nothing there.
    fn scan_prefix(&self, dir: &[&str]) -> Option<String> {
        if self.files.is_some() {
            return dir.is_empty().then(String::new);
        }
        let mut wild = Vec::new();
        for (seg, part) in self.mount.iter().zip(dir) {
            match seg {
                Seg::Lit(l) if l == part => {}
                Seg::Lit(_) => return None,
                Seg::Wild => wild.push(*part),
            }
        }
        if dir.len() > self.mount.len() {
            wild.extend(&dir[self.mount.len()..]);
        }
        Some(if wild.is_empty() {
            String::new()
        } else {
            format!("{}/", wild.join("/"))
        })
    }
}

fn routes(options: &SharedStoreOptions) -> Result<Vec<Route>> {
    let mut out = vec![Route {
        segment: "root".into(),
        mount: Vec::new(),
        files: Some(ROOT_FILES),
    }];
    for d in ["memory", "skills", "subagents", "knowledge"] {
        out.push(Route::dir(d));
    }
    out.push(Route::agent_dir("sessions"));
    out.push(Route::agent_dir("tasks"));
    for p in &options.shared_prefixes {
        let rel = RelPath::new(p)?;
        out.push(Route {
            segment: format!("extra/{rel}"),
            mount: rel.components().map(|c| Seg::Lit(c.to_owned())).collect(),
            files: None,
        });
    }
    Ok(out)
}

/// The configured shared store; [`for_call`](Self::for_call) gives the filesystem of one
/// call. Cheap to clone.
#[derive(Clone)]
pub struct SharedStore {
    store: Arc<dyn KvStore>,
    options: Arc<SharedStoreOptions>,
    routes: Arc<Vec<Route>>,
    local: LocalFs,
}

impl fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedStore")
            .field("store", &self.store)
            .field("scope", &self.options.scope)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl SharedStore {
    /// Configure the mode over `store`.
    pub fn new(store: Arc<dyn KvStore>, options: SharedStoreOptions) -> Result<SharedStore> {
        let local = LocalFs::new(options.local.clone().shell(false))?;
        let routes = routes(&options)?;
        Ok(SharedStore {
            store,
            options: Arc::new(options),
            routes: Arc::new(routes),
            local,
        })
    }

    /// The namespace base of a call: its isolation key, with the anonymous id standing in for
    /// a missing user (or session) id.
    pub fn namespace_for(&self, ctx: &CallContext) -> String {
        let mut ctx = ctx.clone();
        let anon = &self.options.anonymous_user_id;
        match self.options.scope {
            IsolationScope::User if ctx.user_id.is_none() => ctx.user_id = Some(anon.clone()),
            IsolationScope::Session if ctx.session_id.is_none() => {
                ctx.session_id = Some(anon.clone())
            }
            _ => {}
        }
        IsolationKey::resolve(self.options.scope, &ctx)
            .map(|k| k.as_str().to_owned())
            .expect("every scope resolves once ids are filled in")
    }

    /// The filesystem of one call. The namespace is bound in the returned value.
    pub fn for_call(&self, ctx: &CallContext) -> SharedStoreFs {
        SharedStoreFs {
            base: self.namespace_for(ctx),
            shared: self.clone(),
        }
    }
}

/// Mode 1 for one call: routed paths in the [`KvStore`], the rest in local files. No shell.
#[derive(Clone)]
pub struct SharedStoreFs {
    shared: SharedStore,
    base: String,
}

impl fmt::Debug for SharedStoreFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedStoreFs")
            .field("namespace", &self.base)
            .field("store", &self.shared.store)
            .finish_non_exhaustive()
    }
}

/// Where a path lives.
enum Place {
    /// Root of the view.
    Root,
    /// A routed file path.
    Routed {
        rel: RelPath,
        ns: String,
        key: String,
    },
    /// A relative path outside the routing table (it may still be a directory above routed
    /// paths, like `agents/`).
    Unrouted(RelPath),
    /// An absolute path: the local policy decides.
    Absolute,
}

impl SharedStoreFs {
    /// The namespace base of this call.
    pub fn namespace(&self) -> &str {
        &self.base
    }

    fn store(&self) -> &dyn KvStore {
        &*self.shared.store
    }

    fn local(&self) -> &LocalFs {
        &self.shared.local
    }

    fn ns(&self, route: &Route) -> String {
        format!("{}/{}", self.base, route.segment)
    }

    fn place(&self, raw: &str) -> Result<Place> {
        if raw.contains('\0') {
            return Err(Error::path_escape(raw, "contains a NUL byte"));
        }
        if raw.is_empty() || raw == "." || raw == "./" {
            return Ok(Place::Root);
        }
        if raw.starts_with('/') {
            return Ok(Place::Absolute);
        }
        let rel = RelPath::new(raw)?;
        let parts: Vec<&str> = rel.components().collect();
        for route in self.shared.routes.iter() {
            if let Some(key) = route.key_of(&parts) {
                let ns = self.ns(route);
                return Ok(Place::Routed { rel, ns, key });
            }
        }
        Ok(Place::Unrouted(rel))
    }

    /// Every stored file under the logical directory `dir` (`None`: everything), by path.
    /// One prefix scan per namespace that can hold something there.
    async fn remote_walk(&self, dir: Option<&RelPath>) -> Result<BTreeMap<String, FileInfo>> {
        let parts: Vec<&str> = dir.map(|d| d.components().collect()).unwrap_or_default();
        let mut out = BTreeMap::new();
        for route in self.shared.routes.iter() {
            let Some(prefix) = route.scan_prefix(&parts) else {
                continue;
            };
            for entry in self.store().list(&self.ns(route), &prefix).await? {
                let Some(path) = route.logical(&entry.key) else {
                    continue;
                };
                let under = match dir {
                    None => true,
                    Some(d) => RelPath::new(&path).is_ok_and(|p| p.starts_with(d) && &p != d),
                };
                if under {
                    out.insert(
                        path.clone(),
                        FileInfo::new(path, FileKind::File, entry.size),
                    );
                }
            }
        }
        Ok(out)
    }

    /// The local template of a routed path, if there is one.
    async fn template(&self, rel: &RelPath) -> Result<Option<Bytes>> {
        match self.local().read(rel.as_str()).await {
            Ok(data) => Ok(Some(data)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn cas_update(
        &self,
        rel: &RelPath,
        ns: &str,
        key: &str,
        update: &mut UpdateFn<'_>,
    ) -> Result<WriteOutcome> {
        self.check_shape(rel, ns, key).await?;
        let attempts = self.shared.options.max_retries.max(1);
        for attempt in 0..attempts {
            let (current, expected) = match self.store().get(ns, key).await? {
                Some(v) => (Some(v.value), Precondition::Version(v.version)),
                None => (self.template(rel).await?, Precondition::Absent),
            };
            let existed = current.is_some();
            let new = update(current)?;
            let len = new.len() as u64;
            match self.store().put(ns, key, new, expected).await {
                Ok(_) => {
                    return Ok(WriteOutcome {
                        path: rel.to_string(),
                        created: !existed,
                        bytes: len,
                    });
                }
                Err(e) if e.kind() == ErrorKind::Conflict => {
                    tracing::debug!(attempt, key, "compare-and-set lost a race; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::Conflict {
            key: rel.to_string(),
            reason: format!(
                "gave up after {attempts} compare-and-set attempts: the file is being changed by others right now; try again"
            ),
        })
    }

    /// Keep the stored tree a tree: no file where stored files form a directory, and no file
    /// under a stored file.
    async fn check_shape(&self, rel: &RelPath, ns: &str, key: &str) -> Result<()> {
        if !self.store().list(ns, &format!("{key}/")).await?.is_empty() {
            return Err(is_dir(rel.as_str()));
        }
        let parts: Vec<&str> = key.split('/').collect();
        for n in 1..parts.len() {
            let ancestor = parts[..n].join("/");
            if self.store().get(ns, &ancestor).await?.is_some() {
                return Err(Error::invalid(
                    "path",
                    format!("a parent of `{rel}` is a file, not a directory"),
                ));
            }
        }
        Ok(())
    }

    async fn delete_rel(&self, rel: &RelPath, routed: Option<(&str, &str)>) -> Result<()> {
        let mut removed = false;
        if let Some((ns, key)) = routed {
            removed |= self.store().delete(ns, key, Precondition::Any).await?;
        }
        // Stored files under it as a directory.
        for route in self.shared.routes.iter() {
            let parts: Vec<&str> = rel.components().collect();
            let Some(prefix) = route.scan_prefix(&parts) else {
                continue;
            };
            let ns = self.ns(route);
            for entry in self.store().list(&ns, &prefix).await? {
                if let Some(path) = route.logical(&entry.key)
                    && RelPath::new(&path).is_ok_and(|p| p.starts_with(rel) && &p != rel)
                {
                    removed |= self
                        .store()
                        .delete(&ns, &entry.key, Precondition::Any)
                        .await?;
                }
            }
        }
        if routed.is_some() {
            if removed {
                return Ok(());
            }
            return match self.template(rel).await {
                Ok(Some(_)) => Err(Error::invalid(
                    "path",
                    format!(
                        "`{rel}` is a read-only local template; there is no shared copy to delete"
                    ),
                )),
                _ => Err(not_found(rel.as_str())),
            };
        }
        match self.local().delete(rel.as_str()).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound && removed => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn backoff(attempt: usize) -> Duration {
    let cap = 1u64 << attempt.min(6); // up to 64 ms
    let jitter = (uuid::Uuid::new_v4().as_u128() % 1000) as u64;
    Duration::from_micros(cap * jitter)
}

#[async_trait]
impl Filesystem for SharedStoreFs {
    fn mode(&self) -> &'static str {
        "shared_store"
    }

    fn shell(&self) -> Option<&dyn Shell> {
        None
    }

    async fn read(&self, path: &str) -> Result<Bytes> {
        match self.place(path)? {
            Place::Routed { rel, ns, key } => match self.store().get(&ns, &key).await? {
                Some(v) => Ok(v.value),
                None => match self.local().read(rel.as_str()).await {
                    Err(e)
                        if e.kind() == ErrorKind::NotFound
                            && !self.remote_walk(Some(&rel)).await?.is_empty() =>
                    {
                        Err(is_dir(path))
                    }
                    other => other,
                },
            },
            _ => self.local().read(path).await,
        }
    }

    async fn read_max(&self, path: &str, max: u64) -> Result<Bytes> {
        match self.place(path)? {
            Place::Routed { rel, ns, key } => match self.store().get(&ns, &key).await? {
                Some(v) => {
                    work::check_file_size(path, v.value.len() as u64, max)?;
                    Ok(v.value)
                }
                None => match self.local().read_max(rel.as_str(), max).await {
                    Err(e)
                        if e.kind() == ErrorKind::NotFound
                            && !self.remote_walk(Some(&rel)).await?.is_empty() =>
                    {
                        Err(is_dir(path))
                    }
                    other => other,
                },
            },
            _ => self.local().read_max(path, max).await,
        }
    }

    async fn write(&self, path: &str, data: Bytes) -> Result<WriteOutcome> {
        match self.place(path)? {
            Place::Routed { rel, ns, key } => {
                self.cas_update(&rel, &ns, &key, &mut |_| Ok(data.clone()))
                    .await
            }
            _ => self.local().write(path, data).await,
        }
    }

    async fn update(&self, path: &str, update: &mut UpdateFn<'_>) -> Result<WriteOutcome> {
        match self.place(path)? {
            Place::Routed { rel, ns, key } => self.cas_update(&rel, &ns, &key, update).await,
            _ => self.local().update(path, update).await,
        }
    }

    async fn delete(&self, path: &str) -> Result<()> {
        match self.place(path)? {
            Place::Root => Err(Error::invalid(
                "path",
                "the workspace root cannot be deleted",
            )),
            Place::Absolute => self.local().delete(path).await,
            Place::Routed { rel, ns, key } => self.delete_rel(&rel, Some((&ns, &key))).await,
            Place::Unrouted(rel) => self.delete_rel(&rel, None).await,
        }
    }

    async fn rename(&self, from: &str, to: &str) -> Result<()> {
        let src = self.place(from)?;
        let dst = self.place(to)?;
        let plain_local = |p: &Place| matches!(p, Place::Absolute | Place::Unrouted(_));
        if plain_local(&src) && plain_local(&dst) {
            let covers_remote = match &src {
                Place::Unrouted(rel) => !self.remote_walk(Some(rel)).await?.is_empty(),
                _ => false,
            };
            if !covers_remote {
                return self.local().rename(from, to).await;
            }
        }
        if self.stat(to).await?.is_some() {
            return Err(Error::Conflict {
                key: to.to_owned(),
                reason: "the destination already exists; delete it first or choose another name"
                    .into(),
            });
        }
        let info = self.stat(from).await?.ok_or_else(|| not_found(from))?;
        let moves: Vec<(String, String)> = if info.kind == FileKind::Dir {
            let base = from.trim_end_matches('/');
            self.walk(from)
                .await?
                .into_iter()
                .map(|f| {
                    let rest = f.path.strip_prefix(base).unwrap_or(&f.path).to_owned();
                    (f.path, format!("{}{rest}", to.trim_end_matches('/')))
                })
                .collect()
        } else {
            vec![(from.to_owned(), to.to_owned())]
        };
        for (a, b) in &moves {
            let data = self.read(a).await?;
            self.write(b, data).await?;
        }
        self.delete(from).await
    }

    async fn stat(&self, path: &str) -> Result<Option<FileInfo>> {
        let place = self.place(path)?;
        match &place {
            Place::Root => return Ok(Some(FileInfo::new("", FileKind::Dir, 0))),
            Place::Absolute => return self.local().stat(path).await,
            Place::Routed { rel, ns, key } => {
                if let Some(v) = self.store().get(ns, key).await? {
                    return Ok(Some(FileInfo::new(
                        rel.as_str(),
                        FileKind::File,
                        v.value.len() as u64,
                    )));
                }
            }
            Place::Unrouted(_) => {}
        }
        if let Some(info) = self.local().stat(path).await? {
            return Ok(Some(info));
        }
        let rel = match place {
            Place::Routed { rel, .. } | Place::Unrouted(rel) => rel,
            _ => unreachable!("handled above"),
        };
        Ok((!self.remote_walk(Some(&rel)).await?.is_empty())
            .then(|| FileInfo::new(rel.as_str(), FileKind::Dir, 0)))
    }

    async fn list(&self, path: &str) -> Result<Vec<FileInfo>> {
        let place = self.place(path)?;
        let dir = match &place {
            Place::Absolute => return self.local().list(path).await,
            Place::Root => None,
            Place::Routed { rel, .. } | Place::Unrouted(rel) => Some(rel.clone()),
        };
        let remote = self.remote_walk(dir.as_ref()).await?;
        let local = match self.local().list(path).await {
            Ok(l) => l,
            Err(e) if e.kind() == ErrorKind::NotFound => Vec::new(),
            Err(e) if remote.is_empty() => return Err(e),
            Err(_) => Vec::new(),
        };
        if let Place::Routed { ns, key, .. } = &place
            && remote.is_empty()
            && self.store().get(ns, key).await?.is_some()
        {
            return Err(not_a_dir(path));
        }
        let prefix = dir.as_ref().map_or(String::new(), |d| format!("{d}/"));
        let mut merged: BTreeMap<String, FileInfo> = BTreeMap::new();
        for (p, info) in remote {
            let rest = &p[prefix.len()..];
            match rest.split_once('/') {
                Some((child, _)) => {
                    let child_path = format!("{prefix}{child}");
                    merged
                        .entry(child.to_owned())
                        .or_insert_with(|| FileInfo::new(child_path, FileKind::Dir, 0));
                }
                None => {
                    merged.insert(rest.to_owned(), info);
                }
            }
        }
        for info in local {
            merged.entry(info.name().to_owned()).or_insert(info);
        }
        if merged.is_empty() && dir.is_some() && self.local().stat(path).await?.is_none() {
            return Err(not_found(path));
        }
        Ok(merged.into_values().collect())
    }

    async fn walk(&self, path: &str) -> Result<Vec<FileInfo>> {
        let place = self.place(path)?;
        let dir = match &place {
            Place::Absolute => return self.local().walk(path).await,
            Place::Root => None,
            Place::Routed { rel, ns, key } => {
                if let Some(v) = self.store().get(ns, key).await? {
                    return Ok(vec![FileInfo::new(
                        rel.as_str(),
                        FileKind::File,
                        v.value.len() as u64,
                    )]);
                }
                Some(rel.clone())
            }
            Place::Unrouted(rel) => Some(rel.clone()),
        };
        let mut merged = self.remote_walk(dir.as_ref()).await?;
        match self.local().walk(path).await {
            Ok(local) => {
                for info in local {
                    merged.entry(info.path.clone()).or_insert(info);
                }
            }
            Err(e) if e.kind() == ErrorKind::NotFound && (!merged.is_empty() || dir.is_none()) => {}
            Err(e) => return Err(e),
        }
        Ok(merged.into_values().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(opts: &SharedStoreOptions, path: &str) -> Option<(String, String)> {
        let rel = RelPath::new(path).unwrap();
        let parts: Vec<&str> = rel.components().collect();
        routes(opts)
            .unwrap()
            .iter()
            .find_map(|route| route.key_of(&parts).map(|k| (route.segment.clone(), k)))
    }

    #[test]
    fn routing_table() {
        let o = SharedStoreOptions::default().add_shared_prefix("prompts/");
        let s = |a: &str, b: &str| Some((a.to_owned(), b.to_owned()));
        assert_eq!(r(&o, "MEMORY.md"), s("root", "MEMORY.md"));
        assert_eq!(r(&o, "AGENTS.md"), s("root", "AGENTS.md"));
        assert_eq!(r(&o, "tools.json"), s("root", "tools.json"));
        assert_eq!(r(&o, "memory/a/b.md"), s("memory", "a/b.md"));
        assert_eq!(r(&o, "skills/x/SKILL.md"), s("skills", "x/SKILL.md"));
        assert_eq!(r(&o, "subagents/x.md"), s("subagents", "x.md"));
        assert_eq!(r(&o, "knowledge/k.md"), s("knowledge", "k.md"));
        assert_eq!(
            r(&o, "agents/bot/sessions/s1.jsonl"),
            s("sessions", "bot/s1.jsonl")
        );
        assert_eq!(
            r(&o, "agents/bot/tasks/t/1.json"),
            s("tasks", "bot/t/1.json")
        );
        assert_eq!(r(&o, "prompts/p.txt"), s("extra/prompts", "p.txt"));
        assert_eq!(r(&o, "src/main.rs"), None);
        assert_eq!(r(&o, "memory"), None);
        assert_eq!(r(&o, "agents/bot/other/x"), None);
        assert_eq!(r(&o, "docs/MEMORY.md"), None);
    }

    #[test]
    fn keys_map_back_to_paths() {
        let routes = routes(&SharedStoreOptions::default()).unwrap();
        let sessions = routes.iter().find(|r| r.segment == "sessions").unwrap();
        assert_eq!(
            sessions.logical("bot/s1.jsonl").unwrap(),
            "agents/bot/sessions/s1.jsonl"
        );
        assert_eq!(sessions.scan_prefix(&["agents"]).unwrap(), "");
        assert_eq!(sessions.scan_prefix(&["agents", "bot"]).unwrap(), "bot/");
        assert_eq!(
            sessions
                .scan_prefix(&["agents", "bot", "sessions", "d"])
                .unwrap(),
            "bot/d/"
        );
        assert!(sessions.scan_prefix(&["memory"]).is_none());
    }
}
