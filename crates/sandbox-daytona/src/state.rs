//! [`DaytonaState`]: what the Daytona backend needs to find its sandbox again.

use sandbox_core::{CommonState, IsolationKey, Persistence};
use serde::{Deserialize, Serialize};

/// Persisted state of one Daytona box (`"type": "daytona"`). Holds no credential: the API key
/// lives in the client's options only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct DaytonaState {
    /// Core's part.
    pub common: CommonState,
    /// The sandbox's name (`<prefix>-<key digest>` for kept boxes).
    pub name: String,
    /// The sandbox's id as last seen: another id under the same name is a new sandbox, whose
    /// workspace must be restored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// What `release` does.
    pub persistence: Persistence,
    /// The isolation key the box belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<IsolationKey>,
}

sandbox_core::sandbox_state!(DaytonaState, "daytona");

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_core::{CallContext, Error, IsolationScope, state_from_json, state_to_json};

    fn sample() -> DaytonaState {
        let key =
            IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user("u")).unwrap();
        DaytonaState {
            common: CommonState::new("/home/daytona/workspace"),
            name: "sbx-0123456789abcdef".into(),
            sandbox_id: Some("5f0c9a1e-0000-4000-8000-000000000001".into()),
            persistence: Persistence::Keep,
            key: Some(key),
        }
    }

    #[test]
    fn lossless_json_round_trip_without_secrets() {
        let state = sample();
        let json = state_to_json(&state).unwrap();
        assert!(json.contains("\"type\":\"daytona\""), "{json}");
        for word in ["api_key", "apiKey", "token", "Bearer"] {
            assert!(!json.contains(word), "{word} in {json}");
        }
        let back = state_from_json(&json).unwrap();
        assert_eq!(state_to_json(&*back).unwrap(), json);
        assert_eq!(
            back.downcast::<DaytonaState>(crate::BACKEND).unwrap(),
            &state
        );
    }

    #[test]
    fn malformed_state_is_a_typed_error() {
        let json = state_to_json(&sample()).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v.as_object_mut().unwrap().remove("name");
        assert!(matches!(
            state_from_json(&v.to_string()),
            Err(Error::MalformedState { .. })
        ));
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["persistence"] = "forever".into();
        assert!(matches!(
            state_from_json(&v.to_string()),
            Err(Error::MalformedState { .. })
        ));
    }
}
