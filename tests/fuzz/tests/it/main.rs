//! Attacks, fuzzing and property tests.
//!
//! One test binary for the crate (one link instead of one per file); each module is one
//! file's tests, as their names say (`cargo test -p <crate> --test it <module>::`).

mod attacks;
mod fuzz;
mod properties;
