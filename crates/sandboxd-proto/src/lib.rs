#![doc = include_str!("../README.md")]

use std::collections::HashMap;

/// Fully qualified gRPC service name (`package.Service`).
pub const SERVICE_NAME: &str = "process.v1.ProcessService";

/// Port sandboxd serves the gRPC `ProcessService` on.
pub const DEFAULT_GRPC_PORT: u16 = 9090;

/// Port sandboxd serves its REST file API (`/v1/...`) on.
pub const DEFAULT_REST_PORT: u16 = 8080;

/// Port of the legacy python-runtime API (`/execute`, `/upload`, ...).
pub const DEFAULT_LEGACY_PORT: u16 = 8888;

/// Terminal size for a process started with a pseudo-terminal (`process.v1.PTY`).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct Pty {
    /// Columns.
    #[prost(uint32, tag = "1")]
    pub cols: u32,
    /// Rows.
    #[prost(uint32, tag = "2")]
    pub rows: u32,
}

/// What to run (`process.v1.ProcessConfig`).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct ProcessConfig {
    /// The program and its arguments (`argv`); no shell is involved. The official SDK sends
    /// `["/bin/sh", "-c", <command>]`.
    #[prost(string, repeated, tag = "1")]
    pub command: Vec<String>,
    /// Environment variables added to the server's own environment.
    #[prost(map = "string, string", tag = "2")]
    pub env_vars: HashMap<String, String>,
    /// Working directory; `None` means the server's base directory.
    #[prost(string, optional, tag = "3")]
    pub cwd: Option<String>,
}

/// Request of `ProcessService.Start` (`process.v1.StartRequest`).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct StartRequest {
    /// What to run.
    #[prost(message, optional, tag = "1")]
    pub config: Option<ProcessConfig>,
    /// Run under a pseudo-terminal of this size.
    #[prost(message, optional, tag = "2")]
    pub pty: Option<Pty>,
}

/// First event of a `Start` stream: the id later calls name the process by.
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct InitEvent {
    /// Process id (the server's; sandboxd uses the OS pid).
    #[prost(int32, tag = "1")]
    pub process_id: i32,
}

/// Last event of a `Start` stream.
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct ExitEvent {
    /// Exit status; a process killed by signal `n` reports `128 + n`.
    #[prost(int32, tag = "1")]
    pub exit_code: i32,
}

/// One event of a `Start` stream (`process.v1.StartResponse`).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct StartResponse {
    /// The event (`oneof event`).
    #[prost(oneof = "start_response::Event", tags = "1, 2, 3, 4")]
    pub event: Option<start_response::Event>,
}

/// Nested types of [`StartResponse`].
pub mod start_response {
    /// The `oneof event` of [`super::StartResponse`].
    #[derive(Clone, PartialEq, Eq, prost::Oneof)]
    pub enum Event {
        /// The process started (always first).
        #[prost(message, tag = "1")]
        Init(super::InitEvent),
        /// A chunk of standard output.
        #[prost(bytes, tag = "2")]
        Stdout(Vec<u8>),
        /// A chunk of standard error.
        #[prost(bytes, tag = "3")]
        Stderr(Vec<u8>),
        /// The process ended (always last).
        #[prost(message, tag = "4")]
        Exit(super::ExitEvent),
    }
}

/// Request of `ProcessService.Execute` (`process.v1.ExecuteRequest`).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct ExecuteRequest {
    /// What to run.
    #[prost(message, optional, tag = "1")]
    pub config: Option<ProcessConfig>,
}

/// Result of `ProcessService.Execute`: the whole output, collected.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct ExecuteResponse {
    /// Exit status (`128 + n` for signal `n`).
    #[prost(int32, tag = "1")]
    pub exit_code: i32,
    /// Standard output.
    #[prost(bytes = "vec", tag = "2")]
    pub stdout: Vec<u8>,
    /// Standard error.
    #[prost(bytes = "vec", tag = "3")]
    pub stderr: Vec<u8>,
}

/// Request of `ProcessService.WriteStdin` (`process.v1.WriteStdinRequest`).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WriteStdinRequest {
    /// The process, as its [`InitEvent`] named it.
    #[prost(int32, tag = "1")]
    pub process_id: i32,
    /// Bytes to write, or end of input (`oneof payload`).
    #[prost(oneof = "write_stdin_request::Payload", tags = "2, 3")]
    pub payload: Option<write_stdin_request::Payload>,
}

/// Nested types of [`WriteStdinRequest`].
pub mod write_stdin_request {
    /// The `oneof payload` of [`super::WriteStdinRequest`].
    #[derive(Clone, PartialEq, Eq, prost::Oneof)]
    pub enum Payload {
        /// Bytes written to the process's stdin.
        #[prost(bytes, tag = "2")]
        Input(Vec<u8>),
        /// `google.protobuf.Empty`: close the process's stdin (end of input).
        #[prost(message, tag = "3")]
        Eof(()),
    }
}

/// Reply of `ProcessService.WriteStdin` (empty).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct WriteStdinResponse {}

/// Signals `SendSignal` can deliver (`process.v1.Signal`); values are the Linux numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Signal {
    /// Not set (rejected by the server).
    Unspecified = 0,
    /// Interrupt.
    Sigint = 2,
    /// Kill.
    Sigkill = 9,
    /// Terminate.
    Sigterm = 15,
}

impl Signal {
    /// The name in the `.proto` file (`SIGNAL_SIGKILL`, ...).
    pub fn as_str_name(self) -> &'static str {
        match self {
            Signal::Unspecified => "SIGNAL_UNSPECIFIED",
            Signal::Sigint => "SIGNAL_SIGINT",
            Signal::Sigkill => "SIGNAL_SIGKILL",
            Signal::Sigterm => "SIGNAL_SIGTERM",
        }
    }
}

/// Request of `ProcessService.SendSignal` (`process.v1.SendSignalRequest`).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct SendSignalRequest {
    /// The process, as its [`InitEvent`] named it.
    #[prost(int32, tag = "1")]
    pub process_id: i32,
    /// The signal, a [`Signal`] value (use [`SendSignalRequest::signal`] to read it typed).
    #[prost(enumeration = "Signal", tag = "2")]
    pub signal: i32,
}

/// Reply of `ProcessService.SendSignal` (empty).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct SendSignalResponse {}

/// Request of `ProcessService.ResizeTTY` (`process.v1.ResizeTTYRequest`).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct ResizeTtyRequest {
    /// The process, as its [`InitEvent`] named it.
    #[prost(int32, tag = "1")]
    pub process_id: i32,
    /// New width.
    #[prost(uint32, tag = "2")]
    pub cols: u32,
    /// New height.
    #[prost(uint32, tag = "3")]
    pub rows: u32,
}

/// Reply of `ProcessService.ResizeTTY` (empty).
#[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
pub struct ResizeTtyResponse {}

impl ProcessConfig {
    /// A config running `argv` in the server's base directory with no extra environment.
    pub fn new<I, S>(argv: I) -> ProcessConfig
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ProcessConfig {
            command: argv.into_iter().map(Into::into).collect(),
            env_vars: HashMap::new(),
            cwd: None,
        }
    }
}

#[allow(missing_docs, clippy::all, rust_2018_idioms)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/process.v1.ProcessService.rs"));
}

/// The generated tonic client: `ProcessServiceClient::connect("http://host:9090")`.
pub mod process_service_client {
    pub use crate::generated::process_service_client::ProcessServiceClient;
}

/// The generated tonic server: implement [`process_service_server::ProcessService`] and serve
/// [`process_service_server::ProcessServiceServer`].
pub mod process_service_server {
    pub use crate::generated::process_service_server::{ProcessService, ProcessServiceServer};
}

pub use process_service_client::ProcessServiceClient;
pub use process_service_server::{ProcessService, ProcessServiceServer};
