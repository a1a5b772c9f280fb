//! Persisted box state: the [`SandboxState`] trait object, its shared [`CommonState`], and a
//! lossless JSON codec with typed errors.
//!
//! Each backend registers its state type by linking:
//!
//! ```text
//! #[typetag::serde(name = "local")]
//! impl SandboxState for LocalState { ... }
//! ```
//!
//! The JSON is `{"type": "<tag>", "common": {...}, <backend fields>...}`.

use std::any::Any;
use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::path::RelPath;
use crate::snapshot::SnapshotRef;

/// Version of the state JSON schema this binary writes. Older versions are read and upgraded;
/// newer ones are refused with a typed error instead of being half-understood.
pub const STATE_SCHEMA_VERSION: u32 = 1;

/// The part of every backend's state that core owns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CommonState {
    /// Schema version of this JSON.
    pub schema_version: u32,
    /// Absolute workspace root inside the box.
    pub workspace_root: String,
    /// The workspace was initialized and, if snapshots are on, snapshotted at least once.
    pub workspace_root_ready: bool,
    /// The last snapshot taken of this box, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotRef>,
    /// What projection last put into this box's workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projection: Option<ProjectionRecord>,
    /// The last call on this key was cancelled (its caller left while its closure ran); the
    /// next start reports it once ([`crate::StartReport::previous_cancelled`]) and clears it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelled: Option<CancelledCall>,
}

/// A call whose caller left while its closure ran, as the state it left records it.
///
/// By default ([`crate::OnCancel::Discard`]) its work never became current: the state is the
/// one before it (its snapshot was not advanced), and a kept box holding its work is restored
/// from that snapshot at the next start. With [`crate::OnCancel::KeepPartial`], the state's
/// snapshot holds what the box held once every command of the call was dead, and
/// `possibly_torn` names the files that may be incomplete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CancelledCall {
    /// When the caller left, ms since the epoch.
    pub at_unix_ms: i64,
    /// The partial work was kept (opted into per call): the snapshot holds it.
    pub partial: bool,
    /// With `partial`: every file the cancelled call created or changed (compared with the
    /// snapshot it started from), sorted, at most [`CancelledCall::MAX_LISTED`]. A command
    /// killed mid-write leaves its file cut short, and which file a kill cut is not knowable,
    /// so every changed file is listed: a torn file is always among them. `None` when no
    /// snapshot was taken to compare (snapshots off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub possibly_torn: Option<Vec<String>>,
    /// How many more changed files there were than `possibly_torn` lists.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unlisted: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl CancelledCall {
    /// Most paths [`possibly_torn`](Self::possibly_torn) lists.
    pub const MAX_LISTED: usize = 1000;

    /// A cancelled call at `at_unix_ms`, whose work was (`partial`) or was not kept.
    pub fn new(at_unix_ms: i64, partial: bool) -> Self {
        CancelledCall {
            at_unix_ms,
            partial,
            possibly_torn: None,
            unlisted: 0,
        }
    }
}

impl CommonState {
    /// Fresh state for a new box whose workspace root is `workspace_root`.
    pub fn new(workspace_root: impl Into<String>) -> Self {
        CommonState {
            schema_version: STATE_SCHEMA_VERSION,
            workspace_root: workspace_root.into(),
            workspace_root_ready: false,
            snapshot: None,
            projection: None,
            cancelled: None,
        }
    }

    /// The projection hash recorded for this box's workspace.
    pub fn projection_hash(&self) -> Option<&str> {
        self.projection.as_ref().map(|p| p.hash.as_str())
    }
}

/// What workspace projection last wrote into a box: the content hash and the files, so that
/// files deleted on the host can be deleted in the box.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectionRecord {
    /// SHA-256 over the sorted projected files (hex).
    pub hash: String,
    /// Every projected file, workspace-relative.
    pub files: BTreeSet<RelPath>,
}

/// A backend's persisted state. Data only: what the backend needs to find its box again.
#[typetag::serde(tag = "type")]
pub trait SandboxState: Debug + Send + Sync + 'static {
    /// The part core owns.
    fn common(&self) -> &CommonState;
    /// The part core owns, mutably.
    fn common_mut(&mut self) -> &mut CommonState;
    /// For the backend to downcast to its own type.
    fn as_any(&self) -> &dyn Any;
    /// Clone into a new box.
    fn clone_state(&self) -> Box<dyn SandboxState>;
}

/// Implement [`SandboxState`] for a backend's state type — a `Clone + Serialize +
/// Deserialize` struct with a `common: CommonState` field — registered under `tag` (the
/// backend's name, and the `type` of its JSON):
///
/// ```text
/// sandbox_core::sandbox_state!(LocalState, "local");
/// ```
#[macro_export]
macro_rules! sandbox_state {
    ($ty:ty, $tag:literal) => {
        const _: () = {
            use $crate::typetag;
            #[typetag::serde(name = $tag)]
            impl $crate::SandboxState for $ty {
                fn common(&self) -> &$crate::CommonState {
                    &self.common
                }
                fn common_mut(&mut self) -> &mut $crate::CommonState {
                    &mut self.common
                }
                fn as_any(&self) -> &dyn ::std::any::Any {
                    self
                }
                fn clone_state(&self) -> ::std::boxed::Box<dyn $crate::SandboxState> {
                    ::std::boxed::Box::new(::std::clone::Clone::clone(self))
                }
            }
        };
    };
}

impl Clone for Box<dyn SandboxState> {
    fn clone(&self) -> Self {
        self.clone_state()
    }
}

impl dyn SandboxState {
    /// Downcast to a backend's concrete state, or a typed error naming both tags.
    pub fn downcast<T: SandboxState>(&self, backend: &'static str) -> Result<&T> {
        self.as_any()
            .downcast_ref::<T>()
            .ok_or_else(|| Error::MalformedState {
                reason: format!(
                    "state of type `{}` given to the {backend} backend",
                    self.typetag_name()
                ),
            })
    }
}

/// Serialize a state to JSON.
pub fn state_to_json(state: &dyn SandboxState) -> Result<String> {
    serde_json::to_string(state).map_err(|e| Error::MalformedState {
        reason: format!("cannot serialize: {e}"),
    })
}

/// Parse state JSON written by any linked backend.
///
/// Typed errors: [`Error::MalformedState`] for JSON that is not a state object or whose
/// fields are wrong, [`Error::UnknownStateType`] (listing the known tags) when no linked
/// backend owns its `type`, and [`Error::MalformedState`] for a schema newer than this binary.
pub fn state_from_json(json: &str) -> Result<Box<dyn SandboxState>> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| Error::MalformedState {
            reason: e.to_string(),
        })?;
    let Some(tag) = value
        .get("type")
        .and_then(|t| t.as_str())
        .map(str::to_owned)
    else {
        return Err(Error::MalformedState {
            reason: "no string `type` field".into(),
        });
    };
    let known = known_state_tags();
    if !known.contains(&tag) {
        return Err(Error::UnknownStateType {
            tag,
            known: known.to_vec(),
        });
    }
    let version = value
        .pointer("/common/schema_version")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| Error::MalformedState {
            reason: "no `common.schema_version`".into(),
        })?;
    if version > u64::from(STATE_SCHEMA_VERSION) {
        return Err(Error::MalformedState {
            reason: format!(
                "schema version {version} is newer than this binary's {STATE_SCHEMA_VERSION}"
            ),
        });
    }
    let mut state: Box<dyn SandboxState> =
        serde_json::from_value(value).map_err(|e| Error::MalformedState {
            reason: format!("`{tag}` state: {e}"),
        })?;
    // Version 1 is the first; later versions upgrade older JSON here.
    state.common_mut().schema_version = STATE_SCHEMA_VERSION;
    Ok(state)
}

/// The `type` tags of every state type linked into this binary, sorted.
pub fn known_state_tags() -> &'static [String] {
    static TAGS: OnceLock<Vec<String>> = OnceLock::new();
    TAGS.get_or_init(|| {
        // typetag reports the registered names through `Error::unknown_variant` when asked for a
        // tag nobody has; a deserializer with its own error type catches that list.
        #[derive(Debug)]
        struct Probe(Vec<&'static str>);
        impl std::fmt::Display for Probe {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "probe")
            }
        }
        impl std::error::Error for Probe {}
        impl serde::de::Error for Probe {
            fn custom<T: std::fmt::Display>(_: T) -> Self {
                Probe(Vec::new())
            }
            fn unknown_variant(_: &str, expected: &'static [&'static str]) -> Self {
                Probe(expected.to_vec())
            }
        }
        let probe =
            serde::de::value::MapDeserializer::<_, Probe>::new(std::iter::once(("type", "\u{0}")));
        let mut tags: Vec<String> = match <Box<dyn SandboxState>>::deserialize(probe) {
            Err(Probe(names)) => names.into_iter().map(str::to_owned).collect(),
            Ok(_) => Vec::new(),
        };
        tags.sort();
        tags
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Serialize, Deserialize)]
    struct TestState {
        common: CommonState,
        marker: String,
    }

    crate::sandbox_state!(TestState, "core-test");

    #[test]
    fn round_trip() {
        let state = TestState {
            common: CommonState::new("/ws"),
            marker: "m".into(),
        };
        let json = state_to_json(&state).unwrap();
        assert!(json.contains("\"type\":\"core-test\""), "{json}");
        let back = state_from_json(&json).unwrap();
        assert_eq!(state_to_json(&*back).unwrap(), json);
        assert_eq!(back.downcast::<TestState>("core-test").unwrap().marker, "m");
    }

    #[test]
    fn typed_errors() {
        assert!(known_state_tags().iter().any(|t| t == "core-test"));
        match state_from_json(r#"{"type":"nope","common":{}}"#).unwrap_err() {
            Error::UnknownStateType { tag, known } => {
                assert_eq!(tag, "nope");
                assert!(known.contains(&"core-test".to_owned()));
            }
            e => panic!("{e}"),
        }
        for bad in [
            "{",
            "[]",
            r#"{"type":1}"#,
            r#"{"type":"core-test","common":{"schema_version":1}}"#,
        ] {
            assert!(
                matches!(
                    state_from_json(bad).unwrap_err(),
                    Error::MalformedState { .. }
                ),
                "{bad}"
            );
        }
        let future = r#"{"type":"core-test","marker":"m","common":{"schema_version":99,"workspace_root":"/","workspace_root_ready":false}}"#;
        assert!(matches!(
            state_from_json(future).unwrap_err(),
            Error::MalformedState { .. }
        ));
    }
}
