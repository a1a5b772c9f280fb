//! Fault injection: failed, rate-limited and slow requests, and `Start` streams cut
//! mid-command. (Sandboxes that disappear and rotated envd tokens are methods of
//! [`E2bTestServer`](crate::E2bTestServer).)

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sandbox::lock;

#[derive(Debug)]
struct FailRule {
    method: String,
    path_contains: String,
    status: u16,
    retry_after: Option<Duration>,
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
    /// Cut the next `Start` streams after this many output events each.
    cut_streams: Vec<usize>,
}

/// What a server does with one request, decided by the fault plan.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Wait this long first.
    pub delay: Option<Duration>,
    /// Answer with this status instead of serving, with `Retry-After` when set.
    pub fail: Option<(u16, Option<Duration>)>,
}

/// The fault-injection handle of an [`E2bTestServer`](crate::E2bTestServer) (cheap to
/// clone). Request rules match on the HTTP method (`""` or `"*"` = any) and a substring of
/// the path plus query (`""` = any), and apply to the API and envd.
#[derive(Clone, Default)]
pub struct Faults {
    plan: Arc<Mutex<Plan>>,
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
    /// Answer the next `count` matching requests with `status` (a JSON error body).
    pub fn fail_next(&self, method: &str, path_contains: &str, status: u16, count: usize) {
        lock(&self.plan).fail.push(FailRule {
            method: method.to_owned(),
            path_contains: path_contains.to_owned(),
            status,
            retry_after: None,
            remaining: count,
        });
    }

    /// Answer the next `count` matching requests with 429 and `Retry-After` (whole seconds,
    /// rounded up).
    pub fn rate_limit_next(
        &self,
        method: &str,
        path_contains: &str,
        retry_after: Duration,
        count: usize,
    ) {
        lock(&self.plan).fail.push(FailRule {
            method: method.to_owned(),
            path_contains: path_contains.to_owned(),
            status: 429,
            retry_after: Some(retry_after),
            remaining: count,
        });
    }

    /// Delay every matching request by `delay` until [`clear`](Self::clear).
    pub fn delay(&self, method: &str, path_contains: &str, delay: Duration) {
        lock(&self.plan).delay.push(DelayRule {
            method: method.to_owned(),
            path_contains: path_contains.to_owned(),
            delay,
        });
    }

    /// Cut the connection of the next `process.Process/Start` stream after it sent
    /// `after_outputs` output (data) events: no end event, no end-stream message.
    pub fn cut_next_start_stream(&self, after_outputs: usize) {
        lock(&self.plan).cut_streams.push(after_outputs);
    }

    /// Remove every rule.
    pub fn clear(&self) {
        *lock(&self.plan) = Plan::default();
    }

    pub(crate) fn take_cut(&self) -> Option<usize> {
        let mut plan = lock(&self.plan);
        (!plan.cut_streams.is_empty()).then(|| plan.cut_streams.remove(0))
    }

    pub(crate) fn verdict(&self, method: &str, path_and_query: &str) -> Verdict {
        let mut plan = lock(&self.plan);
        let delay = plan
            .delay
            .iter()
            .filter(|r| {
                method_matches(&r.method, method) && path_and_query.contains(&r.path_contains)
            })
            .map(|r| r.delay)
            .max();
        let mut fail = None;
        if let Some(rule) = plan.fail.iter_mut().find(|r| {
            r.remaining > 0
                && method_matches(&r.method, method)
                && path_and_query.contains(&r.path_contains)
        }) {
            rule.remaining -= 1;
            fail = Some((rule.status, rule.retry_after));
        }
        plan.fail.retain(|r| r.remaining > 0);
        Verdict { delay, fail }
    }
}

/// Apply the verdict: wait, then maybe the fault's answer.
pub(crate) async fn apply(
    faults: &Faults,
    method: &str,
    path_and_query: &str,
) -> Option<axum::response::Response> {
    let v = faults.verdict(method, path_and_query);
    if let Some(d) = v.delay {
        tokio::time::sleep(d).await;
    }
    let (status, retry_after) = v.fail?;
    let message = if status == 429 {
        "Rate limit exceeded, please try again later (injected fault)".to_owned()
    } else {
        format!("injected fault {status}")
    };
    let mut resp = crate::api::error(status, &message);
    if let Some(ra) = retry_after {
        let secs = ra.as_secs() + u64::from(ra.subsec_nanos() > 0);
        resp.headers_mut()
            .insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
    }
    Some(resp)
}
