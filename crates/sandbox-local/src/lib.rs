//! Host process backend (work in progress).
