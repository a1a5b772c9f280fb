//! Golden encodings: each byte string below was produced by the official Python stubs
//! (`k8s_agent_sandbox/_proto/process/v1/process_pb2.py`, SDK 1.0.8) serializing the same
//! message, so equal bytes mean equal field numbers, wire types and oneof/map/optional shapes.

use std::collections::HashMap;

use prost::Message;
use sandboxd_proto::{
    ExecuteResponse, ExitEvent, InitEvent, ProcessConfig, Pty, ResizeTtyRequest, SendSignalRequest,
    Signal, StartRequest, StartResponse, WriteStdinRequest, start_response, write_stdin_request,
};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn check<M: Message + Default + PartialEq + std::fmt::Debug>(message: M, golden: &str) {
    assert_eq!(hex(&message.encode_to_vec()), golden, "{message:?}");
    let bytes: Vec<u8> = (0..golden.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&golden[i..i + 2], 16).unwrap())
        .collect();
    assert_eq!(M::decode(bytes.as_slice()).unwrap(), message);
}

#[test]
fn start_request_matches_the_official_encoding() {
    check(
        StartRequest {
            config: Some(ProcessConfig {
                command: vec!["/bin/sh".into(), "-c".into(), "echo hi".into()],
                env_vars: HashMap::from([("A".to_owned(), "b".to_owned())]),
                cwd: Some("sub".into()),
            }),
            pty: Some(Pty { cols: 80, rows: 24 }),
        },
        "0a230a072f62696e2f73680a022d630a076563686f20686912060a01411201621a03737562120408501018",
    );
}

#[test]
fn start_response_events_match_the_official_encoding() {
    use start_response::Event;
    let event = |e| StartResponse { event: Some(e) };
    check(event(Event::Init(InitEvent { process_id: 42 })), "0a02082a");
    check(event(Event::Stdout(b"out".to_vec())), "12036f7574");
    check(event(Event::Stderr(b"err".to_vec())), "1a03657272");
    check(
        event(Event::Exit(ExitEvent { exit_code: 137 })),
        "2203088901",
    );
    // A zero exit code is still a present oneof member: an empty message, not nothing.
    check(event(Event::Exit(ExitEvent { exit_code: 0 })), "2200");
}

#[test]
fn control_requests_match_the_official_encoding() {
    use write_stdin_request::Payload;
    check(
        WriteStdinRequest {
            process_id: 7,
            payload: Some(Payload::Input(b"abc".to_vec())),
        },
        "08071203616263",
    );
    check(
        WriteStdinRequest {
            process_id: 7,
            payload: Some(Payload::Eof(())),
        },
        "08071a00",
    );
    check(
        SendSignalRequest {
            process_id: 7,
            signal: Signal::Sigkill as i32,
        },
        "08071009",
    );
    check(
        ExecuteResponse {
            exit_code: -1,
            stdout: b"o".to_vec(),
            stderr: b"e".to_vec(),
        },
        "08ffffffffffffffffff0112016f1a0165",
    );
    check(
        ResizeTtyRequest {
            process_id: 3,
            cols: 100,
            rows: 40,
        },
        "080310641828",
    );
}

#[test]
fn signal_values_are_the_linux_numbers() {
    assert_eq!(Signal::try_from(9).unwrap(), Signal::Sigkill);
    assert_eq!(Signal::try_from(15).unwrap(), Signal::Sigterm);
    assert_eq!(Signal::try_from(2).unwrap(), Signal::Sigint);
    assert!(Signal::try_from(3).is_err());
    assert_eq!(Signal::Sigkill.as_str_name(), "SIGNAL_SIGKILL");
}
