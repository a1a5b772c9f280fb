//! [`DockerState`]: what the Docker backend needs to find its container again.

use std::collections::BTreeMap;

use sandbox_core::{CommonState, IsolationKey, Persistence};
use serde::{Deserialize, Serialize};

/// A per-session mount as resolved when its container was created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ResolvedMount {
    /// Absolute host directory.
    pub host_path: String,
    /// Absolute in-box mount point.
    pub target: String,
    /// Mounted read-only.
    pub read_only: bool,
    /// Variable announcing `target` to commands.
    pub env_name: String,
}

/// Persisted state of one Docker box (`"type": "docker"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct DockerState {
    /// Core's part.
    pub common: CommonState,
    /// Deterministic container name (`<prefix>-<key digest>`), or a random one without a key.
    pub container_name: String,
    /// Id of the container this state last saw; a different container under the same name
    /// means the workspace was lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// Image the container runs.
    pub image: String,
    /// What `release` does.
    pub persistence: Persistence,
    /// The isolation key the box belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<IsolationKey>,
    /// Per-session mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_mounts: Vec<ResolvedMount>,
    /// Published ports: container port (`"8080/tcp"`) → host port, as of the last boot.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub host_ports: BTreeMap<String, u16>,
}

impl DockerState {
    /// The host port a container TCP port is published on, as of the last boot.
    pub fn host_port(&self, container_port: u16) -> Option<u16> {
        self.host_ports
            .get(&format!("{container_port}/tcp"))
            .copied()
    }
}

sandbox_core::sandbox_state!(DockerState, "docker");

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::{CallContext, IsolationScope, state_from_json, state_to_json};

    #[test]
    fn lossless_json_round_trip() {
        let key =
            IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user("u")).unwrap();
        let state = DockerState {
            common: CommonState::new("/workspace"),
            container_name: "sbx-0123456789abcdef".into(),
            container_id: Some("abc".into()),
            image: "busybox".into(),
            persistence: Persistence::Keep,
            key: Some(key),
            extra_mounts: vec![ResolvedMount {
                host_path: "/srv/files".into(),
                target: "/mnt/files".into(),
                read_only: true,
                env_name: "FILES_DIR".into(),
            }],
            host_ports: [("8080/tcp".to_owned(), 32768)].into(),
        };
        let json = state_to_json(&state).unwrap();
        assert!(json.contains("\"type\":\"docker\""), "{json}");
        let back = state_from_json(&json).unwrap();
        assert_eq!(state_to_json(&*back).unwrap(), json);
        let back = back.downcast::<DockerState>(crate::BACKEND).unwrap();
        assert_eq!(back, &state);
        assert_eq!(back.host_port(8080), Some(32768));
    }
}
