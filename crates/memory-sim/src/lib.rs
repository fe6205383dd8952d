//! memory-sim (being built).
