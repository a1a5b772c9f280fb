//! [`E2bState`]: what the E2B backend needs to find its sandbox again. Never a secret: the
//! envd access token is fetched again from the API whenever a sandbox is reattached.

use sandbox_core::{CommonState, IsolationKey, Persistence};
use serde::{Deserialize, Serialize};

/// Persisted state of one E2B box (`"type": "e2b"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct E2bState {
    /// Core's part.
    pub common: CommonState,
    /// The sandbox, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// The template (or native snapshot id) the sandbox was made from.
    pub template: String,
    /// The sandbox's domain, when the API reported one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// What `release` does.
    pub persistence: Persistence,
    /// The isolation key the box belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<IsolationKey>,
}

sandbox_core::sandbox_state!(E2bState, "e2b");

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::{CallContext, Error, IsolationScope, state_from_json, state_to_json};

    fn sample() -> E2bState {
        let key =
            IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user("u")).unwrap();
        E2bState {
            common: CommonState::new("/home/user/workspace"),
            sandbox_id: Some("i1a2b3c4d5e6".into()),
            template: "base".into(),
            domain: Some("e2b.app".into()),
            persistence: Persistence::Keep,
            key: Some(key),
        }
    }

    #[test]
    fn lossless_json_round_trip_without_secrets() {
        let state = sample();
        let json = state_to_json(&state).unwrap();
        assert!(json.contains("\"type\":\"e2b\""), "{json}");
        assert!(json.contains("\"sandbox_id\":\"i1a2b3c4d5e6\""), "{json}");
        for word in ["token", "Token", "api_key", "secret"] {
            assert!(!json.contains(word), "{word} in {json}");
        }
        let back = state_from_json(&json).unwrap();
        assert_eq!(state_to_json(&*back).unwrap(), json);
        assert_eq!(back.downcast::<E2bState>(crate::BACKEND).unwrap(), &state);
    }

    #[test]
    fn malformed_state_is_a_typed_error() {
        let json = state_to_json(&sample()).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["persistence"] = "forever".into();
        assert!(matches!(
            state_from_json(&v.to_string()),
            Err(Error::MalformedState { .. })
        ));
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v.as_object_mut().unwrap().remove("template");
        assert!(matches!(
            state_from_json(&v.to_string()),
            Err(Error::MalformedState { .. })
        ));
    }
}
