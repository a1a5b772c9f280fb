//! The host shell of the local mode: `sh -c` run by `sandbox_core::host::run` (its own process
//! group and cgroup, output read concurrently with a cap, everything it started killed when the
//! command ends or times out and when the call is dropped), with a minimal environment unless
//! told to inherit.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use sandbox_core::host::{self, HostCommand};
use sandbox_core::{Error, ExecResult, OutputLimits, Result};
use tracing::Instrument as _;

use crate::filesystem::Shell;

/// `sh -c` on the host.
#[derive(Clone)]
pub(crate) struct LocalShell {
    pub(crate) cwd: PathBuf,
    pub(crate) home: PathBuf,
    pub(crate) timeout: Duration,
    pub(crate) max_output: usize,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) inherit_env: bool,
}

impl fmt::Debug for LocalShell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalShell")
            .field("cwd", &self.cwd)
            .field("timeout", &self.timeout)
            .field("max_output", &self.max_output)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("inherit_env", &self.inherit_env)
            .finish()
    }
}

#[async_trait]
impl Shell for LocalShell {
    async fn execute(&self, command: &str, timeout: Option<Duration>) -> Result<ExecResult> {
        let timeout = timeout.unwrap_or(self.timeout);
        let span = tracing::info_span!(
            "execute",
            mode = "local",
            timeout_ms = timeout.as_millis() as u64
        );
        self.run(command, timeout).instrument(span).await
    }
}

impl LocalShell {
    async fn run(&self, command: &str, timeout: Duration) -> Result<ExecResult> {
        if command.contains('\0') {
            return Err(Error::invalid("command", "contains a NUL byte"));
        }
        let base = if self.inherit_env {
            BTreeMap::new()
        } else {
            host::minimal_env(&self.home)
        };
        let command = HostCommand::new(["sh", "-c", command], &self.cwd)
            .envs(base)
            .envs(&self.env)
            .inherit_env(self.inherit_env)
            .timeout(timeout)
            .limits(OutputLimits::both(self.max_output));
        let result = host::run(command, "local").await?;
        tracing::info!(exit_code = ?result.exit_code, timed_out = result.timed_out, truncated = result.truncated(), "executed");
        Ok(result)
    }
}
