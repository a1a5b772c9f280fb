//! Fault injection: failed and slow requests, dropped and expired watches, dead pods.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::controller::Pods;
use crate::store::{SANDBOX, Store};

#[derive(Debug)]
struct FailRule {
    method: String,
    path_contains: String,
    status: u16,
    remaining: usize,
}

#[derive(Debug)]
struct DelayRule {
    method: String,
    path_contains: String,
    delay: Duration,
}

#[derive(Debug, Default)]
struct Plan {
    fail: Vec<FailRule>,
    delay: Vec<DelayRule>,
    expire_next_watches: usize,
}

/// What the servers do with one request, decided by the fault plan.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Wait this long first.
    pub delay: Option<Duration>,
    /// Answer with this 5xx instead of serving.
    pub fail: Option<u16>,
}

/// The fault-injection handle of a [`TestCluster`](crate::TestCluster) (cheap to clone).
///
/// Request rules match on the HTTP method (`""` or `"*"` = any) and a substring of the path
/// plus query (`""` = any), and apply to both the API server and the router.
#[derive(Clone)]
pub struct Faults {
    plan: Arc<Mutex<Plan>>,
    drop_watches: Arc<watch::Sender<u64>>,
    store: Arc<Store>,
    pods: Arc<Pods>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults").finish_non_exhaustive()
    }
}

fn method_matches(rule: &str, method: &str) -> bool {
    rule.is_empty() || rule == "*" || rule.eq_ignore_ascii_case(method)
}

impl Faults {
    pub(crate) fn new(store: Arc<Store>, pods: Arc<Pods>) -> Self {
        Self {
            plan: Arc::default(),
            drop_watches: Arc::new(watch::channel(0).0),
            store,
            pods,
        }
    }

    fn plan(&self) -> std::sync::MutexGuard<'_, Plan> {
        self.plan.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next `count` requests matching `method` and `path_contains` fail with `status`
    /// (a 5xx; the API server answers a `Status` body, the router `{"detail"}`).
    pub fn fail_next(&self, method: &str, path_contains: &str, status: u16, count: usize) {
        self.plan().fail.push(FailRule {
            method: method.to_owned(),
            path_contains: path_contains.to_owned(),
            status,
            remaining: count,
        });
    }

    /// Every request matching `method` and `path_contains` waits `delay` first, until
    /// [`clear`](Self::clear).
    pub fn delay(&self, method: &str, path_contains: &str, delay: Duration) {
        self.plan().delay.push(DelayRule {
            method: method.to_owned(),
            path_contains: path_contains.to_owned(),
            delay,
        });
    }

    /// Remove every request rule and pending watch expiry.
    pub fn clear(&self) {
        *self.plan() = Plan::default();
    }

    /// End every open watch stream now (the client sees the response end, as when an API
    /// server restarts).
    pub fn drop_watches(&self) {
        self.drop_watches.send_modify(|g| *g += 1);
    }

    /// The next watch request sends its initial events and then an `ERROR` event with a
    /// 410 `Expired` `Status`, and ends.
    pub fn expire_next_watch(&self) {
        self.plan().expire_next_watches += 1;
    }

    /// Forget the kept event window: a watch or list-continue from any earlier
    /// resourceVersion gets 410 Gone.
    pub fn compact(&self) {
        self.store.compact();
    }

    /// `docker kill` the pod (container) of the Sandbox `name` in `namespace`; the
    /// controller then reports the Sandbox `Ready=False` reason `PodFailed`.
    pub async fn kill_pod(&self, namespace: &str, name: &str) -> Result<(), crate::Error> {
        let sb = self
            .store
            .get(&SANDBOX, namespace, name)
            .map_err(|e| crate::Error::Api(e.message))?;
        let uid = sb["metadata"]["uid"].as_str().unwrap_or("");
        let container = self
            .pods
            .container_of(uid)
            .ok_or_else(|| crate::Error::Api(format!("sandbox {namespace}/{name} has no pod")))?;
        Ok(crate::docker::kill(&container).await?)
    }

    pub(crate) fn drop_signal(&self) -> watch::Receiver<u64> {
        self.drop_watches.subscribe()
    }

    pub(crate) fn take_watch_expiry(&self) -> bool {
        let mut plan = self.plan();
        if plan.expire_next_watches > 0 {
            plan.expire_next_watches -= 1;
            true
        } else {
            false
        }
    }

    /// Decide what happens to one request (consumes one count of a matching fail rule).
    pub(crate) fn verdict(&self, method: &str, path_and_query: &str) -> Verdict {
        let mut plan = self.plan();
        let delay = plan
            .delay
            .iter()
            .find(|r| {
                method_matches(&r.method, method) && path_and_query.contains(&r.path_contains)
            })
            .map(|r| r.delay);
        let fail = plan
            .fail
            .iter_mut()
            .find(|r| {
                r.remaining > 0
                    && method_matches(&r.method, method)
                    && path_and_query.contains(&r.path_contains)
            })
            .map(|r| {
                r.remaining -= 1;
                r.status
            });
        plan.fail.retain(|r| r.remaining > 0);
        Verdict { delay, fail }
    }
}
