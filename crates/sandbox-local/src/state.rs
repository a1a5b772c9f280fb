//! [`LocalState`]: what the local backend persists to find a box again.

use std::path::PathBuf;

use sandbox_core::{CommonState, Persistence};
use serde::{Deserialize, Serialize};

/// The local backend's state, tagged `"local"` in state JSON.
///
/// ```json
/// {"type":"local","common":{...},"box_dir":"/abs/.sandbox/boxes/k-0123456789abcdef",
///  "persistence":"keep","key":"agents/coder/sessions/s1"}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LocalState {
    /// The part core owns.
    pub common: CommonState,
    /// Absolute path of the box directory (`<base_dir>/<box name>`); the workspace is its
    /// `workspace` subdirectory.
    pub box_dir: PathBuf,
    /// The persistence of the client that created or resumed the box. Informational: a
    /// resumed box is released according to the resuming client's option.
    pub persistence: Persistence,
    /// The isolation key string the box belongs to, so a box directory recreated on resume
    /// carries the same owner marker as the original.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

sandbox_core::sandbox_state!(LocalState, "local");
