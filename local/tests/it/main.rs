//! relay-local's integration tests: the binary, local mode, the SDKs and the tutorial's apps.
//!
//! One test binary for the crate (one link instead of one per file); each module is one
//! file's tests, as their names say (`cargo test -p <crate> --test it <module>::`).

mod burst;
mod common;
mod delivery;
mod docs;
mod end_to_end;
mod local_mode;
mod logs;
mod operator;
mod retention;
mod sdk;
mod tls;
mod tutorial;
