//! sandboxd's `process.v1.ProcessService` through the tonic client of `sandboxd-proto`,
//! against a real server on loopback running real processes.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Harness, eventually_gone, pid_gone};
use sandboxd_proto::{
    ExecuteRequest, ProcessConfig, ProcessServiceClient, Pty, ResizeTtyRequest, SendSignalRequest,
    Signal, StartRequest, StartResponse, WriteStdinRequest, start_response::Event,
    write_stdin_request::Payload,
};
use tonic::Code;
use tonic::transport::Channel;

async fn client(h: &Harness) -> ProcessServiceClient<Channel> {
    ProcessServiceClient::connect(h.grpc()).await.unwrap()
}

fn sh(script: &str) -> ProcessConfig {
    ProcessConfig::new(["/bin/sh", "-c", script])
}

fn start(config: ProcessConfig) -> StartRequest {
    StartRequest {
        config: Some(config),
        pty: None,
    }
}

#[derive(Debug, Default)]
struct Outcome {
    events: Vec<&'static str>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit: Option<i32>,
}

async fn drain(stream: &mut tonic::Streaming<StartResponse>) -> Outcome {
    let mut out = Outcome::default();
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.event.unwrap() {
            Event::Init(_) => out.events.push("init"),
            Event::Stdout(b) => {
                out.events.push("stdout");
                out.stdout.extend(b);
            }
            Event::Stderr(b) => {
                out.events.push("stderr");
                out.stderr.extend(b);
            }
            Event::Exit(e) => {
                out.events.push("exit");
                out.exit = Some(e.exit_code);
            }
        }
    }
    out
}

async fn init_id(stream: &mut tonic::Streaming<StartResponse>) -> i32 {
    match stream.message().await.unwrap().unwrap().event.unwrap() {
        Event::Init(init) => init.process_id,
        other => panic!("first event is not init: {other:?}"),
    }
}

#[tokio::test]
async fn start_streams_stdout_and_stderr_separately_then_the_exit_code() {
    let h = Harness::start().await;
    let mut c = client(&h).await;
    let mut stream = c
        .start(start(sh("printf out; printf err >&2; exit 7")))
        .await
        .unwrap()
        .into_inner();
    let out = drain(&mut stream).await;
    assert_eq!(out.events.first(), Some(&"init"));
    assert_eq!(out.events.last(), Some(&"exit"));
    assert_eq!(out.stdout, b"out");
    assert_eq!(out.stderr, b"err");
    assert_eq!(out.exit, Some(7));
}

#[tokio::test]
async fn env_and_cwd_are_honoured() {
    let h = Harness::start().await;
    std::fs::create_dir_all(h.base().join("work/dir")).unwrap();
    let mut c = client(&h).await;
    let mut config = sh(r#"printf '%s|' "$GREETING" "$(pwd -P)""#);
    config.env_vars = HashMap::from([("GREETING".to_owned(), "hi there".to_owned())]);
    config.cwd = Some("work/dir".into());
    let out = drain(&mut c.start(start(config.clone())).await.unwrap().into_inner()).await;
    let base = h.base().canonicalize().unwrap();
    let expected = format!("hi there|{}|", base.join("work/dir").display());
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    assert_eq!(out.exit, Some(0));

    // The default cwd is the base directory; an absolute cwd is read beneath it.
    config.cwd = None;
    let out = drain(&mut c.start(start(config.clone())).await.unwrap().into_inner()).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("hi there|{}|", base.display())
    );
    config.cwd = Some("/work".into());
    let out = c
        .execute(ExecuteRequest {
            config: Some(config.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("hi there|{}|", base.join("work").display())
    );

    // A cwd leaving the base directory, through `..` or a symlink, is refused.
    std::os::unix::fs::symlink(h.outside(), h.base().join("out")).unwrap();
    for cwd in ["../outside", "out"] {
        config.cwd = Some(cwd.into());
        let err = c.start(start(config.clone())).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{cwd}: {err:?}");
    }
    config.cwd = Some("missing".into());
    assert_eq!(
        c.start(start(config.clone())).await.unwrap_err().code(),
        Code::NotFound
    );

    config.cwd = None;
    config.env_vars = HashMap::from([("A=B".to_owned(), "x".to_owned())]);
    assert_eq!(
        c.start(start(config)).await.unwrap_err().code(),
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn execute_collects_output_and_reports_signals_as_128_plus_n() {
    let h = Harness::start().await;
    let mut c = client(&h).await;
    let out = c
        .execute(ExecuteRequest {
            config: Some(sh("echo one; echo two >&2; exit 3")),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (out.exit_code, &out.stdout[..], &out.stderr[..]),
        (3, &b"one\n"[..], &b"two\n"[..])
    );
    let killed = c
        .execute(ExecuteRequest {
            config: Some(sh("kill -TERM $$")),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(killed.exit_code, 128 + 15);

    let empty = c
        .execute(ExecuteRequest {
            config: Some(ProcessConfig::new(Vec::<String>::new())),
        })
        .await;
    assert_eq!(empty.unwrap_err().code(), Code::InvalidArgument);
    let missing = c
        .execute(ExecuteRequest {
            config: Some(ProcessConfig::new(["/no/such/program"])),
        })
        .await;
    assert_eq!(missing.unwrap_err().code(), Code::Internal);
}

#[tokio::test]
async fn write_stdin_then_eof_into_cat() {
    let h = Harness::start().await;
    let mut c = client(&h).await;
    let mut stream = c
        .start(start(ProcessConfig::new(["cat"])))
        .await
        .unwrap()
        .into_inner();
    let id = init_id(&mut stream).await;
    for chunk in [&b"hello "[..], b"world"] {
        c.write_stdin(WriteStdinRequest {
            process_id: id,
            payload: Some(Payload::Input(chunk.to_vec())),
        })
        .await
        .unwrap();
    }
    c.write_stdin(WriteStdinRequest {
        process_id: id,
        payload: Some(Payload::Eof(())),
    })
    .await
    .unwrap();
    // After EOF, more input is a precondition failure (until the process is gone: not found).
    let late = c
        .write_stdin(WriteStdinRequest {
            process_id: id,
            payload: Some(Payload::Input(b"x".to_vec())),
        })
        .await
        .unwrap_err();
    assert!(
        matches!(late.code(), Code::FailedPrecondition | Code::NotFound),
        "{late:?}"
    );
    let out = drain(&mut stream).await;
    assert_eq!(out.stdout, b"hello world");
    assert_eq!(out.exit, Some(0));

    // The exited process left the table.
    let gone = c
        .write_stdin(WriteStdinRequest {
            process_id: id,
            payload: Some(Payload::Eof(())),
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
    let none = c
        .write_stdin(WriteStdinRequest {
            process_id: 999_999,
            payload: None,
        })
        .await
        .unwrap_err();
    assert_eq!(none.code(), Code::NotFound);
}

#[tokio::test]
async fn send_signal_kills_the_whole_process_group() {
    let h = Harness::start().await;
    let mut c = client(&h).await;
    let mut stream = c
        .start(start(sh("sleep 100 & echo $!; sleep 100")))
        .await
        .unwrap()
        .into_inner();
    let id = init_id(&mut stream).await;
    let grandchild: i32 = match stream.message().await.unwrap().unwrap().event.unwrap() {
        Event::Stdout(b) => String::from_utf8(b).unwrap().trim().parse().unwrap(),
        other => panic!("expected the background pid, got {other:?}"),
    };
    assert!(!pid_gone(grandchild));

    let bad = c
        .send_signal(SendSignalRequest {
            process_id: id,
            signal: Signal::Unspecified as i32,
        })
        .await;
    assert_eq!(bad.unwrap_err().code(), Code::InvalidArgument);

    c.send_signal(SendSignalRequest {
        process_id: id,
        signal: Signal::Sigkill as i32,
    })
    .await
    .unwrap();
    let out = drain(&mut stream).await;
    assert_eq!(out.exit, Some(128 + 9));
    eventually_gone(grandchild).await;

    let gone = c
        .send_signal(SendSignalRequest {
            process_id: id,
            signal: Signal::Sigterm as i32,
        })
        .await;
    assert_eq!(gone.unwrap_err().code(), Code::NotFound);
}

#[tokio::test]
async fn sigterm_and_sigint_reach_the_process() {
    let h = Harness::start().await;
    let mut c = client(&h).await;
    for (signal, n) in [(Signal::Sigterm, 15), (Signal::Sigint, 2)] {
        let mut stream = c
            .start(start(ProcessConfig::new(["sleep", "100"])))
            .await
            .unwrap()
            .into_inner();
        let id = init_id(&mut stream).await;
        c.send_signal(SendSignalRequest {
            process_id: id,
            signal: signal as i32,
        })
        .await
        .unwrap();
        assert_eq!(drain(&mut stream).await.exit, Some(128 + n));
    }
}

#[tokio::test]
async fn dropping_the_start_stream_kills_the_process_group() {
    let h = Harness::start().await;
    let mut c = client(&h).await;
    let mut stream = c
        .start(start(sh("sleep 100 & echo $!; sleep 100")))
        .await
        .unwrap()
        .into_inner();
    let _id = init_id(&mut stream).await;
    let grandchild: i32 = match stream.message().await.unwrap().unwrap().event.unwrap() {
        Event::Stdout(b) => String::from_utf8(b).unwrap().trim().parse().unwrap(),
        other => panic!("expected the background pid, got {other:?}"),
    };
    drop(stream);
    eventually_gone(grandchild).await;
}

#[tokio::test]
async fn a_cancelled_execute_kills_the_process_group() {
    let h = Harness::start().await;
    let mut c = client(&h).await;
    let pidfile = h.base().join("pid");
    let request = ExecuteRequest {
        config: Some(sh(
            "sleep 100 & echo $! > pid.tmp && mv pid.tmp pid; sleep 100",
        )),
    };
    let call = tokio::spawn(async move { c.execute(request).await });
    let mut pid = None;
    for _ in 0..500 {
        if let Ok(text) = std::fs::read_to_string(&pidfile) {
            pid = Some(text.trim().parse::<i32>().unwrap());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = pid.expect("the command wrote its background pid");
    assert!(!pid_gone(pid));
    // Dropping the call resets the HTTP/2 stream: the server drops the call and its group.
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    eventually_gone(pid).await;

    // A gRPC deadline does the same, and is answered DEADLINE_EXCEEDED, the code clients
    // (the k8s-agent-sandbox SDK's `command_timeout`) turn into a timed-out result. The
    // client is tonic's over a bare HTTP/2 connection, without the timer tonic's `Channel`
    // adds: what comes back is the server's answer.
    let _ = std::fs::remove_file(&pidfile);
    let http2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<tonic::body::Body>();
    let mut c = ProcessServiceClient::with_origin(http2, h.grpc().parse().unwrap());
    let mut request = tonic::Request::new(ExecuteRequest {
        config: Some(sh(
            "sleep 100 & echo $! > pid.tmp && mv pid.tmp pid; sleep 100",
        )),
    });
    request.set_timeout(Duration::from_millis(300));
    let err = c.execute(request).await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    let text = std::fs::read_to_string(&pidfile).expect("the command ran before its deadline");
    eventually_gone(text.trim().parse::<i32>().unwrap()).await;
}

#[tokio::test]
async fn ptys_are_unimplemented_and_the_table_is_bounded() {
    let h =
        Harness::start_with(|c| c.with_limits(sandboxd::Limits::default().with_max_processes(1)))
            .await;
    let mut c = client(&h).await;
    let pty = StartRequest {
        config: Some(sh("true")),
        pty: Some(Pty { cols: 80, rows: 24 }),
    };
    assert_eq!(c.start(pty).await.unwrap_err().code(), Code::Unimplemented);
    let resize = c
        .resize_tty(ResizeTtyRequest {
            process_id: 1,
            cols: 1,
            rows: 1,
        })
        .await;
    assert_eq!(resize.unwrap_err().code(), Code::Unimplemented);

    let mut first = c
        .start(start(ProcessConfig::new(["cat"])))
        .await
        .unwrap()
        .into_inner();
    let id = init_id(&mut first).await;
    let second = c
        .start(start(ProcessConfig::new(["cat"])))
        .await
        .unwrap_err();
    assert_eq!(second.code(), Code::ResourceExhausted);
    c.write_stdin(WriteStdinRequest {
        process_id: id,
        payload: Some(Payload::Eof(())),
    })
    .await
    .unwrap();
    assert_eq!(drain(&mut first).await.exit, Some(0));
    // The slot is free again once the first process has exited and been reported.
    let mut again = None;
    for _ in 0..100 {
        match c
            .execute(ExecuteRequest {
                config: Some(sh("echo ok")),
            })
            .await
        {
            Ok(r) => {
                again = Some(r.into_inner());
                break;
            }
            Err(e) if e.code() == Code::ResourceExhausted => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(again.unwrap().stdout, b"ok\n");
}
