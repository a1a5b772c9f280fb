//! Fault injection: failed, rate-limited and slow requests, sandboxes that vanish or break.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::state::Inner;

#[derive(Debug)]
struct FailRule {
    method: String,
    path_contains: String,
    status: u16,
    retry_after: Option<u64>,
    remaining: usize,
}

#[derive(Debug)]
struct DelayRule {
    method: String,
    path_contains: String,
    delay: Duration,
}

/// A failure state a sandbox can be put in ([`Faults::fail_next_create`], [`Faults::break_sandbox`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailState {
    /// `state: "error"`.
    Error,
    /// `state: "build_failed"`.
    BuildFailed,
}

impl FailState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FailState::Error => "error",
            FailState::BuildFailed => "build_failed",
        }
    }
}

#[derive(Debug, Default)]
struct Plan {
    fail: Vec<FailRule>,
    delay: Vec<DelayRule>,
    create: VecDeque<(FailState, String)>,
}

/// What the servers do with one request, decided by the fault plan.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Wait this long first.
    pub delay: Option<Duration>,
    /// Answer with this status (and `Retry-After` seconds) instead of serving.
    pub fail: Option<(u16, Option<u64>)>,
}

/// The fault-injection handle of a [`DaytonaTestServer`](crate::DaytonaTestServer) (cheap to
/// clone).
///
/// Request rules match on the HTTP method (`""` or `"*"` = any) and a substring of the path
/// plus query (`""` = any), and apply to both the API and the toolbox server (toolbox paths
/// start with `/{sandboxId}/`).
#[derive(Clone)]
pub struct Faults {
    plan: Arc<Mutex<Plan>>,
    inner: Weak<Inner>,
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
    pub(crate) fn new(inner: Weak<Inner>) -> Self {
        Self {
            plan: Arc::default(),
            inner,
        }
    }

    fn plan(&self) -> std::sync::MutexGuard<'_, Plan> {
        self.plan.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next `count` requests matching `method` and `path_contains` fail with `status`
    /// (NestJS-style body on the API, the daemon's error body on the toolbox).
    pub fn fail_next(&self, method: &str, path_contains: &str, status: u16, count: usize) {
        self.plan().fail.push(FailRule {
            method: method.to_owned(),
            path_contains: path_contains.to_owned(),
            status,
            retry_after: None,
            remaining: count,
        });
    }

    /// The next `count` matching requests get 429 with `Retry-After: <retry_after seconds>`
    /// (the throttler's answer).
    pub fn rate_limit_next(
        &self,
        method: &str,
        path_contains: &str,
        count: usize,
        retry_after: Duration,
    ) {
        self.plan().fail.push(FailRule {
            method: method.to_owned(),
            path_contains: path_contains.to_owned(),
            status: 429,
            retry_after: Some(retry_after.as_secs()),
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

    /// The next `POST /sandbox` creates a sandbox that ends in `state` with `errorReason`
    /// `reason` instead of starting (no container is run).
    pub fn fail_next_create(&self, state: FailState, reason: &str) {
        self.plan().create.push_back((state, reason.to_owned()));
    }

    /// Remove every request rule and pending create failure.
    pub fn clear(&self) {
        *self.plan() = Plan::default();
    }

    /// The sandbox `id_or_name` disappears: its container is removed and the API forgets
    /// it (404 from then on), as when it is deleted behind the client's back.
    pub async fn vanish(&self, id_or_name: &str) -> Result<(), crate::Error> {
        let inner = self.inner.upgrade().ok_or(crate::Error::Stopped)?;
        inner.vanish(id_or_name).await
    }

    /// Put the sandbox `id_or_name` into `state` with `errorReason` `reason` (its container
    /// is stopped).
    pub async fn break_sandbox(
        &self,
        id_or_name: &str,
        state: FailState,
        reason: &str,
    ) -> Result<(), crate::Error> {
        let inner = self.inner.upgrade().ok_or(crate::Error::Stopped)?;
        inner.break_sandbox(id_or_name, state, reason).await
    }

    pub(crate) fn take_create_failure(&self) -> Option<(FailState, String)> {
        self.plan().create.pop_front()
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
                (r.status, r.retry_after)
            });
        plan.fail.retain(|r| r.remaining > 0);
        Verdict { delay, fail }
    }
}
