//! proto3 JSON of the envd messages (what the official SDKs send): lowerCamelCase (the
//! original names accepted too), bytes as base64, enums by name (numbers accepted), int64 as
//! strings, oneofs as their member key, defaults omitted.

use base64::Engine as _;
use e2b_envd_proto::filesystem as fs;
use e2b_envd_proto::process::{self as ep, process_event};
use serde_json::{Map, Value, json};

type R<T> = Result<T, String>;

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

fn obj(v: &Value, what: &str) -> R<Map<String, Value>> {
    match v {
        Value::Object(m) => Ok(m.clone()),
        Value::Null => Ok(Map::new()),
        _ => Err(format!("{what} must be an object")),
    }
}

/// The field `camel` (or `snake`) of an object.
fn field<'a>(m: &'a Map<String, Value>, camel: &str, snake: &str) -> Option<&'a Value> {
    m.get(camel)
        .or_else(|| m.get(snake))
        .filter(|v| !v.is_null())
}

fn string(m: &Map<String, Value>, camel: &str, snake: &str) -> R<Option<String>> {
    match field(m, camel, snake) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("`{camel}` must be a string")),
    }
}

fn uint(m: &Map<String, Value>, camel: &str, snake: &str) -> R<Option<u64>> {
    match field(m, camel, snake) {
        None => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("`{camel}` must be a non-negative integer")),
        Some(Value::String(s)) => s
            .parse()
            .map(Some)
            .map_err(|_| format!("`{camel}` must be a non-negative integer")),
        Some(_) => Err(format!("`{camel}` must be a number")),
    }
}

fn u32_field(m: &Map<String, Value>, camel: &str, snake: &str) -> R<Option<u32>> {
    uint(m, camel, snake)?
        .map(|v| u32::try_from(v).map_err(|_| format!("`{camel}` is out of range")))
        .transpose()
}

fn bytes(m: &Map<String, Value>, camel: &str, snake: &str) -> R<Option<Vec<u8>>> {
    match string(m, camel, snake)? {
        None => Ok(None),
        Some(s) => {
            // proto3 JSON accepts standard and URL-safe base64, padded or not.
            let t = s.trim_end_matches('=').replace('-', "+").replace('_', "/");
            base64::engine::general_purpose::STANDARD_NO_PAD
                .decode(t)
                .map(Some)
                .map_err(|e| format!("`{camel}` is not base64: {e}"))
        }
    }
}

fn process_config(v: &Value) -> R<ep::ProcessConfig> {
    let m = obj(v, "process")?;
    let args = match field(&m, "args", "args") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_owned)
                    .ok_or("`args` must hold strings")
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("`args` must be an array".into()),
    };
    let envs = match field(&m, "envs", "envs") {
        None => Default::default(),
        Some(Value::Object(e)) => e
            .iter()
            .map(|(k, v)| {
                v.as_str()
                    .map(|s| (k.clone(), s.to_owned()))
                    .ok_or_else(|| format!("env `{k}` must be a string"))
            })
            .collect::<R<_>>()?,
        Some(_) => return Err("`envs` must be an object".into()),
    };
    Ok(ep::ProcessConfig {
        cmd: string(&m, "cmd", "cmd")?.unwrap_or_default(),
        args,
        envs,
        cwd: string(&m, "cwd", "cwd")?,
    })
}

fn selector(v: Option<&Value>) -> R<Option<ep::ProcessSelector>> {
    let Some(v) = v else { return Ok(None) };
    let m = obj(v, "process")?;
    if let Some(pid) = u32_field(&m, "pid", "pid")? {
        return Ok(Some(ep::ProcessSelector::pid(pid)));
    }
    if let Some(tag) = string(&m, "tag", "tag")? {
        return Ok(Some(ep::ProcessSelector {
            selector: Some(ep::process_selector::Selector::Tag(tag)),
        }));
    }
    Ok(Some(ep::ProcessSelector { selector: None }))
}

fn root(body: &[u8]) -> R<Map<String, Value>> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    obj(&v, "the message")
}

pub(crate) fn start_request(body: &[u8]) -> R<ep::StartRequest> {
    let m = root(body)?;
    let process = field(&m, "process", "process")
        .map(process_config)
        .transpose()?;
    let pty = match field(&m, "pty", "pty") {
        None => None,
        Some(p) => {
            let pm = obj(p, "pty")?;
            let size = match field(&pm, "size", "size") {
                None => None,
                Some(s) => {
                    let sm = obj(s, "size")?;
                    Some(ep::PtySize {
                        cols: u32_field(&sm, "cols", "cols")?.unwrap_or(0),
                        rows: u32_field(&sm, "rows", "rows")?.unwrap_or(0),
                    })
                }
            };
            Some(ep::Pty { size })
        }
    };
    let stdin = match field(&m, "stdin", "stdin") {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => return Err("`stdin` must be a boolean".into()),
    };
    Ok(ep::StartRequest {
        process,
        pty,
        tag: string(&m, "tag", "tag")?,
        stdin,
    })
}

pub(crate) fn connect_request(body: &[u8]) -> R<ep::ConnectRequest> {
    let m = root(body)?;
    Ok(ep::ConnectRequest {
        process: selector(field(&m, "process", "process"))?,
    })
}

pub(crate) fn send_signal_request(body: &[u8]) -> R<ep::SendSignalRequest> {
    let m = root(body)?;
    let signal = match field(&m, "signal", "signal") {
        None => 0,
        Some(Value::String(s)) => {
            ep::Signal::from_str_name(s).ok_or_else(|| format!("unknown signal `{s}`"))? as i32
        }
        Some(Value::Number(n)) => n.as_i64().unwrap_or(-1) as i32,
        Some(_) => return Err("`signal` must be a name or number".into()),
    };
    Ok(ep::SendSignalRequest {
        process: selector(field(&m, "process", "process"))?,
        signal,
    })
}

pub(crate) fn send_input_request(body: &[u8]) -> R<ep::SendInputRequest> {
    let m = root(body)?;
    let input = match field(&m, "input", "input") {
        None => None,
        Some(i) => {
            let im = obj(i, "input")?;
            let input = if let Some(b) = bytes(&im, "stdin", "stdin")? {
                Some(ep::process_input::Input::Stdin(b))
            } else {
                bytes(&im, "pty", "pty")?.map(ep::process_input::Input::Pty)
            };
            Some(ep::ProcessInput { input })
        }
    };
    Ok(ep::SendInputRequest {
        process: selector(field(&m, "process", "process"))?,
        input,
    })
}

pub(crate) fn close_stdin_request(body: &[u8]) -> R<ep::CloseStdinRequest> {
    let m = root(body)?;
    Ok(ep::CloseStdinRequest {
        process: selector(field(&m, "process", "process"))?,
    })
}

pub(crate) fn path_request(body: &[u8]) -> R<String> {
    let m = root(body)?;
    Ok(string(&m, "path", "path")?.unwrap_or_default())
}

pub(crate) fn list_dir_request(body: &[u8]) -> R<fs::ListDirRequest> {
    let m = root(body)?;
    Ok(fs::ListDirRequest {
        path: string(&m, "path", "path")?.unwrap_or_default(),
        depth: u32_field(&m, "depth", "depth")?.unwrap_or(0),
    })
}

pub(crate) fn move_request(body: &[u8]) -> R<fs::MoveRequest> {
    let m = root(body)?;
    Ok(fs::MoveRequest {
        source: string(&m, "source", "source")?.unwrap_or_default(),
        destination: string(&m, "destination", "destination")?.unwrap_or_default(),
    })
}

/// `ProcessEvent` → JSON.
pub(crate) fn process_event(ev: &ep::ProcessEvent) -> Value {
    let inner = match &ev.event {
        None => json!({}),
        Some(process_event::Event::Start(s)) => json!({"start": {"pid": s.pid}}),
        Some(process_event::Event::Data(d)) => match &d.output {
            Some(process_event::Output::Stdout(b)) => {
                json!({"data": {"stdout": b64().encode(b)}})
            }
            Some(process_event::Output::Stderr(b)) => {
                json!({"data": {"stderr": b64().encode(b)}})
            }
            Some(process_event::Output::Pty(b)) => json!({"data": {"pty": b64().encode(b)}}),
            None => json!({"data": {}}),
        },
        Some(process_event::Event::End(e)) => {
            let mut m = Map::new();
            if e.exit_code != 0 {
                m.insert("exitCode".into(), json!(e.exit_code));
            }
            if e.exited {
                m.insert("exited".into(), json!(true));
            }
            if !e.status.is_empty() {
                m.insert("status".into(), json!(e.status));
            }
            if let Some(err) = &e.error {
                m.insert("error".into(), json!(err));
            }
            json!({"end": m})
        }
        Some(process_event::Event::Keepalive(_)) => json!({"keepalive": {}}),
    };
    json!({"event": inner})
}

fn config_json(c: &ep::ProcessConfig) -> Value {
    let mut m = Map::new();
    if !c.cmd.is_empty() {
        m.insert("cmd".into(), json!(c.cmd));
    }
    if !c.args.is_empty() {
        m.insert("args".into(), json!(c.args));
    }
    if !c.envs.is_empty() {
        m.insert("envs".into(), json!(c.envs));
    }
    if let Some(cwd) = &c.cwd {
        m.insert("cwd".into(), json!(cwd));
    }
    Value::Object(m)
}

pub(crate) fn list_response(r: &ep::ListResponse) -> Value {
    let procs: Vec<Value> = r
        .processes
        .iter()
        .map(|p| {
            let mut v = json!({"pid": p.pid});
            if let Some(c) = &p.config {
                v["config"] = config_json(c);
            }
            if let Some(t) = &p.tag {
                v["tag"] = json!(t);
            }
            v
        })
        .collect();
    if procs.is_empty() {
        json!({})
    } else {
        json!({"processes": procs})
    }
}

pub(crate) fn entry(e: &fs::EntryInfo) -> Value {
    let ty = fs::FileType::try_from(e.r#type).unwrap_or(fs::FileType::Unspecified);
    let mut m = Map::new();
    m.insert("name".into(), json!(e.name));
    if ty != fs::FileType::Unspecified {
        m.insert("type".into(), json!(ty.as_str_name()));
    }
    m.insert("path".into(), json!(e.path));
    if e.size != 0 {
        m.insert("size".into(), json!(e.size.to_string()));
    }
    if e.mode != 0 {
        m.insert("mode".into(), json!(e.mode));
    }
    if !e.permissions.is_empty() {
        m.insert("permissions".into(), json!(e.permissions));
    }
    if !e.owner.is_empty() {
        m.insert("owner".into(), json!(e.owner));
    }
    if !e.group.is_empty() {
        m.insert("group".into(), json!(e.group));
    }
    if let Some(t) = &e.modified_time
        && let Some(dt) = chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32)
    {
        m.insert(
            "modifiedTime".into(),
            json!(dt.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)),
        );
    }
    if let Some(s) = &e.symlink_target {
        m.insert("symlinkTarget".into(), json!(s));
    }
    if e.is_symlink {
        m.insert("isSymlink".into(), json!(true));
    }
    Value::Object(m)
}

pub(crate) fn entry_response(e: Option<&fs::EntryInfo>) -> Value {
    match e {
        Some(e) => json!({"entry": entry(e)}),
        None => json!({}),
    }
}

pub(crate) fn list_dir_response(entries: &[fs::EntryInfo]) -> Value {
    if entries.is_empty() {
        json!({})
    } else {
        json!({"entries": entries.iter().map(entry).collect::<Vec<_>>()})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_request_as_the_sdk_sends_it() {
        let r = start_request(
            br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false}"#,
        )
        .unwrap();
        let p = r.process.unwrap();
        assert_eq!(p.cmd, "/bin/bash");
        assert_eq!(p.args, ["-l", "-c", "echo hi"]);
        assert_eq!(p.envs.get("A").map(String::as_str), Some("1"));
        assert_eq!(p.cwd.as_deref(), Some("/tmp"));
        assert_eq!(r.stdin, Some(false));
        assert!(start_request(br#"{"process":{"args":"x"}}"#).is_err());
    }

    #[test]
    fn events_follow_proto3_json() {
        let data = ep::ProcessEvent {
            event: Some(process_event::Event::Data(process_event::DataEvent {
                output: Some(process_event::Output::Stdout(b"hi\n".to_vec())),
            })),
        };
        assert_eq!(
            process_event(&data),
            json!({"event": {"data": {"stdout": "aGkK"}}})
        );
        let end = ep::ProcessEvent {
            event: Some(process_event::Event::End(process_event::EndEvent {
                exit_code: 0,
                exited: true,
                status: "exit status 0".into(),
                error: None,
            })),
        };
        // exitCode 0 is a default: omitted.
        assert_eq!(
            process_event(&end),
            json!({"event": {"end": {"exited": true, "status": "exit status 0"}}})
        );
    }

    #[test]
    fn signal_by_name_or_number() {
        let r = send_signal_request(br#"{"process":{"pid":3},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(r.signal, 9);
        assert_eq!(r.process, Some(ep::ProcessSelector::pid(3)));
        let r = send_signal_request(br#"{"process":{"tag":"t"},"signal":15}"#).unwrap();
        assert_eq!(r.signal, 15);
        assert!(send_signal_request(br#"{"signal":"SIGHUP"}"#).is_err());
    }
}
