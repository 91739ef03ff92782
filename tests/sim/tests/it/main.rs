//! The simulations on the simulated clock: burst, chaos, delivery, fallback, load, submit.
//!
//! One test binary for the crate (one link instead of one per file); each module is one
//! file's tests, as their names say (`cargo test -p <crate> --test it <module>::`).

mod burst;
mod chaos;
mod delivery;
mod fallback;
mod load;
mod submit;
