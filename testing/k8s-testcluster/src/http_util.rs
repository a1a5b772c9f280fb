//! HTTP plumbing shared by the API server and the router.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Error type of streamed bodies.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Response body of both servers.
pub(crate) type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A complete body.
pub(crate) fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// A JSON response.
pub(crate) fn json_response(status: u16, v: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(full(v.to_string()))
        .expect("static response parts are valid")
}

/// Decode `%XX` and `+` (form encoding).
pub(crate) fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Query parameters, decoded, in order.
pub(crate) fn parse_query(q: Option<&str>) -> Vec<(String, String)> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

/// Serve `handler` on `listener` (HTTP/1.1 and h2c) until `stop` changes.
pub(crate) fn serve<H, F>(listener: TcpListener, handler: H, mut stop: watch::Receiver<bool>)
where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let handler = Arc::new(handler);
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        continue;
                    }
                },
                _ = stop.changed() => break,
            };
            let _ = stream.set_nodelay(true);
            let handler = handler.clone();
            let mut conn_stop = stop.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let fut = handler(req, peer);
                    async move { Ok::<_, Infallible>(fut.await) }
                });
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                tokio::select! {
                    r = conn => if let Err(e) = r {
                        tracing::debug!(error = %e, "connection ended with an error");
                    },
                    _ = conn_stop.changed() => {}
                }
            });
        }
    });
}

/// A streamed body fed by a channel of chunks (watch streams).
pub(crate) fn channel_body(rx: tokio::sync::mpsc::Receiver<Bytes>) -> Body {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, BoxError>(hyper::body::Frame::data(b)), rx))
    });
    http_body_util::StreamBody::new(stream).boxed_unsync()
}
