//! [`K8sState`]: what the Kubernetes backend needs to find its claim again.

use sandbox_core::{CommonState, IsolationKey, Persistence};
use serde::{Deserialize, Serialize};

/// How the data plane reached the pod when the state was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ConnectionKind {
    /// Pod IP.
    PodIp,
    /// The Sandbox's Service DNS name.
    ServiceDns,
    /// The sandbox router.
    Router,
    /// A Gateway in front of the router.
    Gateway,
}

/// Persisted state of one Kubernetes box (`"type": "kubernetes"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct K8sState {
    /// Core's part.
    pub common: CommonState,
    /// The SandboxClaim (`<prefix>-<key digest>` for kept boxes).
    pub claim_name: String,
    /// Its namespace.
    pub namespace: String,
    /// The bound Sandbox, as last seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_name: Option<String>,
    /// The Sandbox's pod, as last seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// The claim's uid as last seen: another uid under the same name is a new pod, whose
    /// workspace must be restored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_uid: Option<String>,
    /// How the pod was reached.
    pub connection: ConnectionKind,
    /// What `release` does.
    pub persistence: Persistence,
    /// The isolation key the box belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<IsolationKey>,
}

sandbox_core::sandbox_state!(K8sState, "kubernetes");

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::{
        CallContext, Error, IsolationScope, SandboxState, state_from_json, state_to_json,
    };

    fn sample() -> K8sState {
        let key =
            IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user("u")).unwrap();
        K8sState {
            common: CommonState::new("/workspace"),
            claim_name: "sbx-0123456789abcdef".into(),
            namespace: "agents".into(),
            sandbox_name: Some("sbx-0123456789abcdef".into()),
            pod_name: Some("pool-abc12".into()),
            claim_uid: Some("9b1d".into()),
            connection: ConnectionKind::PodIp,
            persistence: Persistence::Keep,
            key: Some(key),
        }
    }

    #[test]
    fn lossless_json_round_trip() {
        let state = sample();
        let json = state_to_json(&state).unwrap();
        assert!(json.contains("\"type\":\"kubernetes\""), "{json}");
        assert!(json.contains("\"connection\":\"pod_ip\""), "{json}");
        let back = state_from_json(&json).unwrap();
        assert_eq!(state_to_json(&*back).unwrap(), json);
        assert_eq!(back.downcast::<K8sState>(crate::BACKEND).unwrap(), &state);
    }

    #[test]
    fn malformed_state_is_a_typed_error() {
        let json = state_to_json(&sample()).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["connection"] = "carrier_pigeon".into();
        assert!(matches!(
            state_from_json(&v.to_string()),
            Err(Error::MalformedState { .. })
        ));
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v.as_object_mut().unwrap().remove("claim_name");
        assert!(matches!(
            state_from_json(&v.to_string()),
            Err(Error::MalformedState { .. })
        ));
        // Another backend's state is refused by downcast, naming both tags.
        let state: Box<dyn SandboxState> = Box::new(sample());
        assert!(state.downcast::<K8sState>(crate::BACKEND).is_ok());
    }
}
