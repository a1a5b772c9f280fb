//! Generates the `process.v1.ProcessService` client and server with tonic-build's manual
//! builder: the service is described here in Rust, so no `protoc` and no `.proto` file are
//! needed. Route names, package and service name match agent-sandbox's
//! `packages/sandboxd/spec/process/v1/process.proto`, so the official grpcio stubs can talk to
//! the generated server and the generated client to the real sandboxd.

use tonic_build::manual::{Builder, Method, Service};

fn method(
    name: &str,
    route: &str,
    input: &str,
    output: &str,
) -> tonic_build::manual::MethodBuilder {
    Method::builder()
        .name(name)
        .route_name(route)
        .input_type(format!("crate::{input}"))
        .output_type(format!("crate::{output}"))
        .codec_path("tonic_prost::ProstCodec")
}

fn main() {
    let service = Service::builder()
        .name("ProcessService")
        .package("process.v1")
        .comment("Runs processes inside the sandbox (agent-sandbox's sandboxd).")
        .method(
            method("start", "Start", "StartRequest", "StartResponse")
                .comment("Starts a process and streams its init, output and exit events.")
                .server_streaming()
                .build(),
        )
        .method(
            method("execute", "Execute", "ExecuteRequest", "ExecuteResponse")
                .comment("Runs a process to completion and returns its collected output.")
                .build(),
        )
        .method(
            method(
                "write_stdin",
                "WriteStdin",
                "WriteStdinRequest",
                "WriteStdinResponse",
            )
            .comment("Writes to, or closes, the stdin of a running process.")
            .build(),
        )
        .method(
            method(
                "send_signal",
                "SendSignal",
                "SendSignalRequest",
                "SendSignalResponse",
            )
            .comment("Sends a signal to a running process.")
            .build(),
        )
        .method(
            method(
                "resize_tty",
                "ResizeTTY",
                "ResizeTtyRequest",
                "ResizeTtyResponse",
            )
            .comment("Resizes the terminal of a process started with a PTY.")
            .build(),
        )
        .build();
    Builder::new().compile(&[service]);
    println!("cargo::rerun-if-changed=build.rs");
}
