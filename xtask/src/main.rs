//! xtask (being built).
fn main() {}
