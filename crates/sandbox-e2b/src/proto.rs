//! The envd `process` messages this backend sends and reads (package `process`, field numbers
//! as in envd's `process/process.proto`), written by hand with prost.

#![allow(missing_docs)]

use std::collections::HashMap;

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessConfig {
    #[prost(string, tag = "1")]
    pub cmd: String,
    #[prost(string, repeated, tag = "2")]
    pub args: Vec<String>,
    #[prost(map = "string, string", tag = "3")]
    pub envs: HashMap<String, String>,
    #[prost(string, optional, tag = "4")]
    pub cwd: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StartRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessConfig>,
    #[prost(string, optional, tag = "3")]
    pub tag: Option<String>,
    #[prost(bool, optional, tag = "4")]
    pub stdin: Option<bool>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StartResponse {
    #[prost(message, optional, tag = "1")]
    pub event: Option<ProcessEvent>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessEvent {
    #[prost(oneof = "process_event::Event", tags = "1, 2, 3, 4")]
    pub event: Option<process_event::Event>,
}

pub mod process_event {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Event {
        #[prost(message, tag = "1")]
        Start(StartEvent),
        #[prost(message, tag = "2")]
        Data(DataEvent),
        #[prost(message, tag = "3")]
        End(EndEvent),
        #[prost(message, tag = "4")]
        Keepalive(KeepAlive),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StartEvent {
        #[prost(uint32, tag = "1")]
        pub pid: u32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DataEvent {
        #[prost(oneof = "data_event::Output", tags = "1, 2, 3")]
        pub output: Option<data_event::Output>,
    }

    pub mod data_event {
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Output {
            #[prost(bytes, tag = "1")]
            Stdout(Vec<u8>),
            #[prost(bytes, tag = "2")]
            Stderr(Vec<u8>),
            #[prost(bytes, tag = "3")]
            Pty(Vec<u8>),
        }
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct EndEvent {
        #[prost(sint32, tag = "1")]
        pub exit_code: i32,
        #[prost(bool, tag = "2")]
        pub exited: bool,
        #[prost(string, tag = "3")]
        pub status: String,
        #[prost(string, optional, tag = "4")]
        pub error: Option<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeepAlive {}
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessSelector {
    #[prost(oneof = "process_selector::Selector", tags = "1, 2")]
    pub selector: Option<process_selector::Selector>,
}

pub mod process_selector {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Selector {
        #[prost(uint32, tag = "1")]
        Pid(u32),
        #[prost(string, tag = "2")]
        Tag(String),
    }
}

impl ProcessSelector {
    pub fn pid(pid: u32) -> Self {
        ProcessSelector {
            selector: Some(process_selector::Selector::Pid(pid)),
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessInput {
    #[prost(oneof = "process_input::Input", tags = "1, 2")]
    pub input: Option<process_input::Input>,
}

pub mod process_input {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Input {
        #[prost(bytes, tag = "1")]
        Stdin(Vec<u8>),
        #[prost(bytes, tag = "2")]
        Pty(Vec<u8>),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SendInputRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
    #[prost(message, optional, tag = "2")]
    pub input: Option<ProcessInput>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CloseStdinRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Signal {
    Unspecified = 0,
    Sigterm = 15,
    Sigkill = 9,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SendSignalRequest {
    #[prost(message, optional, tag = "1")]
    pub process: Option<ProcessSelector>,
    #[prost(enumeration = "Signal", tag = "2")]
    pub signal: i32,
}
