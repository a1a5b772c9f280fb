//! The legacy python runtime (port 8888): `POST /execute` with one command string (split
//! with shell quoting rules on the server, no shell, cwd its base directory), `/upload`
//! (multipart, filename relative to the base directory), `/download/{path}`. No env, cwd,
//! stdin or tree kill: the capability flags say so, and core refuses requests that need them.
//! `/execute` is never retried once the connection was made.

use std::time::{Duration, Instant};

use bytes::Bytes;
use sandbox_core::{CappedBuffer, CapturedOutput, Error, ExecResult, OutputLimits, Result};
use serde::Deserialize;

use crate::dataplane::{Http, Route, encode_segment, in_dir};

#[derive(Deserialize)]
struct ExecuteResponse {
    #[serde(default)]
    stdout: String,
    #[serde(default)]
    stderr: String,
    #[serde(default)]
    exit_code: i32,
    #[serde(default)]
    timed_out: bool,
}

/// One argument, quoted for a POSIX shell (and Python's `shlex.split`).
pub(crate) fn quote(arg: &str) -> String {
    if !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:@%+,".contains(&b))
    {
        return arg.to_owned();
    }
    format!("'{}'", arg.replace('\'', "'\"'\"'"))
}

/// `argv` run in `dir` (the runtime itself always starts in its base directory).
pub(crate) fn command_line(dir: &str, argv: &[String]) -> String {
    in_dir(dir, argv.to_vec())
        .iter()
        .map(|w| quote(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Run `argv` in `dir` through `/execute`.
pub(crate) async fn run(
    http: &Http,
    route: &Route,
    port: u16,
    dir: &str,
    argv: &[String],
    limits: OutputLimits,
    timeout: Duration,
) -> Result<ExecResult> {
    let began = Instant::now();
    let url = route.url(port, "/execute");
    let headers = route.headers(port)?;
    let body = serde_json::json!({
        "command": command_line(dir, argv),
        "timeout_seconds": timeout.as_secs_f64(),
    });
    // The server enforces the limit (and kills the command's group); the client waits a
    // little longer for its answer.
    let r = http
        .send(false, || {
            http.client()
                .post(&url)
                .headers(headers.clone())
                .timeout(timeout + Duration::from_secs(30))
                .json(&body)
        })
        .await?;
    let r = http.check("exec", "/execute", r).await?;
    let answer: ExecuteResponse = r.json().await.map_err(|e| Error::Backend {
        backend: crate::BACKEND,
        operation: "exec",
        message: format!("unexpected /execute answer: {e}"),
        source: Some(Box::new(e)),
    })?;
    let cap = |text: &str, max| {
        let mut b = CappedBuffer::new(max);
        b.push(text.as_bytes());
        b.finish()
    };
    let output = CapturedOutput {
        stdout: cap(&answer.stdout, limits.stdout),
        stderr: cap(&answer.stderr, limits.stderr),
    };
    let exit = (!answer.timed_out).then_some(answer.exit_code);
    Ok(ExecResult::new(
        exit,
        output,
        answer.timed_out,
        began.elapsed(),
    ))
}

/// The runtime's path of `rel` (relative to its base directory), percent-encoded whole
/// (`/` as `%2F`, as the official SDK sends it).
fn encoded(rel: &str) -> String {
    encode_segment(rel)
}

/// `GET /download/{path}`.
pub(crate) async fn download(http: &Http, route: &Route, port: u16, rel: &str) -> Result<Bytes> {
    let url = route.url(port, &format!("/download/{}", encoded(rel)));
    let headers = route.headers(port)?;
    let r = http
        .send(true, || http.client().get(&url).headers(headers.clone()))
        .await?;
    let r = http.check("read", rel, r).await?;
    r.bytes().await.map_err(|e| Error::Unavailable {
        service: format!("legacy runtime of {}", http.who),
        reason: format!("reading {rel}: {e}"),
        source: Some(Box::new(e)),
    })
}

/// `POST /upload` of `data` to `rel`.
pub(crate) async fn upload(
    http: &Http,
    route: &Route,
    port: u16,
    rel: &str,
    data: Bytes,
) -> Result<()> {
    if rel.contains(['"', '\r', '\n']) {
        return Err(Error::invalid(
            "file name",
            format!("`{rel}` cannot travel as a multipart file name"),
        ));
    }
    let boundary = format!("sandbox-{}", uuid::Uuid::new_v4().simple());
    let mut body = Vec::with_capacity(data.len() + 256);
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{rel}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(&data);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let body = Bytes::from(body);
    let url = route.url(port, "/upload");
    let headers = route.headers(port)?;
    // The upload replaces the whole file: idempotent.
    let r = http
        .send(true, || {
            http.client()
                .post(&url)
                .headers(headers.clone())
                .header(
                    reqwest::header::CONTENT_TYPE,
                    format!("multipart/form-data; boundary={boundary}"),
                )
                .body(body.clone())
        })
        .await?;
    http.check("write", rel, r).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_survive_shell_splitting() {
        assert_eq!(quote("plain-1.txt"), "plain-1.txt");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("it's a b"), "'it'\"'\"'s a b'");
        let line = command_line(
            "/app",
            &["sh".into(), "-c".into(), "echo 'x y' $HOME".into()],
        );
        assert_eq!(
            line,
            "sh -c 'cd -- \"$1\" && shift && exec \"$@\"' sh /app sh -c 'echo '\"'\"'x y'\"'\"' $HOME'"
        );
    }
}
