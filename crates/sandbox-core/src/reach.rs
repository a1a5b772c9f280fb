//! [`Reach`]: how far a guard or a store is shared, for the builder's set-up checks.

use std::fmt;

/// How far a guard's mutual exclusion or a store's data reaches. Ordered from nothing to many
/// hosts, so a set-up can require "at least".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reach {
    /// Nothing: a no-op guard excludes no one, a no-op snapshot store keeps nothing.
    None,
    /// This process only (memory).
    Process,
    /// The processes of one host (files with `flock`).
    Host,
    /// The processes of many hosts (Redis, an object store).
    Cluster,
}

impl fmt::Display for Reach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reach::None => "nothing",
            Reach::Process => "this process",
            Reach::Host => "one host",
            Reach::Cluster => "many hosts",
        })
    }
}
