//! The sandbox router: a reverse proxy to pods chosen by `X-Sandbox-*` headers, speaking
//! HTTP/1.1 and h2c (gRPC) to the pod in the protocol the client used.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::net::TcpStream;

use crate::faults::Faults;
use crate::http_util::{Body, json_response};
use crate::store::{SANDBOX, Store};

/// What the router needs.
pub(crate) struct RouterState {
    pub store: Arc<Store>,
    pub faults: Faults,
    pub token: Option<String>,
}

fn detail(code: u16, msg: &str) -> Response<Body> {
    json_response(code, &json!({"detail": msg}))
}

/// A DNS-1123 label.
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "transfer-encoding",
    "upgrade",
    "host",
    "proxy-connection",
];

/// Serve one request.
pub(crate) async fn handle(st: Arc<RouterState>, req: Request<Incoming>) -> Response<Body> {
    if req.uri().path() == "/healthz" {
        return json_response(200, &json!({"status": "ok"}));
    }
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let verdict = st.faults.verdict(req.method().as_str(), &pq);
    if let Some(d) = verdict.delay {
        tokio::time::sleep(d).await;
    }
    if let Some(code) = verdict.fail {
        return detail(code, &format!("injected fault: HTTP {code}"));
    }
    if let Some(token) = &st.token {
        let ok = req
            .headers()
            .get("authorization")
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
            .is_some_and(|t| t.trim() == token);
        if !ok {
            return detail(401, "Unauthorized");
        }
    }
    let header = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|h| h.to_str().ok())
            .map(str::to_owned)
    };
    let Some(id) = header("x-sandbox-id") else {
        return detail(400, "X-Sandbox-ID header is required.");
    };
    if !dns_label(&id) {
        return detail(400, "Invalid sandbox ID format.");
    }
    let ns = header("x-sandbox-namespace").unwrap_or_else(|| "default".to_owned());
    if !dns_label(&ns) {
        return detail(400, "Invalid namespace format.");
    }
    let port = match header("x-sandbox-port") {
        None => 8888,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return detail(400, "Invalid port format."),
        },
    };
    let pinned_ip = match header("x-sandbox-pod-ip") {
        None => None,
        Some(ip) => match ip.parse::<IpAddr>() {
            Ok(ip) => Some(ip),
            Err(_) => return detail(400, "Invalid target IP address."),
        },
    };
    let timeout = header("x-sandbox-timeout")
        .and_then(|t| t.parse::<f64>().ok())
        .filter(|t| t.is_finite() && *t > 0.0)
        .map_or(180.0, |t| t.min(180.0));

    // Dial with 3 retries (200/400/800 ms); the pod's address comes from the Sandbox
    // (there is no cluster DNS here), resolved again on every attempt.
    let mut stream = None;
    for attempt in 0..4u32 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
        let ip = pinned_ip.or_else(|| {
            st.store.get(&SANDBOX, &ns, &id).ok().and_then(|sb| {
                sb["status"]["podIPs"][0]
                    .as_str()
                    .and_then(|s| s.parse().ok())
            })
        });
        let Some(ip) = ip else { continue };
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_secs(2), TcpStream::connect((ip, port))).await
        {
            let _ = s.set_nodelay(true);
            stream = Some((s, ip));
            break;
        }
    }
    let Some((stream, ip)) = stream else {
        return detail(
            502,
            &format!("Could not connect to the backend sandbox: {id}"),
        );
    };
    match tokio::time::timeout(
        Duration::from_secs_f64(timeout),
        forward(req, stream, ip, port),
    )
    .await
    {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => detail(
            502,
            &format!("Could not connect to the backend sandbox: {id} ({e})"),
        ),
        Err(_) => detail(
            504,
            &format!("the backend sandbox {id} did not answer in time"),
        ),
    }
}

async fn forward(
    req: Request<Incoming>,
    stream: TcpStream,
    ip: IpAddr,
    port: u16,
) -> Result<Response<Body>, hyper::Error> {
    let authority = match ip {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    };
    let (mut parts, body) = req.into_parts();
    for h in HOP_BY_HOP {
        parts.headers.remove(h);
    }
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".to_owned());
    let io = TokioIo::new(stream);
    let resp = if parts.version == Version::HTTP_2 {
        parts.uri = format!("http://{authority}{pq}")
            .parse()
            .expect("a valid URI from parts");
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
        tokio::spawn(conn);
        send.send_request(Request::from_parts(parts, body)).await?
    } else {
        parts.uri = pq.parse().expect("a valid path");
        parts
            .headers
            .insert("host", authority.parse().expect("a valid host header"));
        let (mut send, conn) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(conn);
        send.send_request(Request::from_parts(parts, body)).await?
    };
    let (mut parts, body) = resp.into_parts();
    for h in HOP_BY_HOP {
        parts.headers.remove(h);
    }
    Ok(Response::from_parts(
        parts,
        body.map_err(Into::into).boxed_unsync(),
    ))
}
