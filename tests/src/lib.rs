//! Shared test infrastructure for the workspace. The cross-crate tests themselves live in `tests/tests/`.
//!
//! [`fuzz`] is a small mutation fuzzer used by `cargo xtask fuzz` and by each crate's fuzz smoke tests: it
//! runs a target over mutated seed inputs and reports the inputs that made it panic. The stable toolchain here
//! cannot run `cargo fuzz` (it needs nightly), so this is the harness the issue allows instead.

#![forbid(unsafe_code)]

pub mod fuzz;
