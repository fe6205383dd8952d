//! A simulated accelerator: test a pipeline on a card size you do not own, on a plain CPU, in milliseconds.
//!
//! - [`SimCard`] is a card of a given size ([`CardSpec::parse`] takes `"16GB"`, `"13.5GiB"` or a catalogue
//!   name such as `rtx4090`) with a context overhead, soft and hard modes, a link and compute time model and
//!   fault injection. It implements `offload-core`'s [`DeviceMemory`](offload_core::DeviceMemory) (readings)
//!   and [`DeviceLedger`](offload_core::DeviceLedger) (allocations and transfers).
//! - [`VirtualComponent`] is a component that exists only as numbers (bytes, activation profile, FLOPs) and
//!   runs through the real `ComponentsManager`, so decisions, OOM retries and the record are production code.
//! - [`PipelineProfile::z_image_turbo`] is Z-Image-Turbo at real sizes; [`simulate`] plays it on a card.
//! - [`optimum`] computes the fewest bytes a perfect offloader would move; [`expect`] checks a run against the
//!   per-card declarations of the anchor's integration test.
//!
//! It never touches a real device: it is the mock device every other crate tests against.
//!
//! ```
//! use memory_sim::{CardSpec, PipelineProfile, RunOptions, simulate};
//!
//! let run = simulate(&PipelineProfile::z_image_turbo(4), CardSpec::parse("16GB")?, &RunOptions::default())?;
//! assert_eq!(run.observed().final_device["vae"], "cuda");
//! println!("{}\n{}", run.record, run.summary());
//! # Ok::<(), memory_sim::SimError>(())
//! ```

#![forbid(unsafe_code)]

pub mod card;
pub mod component;
pub mod donors;
pub mod error;
pub mod expect;
pub mod optimum;
pub mod profile;
pub mod run;

pub use card::{CATALOGUE, CardSpec, CardStats, Faults, LOG_LIMIT, LedgerCall, Mode, SimCard, Timing};
pub use component::{ActivationProfile, ComponentProfile, Step, VirtualComponent};
pub use donors::{DonorMachine, LINKS, PeerCard, SimLink, SimulatedStep, run_step};
pub use error::SimError;
pub use expect::{CardExpectation, Expectations};
pub use profile::PipelineProfile;
pub use run::{RunOptions, SimRun, replay, simulate};
