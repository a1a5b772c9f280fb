//! Tests against a real HTTP server on loopback that answers from a script.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::extract::State;
use axum::http::{HeaderMap as AxumHeaders, StatusCode as AxumStatus};
use axum::response::IntoResponse;
use sandbox_core::{ErrorKind, IsolationKey, IsolationScope};

use super::*;

/// Status, headers, body.
type Answer = (u16, Vec<(&'static str, String)>, String);

/// Answers, in order; the last one repeats. Counts requests.
#[derive(Clone, Default)]
struct Script {
    answers: Arc<Mutex<VecDeque<Answer>>>,
    hits: Arc<Mutex<u32>>,
}

async fn answer(State(script): State<Script>) -> impl IntoResponse {
    *script.hits.lock().unwrap() += 1;
    let mut answers = script.answers.lock().unwrap();
    let (status, headers, body) = if answers.len() > 1 {
        answers.pop_front().unwrap()
    } else {
        answers.front().cloned().unwrap()
    };
    let mut h = AxumHeaders::new();
    for (k, v) in headers {
        h.insert(k, v.parse().unwrap());
    }
    (AxumStatus::from_u16(status).unwrap(), h, body)
}

/// An answer as tests write it.
type Scripted<'a> = (u16, Vec<(&'static str, String)>, &'a str);

async fn serve(answers: Vec<Scripted<'_>>) -> (String, Script) {
    let script = Script::default();
    script
        .answers
        .lock()
        .unwrap()
        .extend(answers.into_iter().map(|(s, h, b)| (s, h, b.to_owned())));
    let app = axum::Router::new()
        .fallback(answer)
        .with_state(script.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, script)
}

fn fast() -> HttpOptions {
    HttpOptions::default()
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .request_timeout(Duration::from_millis(500))
}

fn http() -> Http {
    Http::new("test", "test api", fast()).unwrap()
}

#[tokio::test]
async fn rate_limit_waits_retry_after_then_succeeds() {
    let (url, script) = serve(vec![
        (
            429,
            vec![("retry-after", "1".into())],
            r#"{"code":429,"message":"slow down"}"#,
        ),
        (200, vec![], r#"{"ok":true}"#),
    ])
    .await;
    let started = Instant::now();
    let v: serde_json::Value = http()
        .json("get", Idempotency::NotIdempotent, |c| c.get(&url))
        .await
        .unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(*script.hits.lock().unwrap(), 2);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After was not honoured"
    );
}

#[tokio::test]
async fn rate_limit_beyond_the_cap_fails_typed_at_once() {
    let (url, script) = serve(vec![(429, vec![("retry-after", "3600".into())], "busy")]).await;
    let err = http()
        .send("get", Idempotency::Idempotent, |c| c.get(&url))
        .await
        .unwrap_err();
    match &err {
        Error::RateLimited { retry_after, .. } => {
            assert_eq!(*retry_after, Some(Duration::from_secs(3600)))
        }
        other => panic!("expected RateLimited, got {other:?}"),
    }
    assert!(err.is_retryable());
    assert_eq!(*script.hits.lock().unwrap(), 1);
}

#[tokio::test]
async fn server_errors_retry_only_idempotent_calls() {
    let (url, script) = serve(vec![(503, vec![], r#"{"message":"down"}"#)]).await;
    let err = http()
        .send("get", Idempotency::Idempotent, |c| c.get(&url))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert_eq!(*script.hits.lock().unwrap(), 4, "max_attempts = 4");

    let (url, script) = serve(vec![(503, vec![], r#"{"message":"down"}"#)]).await;
    let err = http()
        .send("create", Idempotency::NotIdempotent, |c| c.post(&url))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
    assert!(
        !err.is_retryable(),
        "a 5xx on a create may have created something"
    );
    assert!(err.to_string().contains("down"), "{err}");
    assert_eq!(*script.hits.lock().unwrap(), 1);
}

#[tokio::test]
async fn statuses_map_to_typed_errors() {
    for (status, kind) in [
        (400, ErrorKind::InvalidInput),
        (401, ErrorKind::Unauthorized),
        (403, ErrorKind::Unauthorized),
        (404, ErrorKind::NotFound),
        (408, ErrorKind::Timeout),
        (409, ErrorKind::Conflict),
        (418, ErrorKind::Backend),
    ] {
        let (url, script) = serve(vec![(status, vec![], r#"{"message":"nope"}"#)]).await;
        let err = http()
            .send("op", Idempotency::Idempotent, |c| c.get(&url))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), kind, "HTTP {status}: {err}");
        assert_eq!(
            *script.hits.lock().unwrap(),
            1,
            "HTTP {status} is not retried"
        );
    }
}

#[tokio::test]
async fn unreachable_service_is_unavailable_after_the_attempts() {
    // A port nothing listens on: bind, learn the port, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/x");
    let err = http()
        .send("create", Idempotency::NotIdempotent, |c| c.post(&url))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.is_retryable());
}

#[tokio::test]
async fn slow_answers_time_out_typed() {
    let app = axum::Router::new().fallback(|| async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        "late"
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let http = Http::new("test", "test api", fast().max_attempts(1)).unwrap();
    let err = http
        .send("get", Idempotency::Idempotent, |c| c.get(&url))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
}

#[tokio::test]
async fn long_error_bodies_are_cut() {
    let long = format!(r#"{{"message":"{}"}}"#, "x".repeat(10_000));
    let (url, _) = serve(vec![(400, vec![], &long)]).await;
    let err = http()
        .send("op", Idempotency::Idempotent, |c| c.get(&url))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.len() < 1000, "{} bytes", text.len());
    assert!(text.ends_with('…'), "{text}");
}

#[test]
fn retry_after_reads_seconds_and_dates() {
    let mut h = HeaderMap::new();
    h.insert(RETRY_AFTER, "7".parse().unwrap());
    assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
    let later = SystemTime::now() + Duration::from_secs(120);
    h.insert(RETRY_AFTER, httpdate::fmt_http_date(later).parse().unwrap());
    let d = retry_after(&h).unwrap();
    assert!(
        d > Duration::from_secs(100) && d <= Duration::from_secs(120),
        "{d:?}"
    );
    h.insert(RETRY_AFTER, "soon".parse().unwrap());
    assert_eq!(retry_after(&h), None);
}

#[test]
fn backoff_stays_below_its_ceiling_and_spreads() {
    let o = HttpOptions::default();
    let pauses: Vec<Duration> = (0..200).map(|_| o.pause(10)).collect();
    assert!(pauses.iter().all(|p| *p <= o.max_backoff));
    let spread = pauses
        .iter()
        .max()
        .unwrap()
        .saturating_sub(*pauses.iter().min().unwrap());
    assert!(
        spread > o.max_backoff / 2,
        "full jitter spreads pauses: {spread:?}"
    );
    assert!((0..100).all(|_| o.pause(0) <= o.backoff));
}

#[test]
fn secrets_never_print() {
    let s = Secret::new("e2b_topsecret");
    assert_eq!(format!("{s:?}"), "Secret(***)");
    assert_eq!(s.to_string(), "***");
    assert_eq!(s.expose(), "e2b_topsecret");
}

#[test]
fn owner_tags_round_trip_and_filter_strangers() {
    let ctx = sandbox_core::CallContext::new("agent").user("alice");
    let key = IsolationKey::resolve(IsolationScope::User, &ctx).unwrap();
    let created = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let expires = created + Duration::from_secs(3600);
    let tags = owner::tags("sbx", Some(&key), created, Some(expires));
    let owned = owner::owned_box("id-1", "sbx", &tags).unwrap();
    assert_eq!(owned.id, "id-1");
    assert_eq!(owned.key.as_deref(), Some(key.as_str()));
    assert_eq!(owned.created_unix_ms, Some(1_700_000_000_000));
    assert_eq!(owned.expires_unix_ms, Some(1_700_003_600_000));
    assert!(owner::owned_box("id-1", "other", &tags).is_none());
    assert!(owner::owned_box("id-1", "sbx", &BTreeMap::new()).is_none());
}

use std::collections::BTreeMap;
