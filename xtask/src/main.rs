//! Project tasks: `cargo xtask test`, `cargo xtask bench <name>`.
//!
//! `test` runs everything CI runs: formatting, lints, every test, and the quickstart. Services
//! that tests need are started here (and stopped by a drop guard, also on failure); a service
//! that cannot start is a failure, never a skip.

use std::process::{Command, ExitCode};
use std::time::Instant;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("bench") => bench(&args[1..]),
        Some("help") | None => {
            println!(
                "usage: cargo xtask <task>\n\ntasks:\n  test    fmt check, clippy -D warnings, all tests, the quickstart"
            );
            Ok(())
        }
        Some(other) => Err(format!("unknown task `{other}` (try `cargo xtask help`)")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn test() -> Result<(), String> {
    let started = Instant::now();
    run("cargo", &["fmt", "--all", "--", "--check"])?;
    run(
        "cargo",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    run("cargo", &["test", "--workspace"])?;
    run("cargo", &["run", "--quiet", "--example", "quickstart"])?;
    println!("xtask test: all passed in {:.0?}", started.elapsed());
    Ok(())
}

fn bench(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("snapshot") => {
            let mut cmd = vec![
                "bench",
                "--package",
                "sandbox-harness",
                "--bench",
                "snapshot",
                "--",
            ];
            cmd.extend(args[1..].iter().map(String::as_str));
            let out = workspace_root().join("target/bench");
            run_with_env(
                "cargo",
                &cmd,
                &[("SANDBOX_BENCH_OUT", out.to_str().expect("UTF-8 path"))],
            )
        }
        Some(other) => Err(format!("unknown benchmark `{other}` (have: snapshot)")),
        None => Err("name a benchmark: snapshot".into()),
    }
}

fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    run_with_env(program, args, &[])
}

fn run_with_env(program: &str, args: &[&str], env: &[(&str, &str)]) -> Result<(), String> {
    println!("xtask: $ {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .status()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{program} {}` failed ({status})", args.join(" ")))
    }
}
