#![doc = include_str!("../README.md")]

/// Port envd listens on inside an E2B sandbox.
pub const ENVD_PORT: u16 = 49983;

/// `package process`: running commands.
pub mod process {
    use std::collections::HashMap;

    /// Fully qualified service name; method paths are `/process.Process/<Method>`.
    pub const SERVICE: &str = "process.Process";

    /// Terminal size (`process.PTY`).
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct Pty {
        /// Size.
        #[prost(message, optional, tag = "1")]
        pub size: Option<PtySize>,
    }

    /// `process.PTY.Size`.
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct PtySize {
        /// Columns.
        #[prost(uint32, tag = "1")]
        pub cols: u32,
        /// Rows.
        #[prost(uint32, tag = "2")]
        pub rows: u32,
    }

    /// What to run (`process.ProcessConfig`). The SDK runs `/bin/bash -l -c <cmd>`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ProcessConfig {
        /// Program.
        #[prost(string, tag = "1")]
        pub cmd: String,
        /// Arguments.
        #[prost(string, repeated, tag = "2")]
        pub args: Vec<String>,
        /// Environment added to the daemon's.
        #[prost(map = "string, string", tag = "3")]
        pub envs: HashMap<String, String>,
        /// Working directory (default: the user's home).
        #[prost(string, optional, tag = "4")]
        pub cwd: Option<String>,
    }

    /// `process.ListRequest` (empty).
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct ListRequest {}

    /// A running process (`process.ProcessInfo`).
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ProcessInfo {
        /// How it was started.
        #[prost(message, optional, tag = "1")]
        pub config: Option<ProcessConfig>,
        /// Pid.
        #[prost(uint32, tag = "2")]
        pub pid: u32,
        /// Tag given at start.
        #[prost(string, optional, tag = "3")]
        pub tag: Option<String>,
    }

    /// `process.ListResponse`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ListResponse {
        /// Running processes.
        #[prost(message, repeated, tag = "1")]
        pub processes: Vec<ProcessInfo>,
    }

    /// `process.StartRequest`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct StartRequest {
        /// What to run.
        #[prost(message, optional, tag = "1")]
        pub process: Option<ProcessConfig>,
        /// Run under a terminal.
        #[prost(message, optional, tag = "2")]
        pub pty: Option<Pty>,
        /// A tag to find the process by.
        #[prost(string, optional, tag = "3")]
        pub tag: Option<String>,
        /// Keep stdin open for `SendInput` (absent = true, for old clients).
        #[prost(bool, optional, tag = "4")]
        pub stdin: Option<bool>,
    }

    /// `process.UpdateRequest` (resize a PTY).
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct UpdateRequest {
        /// Which process.
        #[prost(message, optional, tag = "1")]
        pub process: Option<ProcessSelector>,
        /// New size.
        #[prost(message, optional, tag = "2")]
        pub pty: Option<Pty>,
    }

    /// `process.UpdateResponse` (empty).
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct UpdateResponse {}

    /// One event of a `Start` or `Connect` stream (`process.ProcessEvent`).
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ProcessEvent {
        /// `oneof event`.
        #[prost(oneof = "process_event::Event", tags = "1, 2, 3, 4")]
        pub event: Option<process_event::Event>,
    }

    /// Nested types of [`ProcessEvent`].
    pub mod process_event {
        /// `oneof event`.
        #[derive(Clone, PartialEq, Eq, prost::Oneof)]
        pub enum Event {
            /// The process started (first).
            #[prost(message, tag = "1")]
            Start(StartEvent),
            /// Output.
            #[prost(message, tag = "2")]
            Data(DataEvent),
            /// The process ended (last).
            #[prost(message, tag = "3")]
            End(EndEvent),
            /// Keep-alive.
            #[prost(message, tag = "4")]
            Keepalive(KeepAlive),
        }

        /// `ProcessEvent.StartEvent`.
        #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
        pub struct StartEvent {
            /// Pid.
            #[prost(uint32, tag = "1")]
            pub pid: u32,
        }

        /// `ProcessEvent.DataEvent`.
        #[derive(Clone, PartialEq, Eq, prost::Message)]
        pub struct DataEvent {
            /// `oneof output`.
            #[prost(oneof = "Output", tags = "1, 2, 3")]
            pub output: Option<Output>,
        }

        /// `DataEvent.output`.
        #[derive(Clone, PartialEq, Eq, prost::Oneof)]
        pub enum Output {
            /// Standard output bytes.
            #[prost(bytes, tag = "1")]
            Stdout(Vec<u8>),
            /// Standard error bytes.
            #[prost(bytes, tag = "2")]
            Stderr(Vec<u8>),
            /// Terminal bytes.
            #[prost(bytes, tag = "3")]
            Pty(Vec<u8>),
        }

        /// `ProcessEvent.EndEvent`.
        #[derive(Clone, PartialEq, Eq, prost::Message)]
        pub struct EndEvent {
            /// Exit code; -1 when killed by a signal (Go's `ExitCode()`).
            #[prost(sint32, tag = "1")]
            pub exit_code: i32,
            /// Exited normally.
            #[prost(bool, tag = "2")]
            pub exited: bool,
            /// Go's `ProcessState` text: `exit status 1`, `signal: killed`.
            #[prost(string, tag = "3")]
            pub status: String,
            /// Error text.
            #[prost(string, optional, tag = "4")]
            pub error: Option<String>,
        }

        /// `ProcessEvent.KeepAlive` (empty).
        #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
        pub struct KeepAlive {}
    }

    /// `process.StartResponse`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct StartResponse {
        /// The event.
        #[prost(message, optional, tag = "1")]
        pub event: Option<ProcessEvent>,
    }

    /// `process.ConnectResponse` (same shape as [`StartResponse`]).
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ConnectResponse {
        /// The event.
        #[prost(message, optional, tag = "1")]
        pub event: Option<ProcessEvent>,
    }

    /// Selects a process (`process.ProcessSelector`).
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ProcessSelector {
        /// `oneof selector`.
        #[prost(oneof = "process_selector::Selector", tags = "1, 2")]
        pub selector: Option<process_selector::Selector>,
    }

    /// Nested types of [`ProcessSelector`].
    pub mod process_selector {
        /// `oneof selector`.
        #[derive(Clone, PartialEq, Eq, prost::Oneof)]
        pub enum Selector {
            /// By pid.
            #[prost(uint32, tag = "1")]
            Pid(u32),
            /// By tag.
            #[prost(string, tag = "2")]
            Tag(String),
        }
    }

    impl ProcessSelector {
        /// Select by pid.
        pub fn pid(pid: u32) -> Self {
            Self {
                selector: Some(process_selector::Selector::Pid(pid)),
            }
        }
    }

    /// `process.ConnectRequest`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ConnectRequest {
        /// Which process.
        #[prost(message, optional, tag = "1")]
        pub process: Option<ProcessSelector>,
    }

    /// `process.ProcessInput`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ProcessInput {
        /// `oneof input`.
        #[prost(oneof = "process_input::Input", tags = "1, 2")]
        pub input: Option<process_input::Input>,
    }

    /// Nested types of [`ProcessInput`].
    pub mod process_input {
        /// `oneof input`.
        #[derive(Clone, PartialEq, Eq, prost::Oneof)]
        pub enum Input {
            /// Bytes for stdin.
            #[prost(bytes, tag = "1")]
            Stdin(Vec<u8>),
            /// Bytes for the terminal.
            #[prost(bytes, tag = "2")]
            Pty(Vec<u8>),
        }
    }

    /// `process.SendInputRequest`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct SendInputRequest {
        /// Which process.
        #[prost(message, optional, tag = "1")]
        pub process: Option<ProcessSelector>,
        /// Input.
        #[prost(message, optional, tag = "2")]
        pub input: Option<ProcessInput>,
    }

    /// `process.SendInputResponse` (empty).
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct SendInputResponse {}

    /// `process.CloseStdinRequest`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct CloseStdinRequest {
        /// Which process.
        #[prost(message, optional, tag = "1")]
        pub process: Option<ProcessSelector>,
    }

    /// `process.CloseStdinResponse` (empty).
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct CloseStdinResponse {}

    /// `process.Signal`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Signal {
        /// Not set.
        Unspecified = 0,
        /// SIGTERM.
        Sigterm = 15,
        /// SIGKILL.
        Sigkill = 9,
    }

    impl Signal {
        /// The proto3 JSON name (`SIGNAL_SIGKILL`).
        pub fn as_str_name(self) -> &'static str {
            match self {
                Signal::Unspecified => "SIGNAL_UNSPECIFIED",
                Signal::Sigterm => "SIGNAL_SIGTERM",
                Signal::Sigkill => "SIGNAL_SIGKILL",
            }
        }

        /// From the proto3 JSON name.
        pub fn from_str_name(name: &str) -> Option<Self> {
            match name {
                "SIGNAL_UNSPECIFIED" => Some(Signal::Unspecified),
                "SIGNAL_SIGTERM" => Some(Signal::Sigterm),
                "SIGNAL_SIGKILL" => Some(Signal::Sigkill),
                _ => None,
            }
        }
    }

    /// `process.SendSignalRequest`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct SendSignalRequest {
        /// Which process.
        #[prost(message, optional, tag = "1")]
        pub process: Option<ProcessSelector>,
        /// A [`Signal`] value.
        #[prost(enumeration = "Signal", tag = "2")]
        pub signal: i32,
    }

    /// `process.SendSignalResponse` (empty).
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct SendSignalResponse {}
}

/// `package filesystem`: files and directories.
pub mod filesystem {
    use std::collections::HashMap;

    /// Fully qualified service name; method paths are `/filesystem.Filesystem/<Method>`.
    pub const SERVICE: &str = "filesystem.Filesystem";

    /// `google.protobuf.Timestamp`.
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct Timestamp {
        /// Seconds since the Unix epoch.
        #[prost(int64, tag = "1")]
        pub seconds: i64,
        /// Nanoseconds.
        #[prost(int32, tag = "2")]
        pub nanos: i32,
    }

    /// `filesystem.FileType`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum FileType {
        /// Not set.
        Unspecified = 0,
        /// Regular file.
        File = 1,
        /// Directory.
        Directory = 2,
        /// Symbolic link.
        Symlink = 3,
    }

    impl FileType {
        /// The proto3 JSON name (`FILE_TYPE_FILE`).
        pub fn as_str_name(self) -> &'static str {
            match self {
                FileType::Unspecified => "FILE_TYPE_UNSPECIFIED",
                FileType::File => "FILE_TYPE_FILE",
                FileType::Directory => "FILE_TYPE_DIRECTORY",
                FileType::Symlink => "FILE_TYPE_SYMLINK",
            }
        }
    }

    /// `filesystem.EntryInfo`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct EntryInfo {
        /// Base name.
        #[prost(string, tag = "1")]
        pub name: String,
        /// A [`FileType`] value.
        #[prost(enumeration = "FileType", tag = "2")]
        pub r#type: i32,
        /// Absolute path.
        #[prost(string, tag = "3")]
        pub path: String,
        /// Size in bytes.
        #[prost(int64, tag = "4")]
        pub size: i64,
        /// Mode bits (`st_mode & 0o7777` plus type bits as Go's `FileMode`).
        #[prost(uint32, tag = "5")]
        pub mode: u32,
        /// `-rw-r--r--`.
        #[prost(string, tag = "6")]
        pub permissions: String,
        /// Owner name.
        #[prost(string, tag = "7")]
        pub owner: String,
        /// Group name.
        #[prost(string, tag = "8")]
        pub group: String,
        /// Modification time.
        #[prost(message, optional, tag = "9")]
        pub modified_time: Option<Timestamp>,
        /// Where a symlink points.
        #[prost(string, optional, tag = "10")]
        pub symlink_target: Option<String>,
        /// Extended attributes set at upload.
        #[prost(map = "string, string", tag = "11")]
        pub metadata: HashMap<String, String>,
        /// Is a symlink.
        #[prost(bool, tag = "12")]
        pub is_symlink: bool,
    }

    /// `filesystem.StatRequest`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct StatRequest {
        /// Path.
        #[prost(string, tag = "1")]
        pub path: String,
    }

    /// `filesystem.StatResponse`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct StatResponse {
        /// Entry.
        #[prost(message, optional, tag = "1")]
        pub entry: Option<EntryInfo>,
    }

    /// `filesystem.MakeDirRequest` (parents created; an existing one is `already_exists`).
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct MakeDirRequest {
        /// Path.
        #[prost(string, tag = "1")]
        pub path: String,
    }

    /// `filesystem.MakeDirResponse`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct MakeDirResponse {
        /// The new directory.
        #[prost(message, optional, tag = "1")]
        pub entry: Option<EntryInfo>,
    }

    /// `filesystem.MoveRequest`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct MoveRequest {
        /// From.
        #[prost(string, tag = "1")]
        pub source: String,
        /// To.
        #[prost(string, tag = "2")]
        pub destination: String,
    }

    /// `filesystem.MoveResponse`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct MoveResponse {
        /// The moved entry.
        #[prost(message, optional, tag = "1")]
        pub entry: Option<EntryInfo>,
    }

    /// `filesystem.RemoveRequest` (recursive).
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct RemoveRequest {
        /// Path.
        #[prost(string, tag = "1")]
        pub path: String,
    }

    /// `filesystem.RemoveResponse` (empty).
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct RemoveResponse {}

    /// `filesystem.ListDirRequest`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ListDirRequest {
        /// Directory.
        #[prost(string, tag = "1")]
        pub path: String,
        /// How deep (0 is taken as 1).
        #[prost(uint32, tag = "2")]
        pub depth: u32,
    }

    /// `filesystem.ListDirResponse`.
    #[derive(Clone, PartialEq, Eq, prost::Message)]
    pub struct ListDirResponse {
        /// Entries.
        #[prost(message, repeated, tag = "1")]
        pub entries: Vec<EntryInfo>,
    }
}

/// Connect streaming envelopes: `[flags u8][len u32 BE][payload]`.
pub mod envelope {
    use bytes::{Buf, BufMut, Bytes, BytesMut};

    /// A message.
    pub const MESSAGE: u8 = 0x00;
    /// The payload is compressed.
    pub const COMPRESSED: u8 = 0x01;
    /// The end-of-stream message (JSON `{}` or `{"error":…}`, in every codec).
    pub const END_STREAM: u8 = 0x02;

    /// One envelope.
    pub fn encode(flags: u8, payload: &[u8]) -> Bytes {
        let mut b = BytesMut::with_capacity(5 + payload.len());
        b.put_u8(flags);
        b.put_u32(payload.len() as u32);
        b.put_slice(payload);
        b.freeze()
    }

    /// Splits a byte stream into envelopes.
    #[derive(Debug, Default)]
    pub struct Decoder {
        buf: BytesMut,
    }

    impl Decoder {
        /// A decoder with nothing buffered.
        pub fn new() -> Self {
            Self::default()
        }

        /// Add bytes read from the stream.
        pub fn push(&mut self, chunk: &[u8]) {
            self.buf.extend_from_slice(chunk);
        }

        /// The next whole envelope `(flags, payload)`, if buffered.
        pub fn next_envelope(&mut self) -> Option<(u8, Bytes)> {
            if self.buf.len() < 5 {
                return None;
            }
            let len =
                u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
            if self.buf.len() < 5 + len {
                return None;
            }
            let flags = self.buf[0];
            self.buf.advance(5);
            Some((flags, self.buf.split_to(len).freeze()))
        }

        /// Bytes of an incomplete envelope still buffered.
        pub fn pending(&self) -> usize {
            self.buf.len()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn end_event_exit_code_is_zigzag() {
        let ev = process::process_event::EndEvent {
            exit_code: -1,
            exited: false,
            status: "signal: killed".into(),
            error: None,
        };
        let bytes = ev.encode_to_vec();
        // field 1, varint; zigzag(-1) = 1.
        assert_eq!(&bytes[..2], &[0x08, 0x01]);
    }

    #[test]
    fn envelope_round_trip_in_pieces() {
        let a = envelope::encode(envelope::MESSAGE, b"hello");
        let b = envelope::encode(envelope::END_STREAM, b"{}");
        let all = [a.as_ref(), b.as_ref()].concat();
        let mut d = envelope::Decoder::new();
        d.push(&all[..3]);
        assert_eq!(d.next_envelope(), None);
        d.push(&all[3..]);
        assert_eq!(
            d.next_envelope(),
            Some((0, bytes::Bytes::from_static(b"hello")))
        );
        assert_eq!(
            d.next_envelope(),
            Some((2, bytes::Bytes::from_static(b"{}")))
        );
        assert_eq!(d.pending(), 0);
    }
}
