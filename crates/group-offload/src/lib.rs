//! group-offload (being built).
