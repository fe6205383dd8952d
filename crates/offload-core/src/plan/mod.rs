//! Planning: presets, budgets, settings, capacity profiles and phase staging, decided from measured facts.
//!
//! One call routes every component of a pipeline to a mechanism ([`Route`]: resident, component offload,
//! block or leaf group offload, off) by [`Preset`], and says why, with the numbers:
//!
//! - [`plan_pipeline`] (and [`enable_offload`] for one component) takes plain-data [`ComponentSpec`]s, the
//!   resolved [`Settings`] (or just a preset) and a [`Machine`] (device memory, [`HostMemory`], [`TimeModel`]),
//!   and returns a [`Plan`] whose `Display` is a table: route, resident, pinned, streamed per step, predicted
//!   time per step and peak;
//! - [`donors`] places a streamed model's groups over the places they can live (a second card, pinned or
//!   pageable RAM, the checkpoint file) by each one's link cost, under every budget, exactly;
//! - [`budget`] holds the budgets as pure functions: resident budget, pinned budget, the full-pin rule,
//!   calibration;
//! - [`Settings::resolve`] layers explicit arguments over `OFFLOAD_*` variables over a TOML file over preset
//!   defaults, and is the one place planning input is validated;
//! - `ProfileStore` keeps capacity profiles and named calibrations as TOML under the data directory (feature
//!   `io`, with the settings file, the process's environment and the host's `/proc/meminfo`: planning's
//!   I/O, which a model crate that passes its facts in does not compile);
//! - [`Phases`] times encode, denoise and decode and runs a release hook between them.
//!
//! This module is policy: it decides and explains, and never touches a device. It knows no burn, no CUDA and
//! no model: the pipeline crate describes its components and applies the plan with `ComponentsManager` and
//! group offload. A quantized component is routed as a float one of its (quantized) sizes: its weights keep
//! their own kernels and stream as they are, and its explanation says it is quantized.

pub mod balanced;
pub mod budget;
pub mod capacity;
pub mod component;
pub mod donors;
pub mod error;
pub mod footprint;
pub mod host;
pub mod link;
pub mod machine;
pub mod phases;
pub mod planner;
pub mod preset;
pub mod settings;

pub use balanced::{Assignment, Balanced, balance};
#[cfg(feature = "io")]
pub use capacity::ProfileStore;
pub use capacity::{
    CapacityProfile, CapacityWarning, Limit, MAX_OBSERVATIONS, Observation, Outcome, Peaks, Recommendation, Recorded,
    SCHEMA_VERSION, WarningKind, Workload, fnv1a_64,
};
pub use component::{BlockLayout, ComponentSpec, HostTier, Route};
pub use donors::{
    Donor, DonorBudget, DonorKind, DonorPlacement, DonorProblem, MAX_EXHAUSTIVE, MAX_NODES, SearchOutcome,
    StreamedGroup,
};
pub use error::{Origin, PlanError};
pub use footprint::{CallFootprint, CallPages, Footprint, apply_call_footprints, apply_footprints};
pub use host::HostMemory;
pub use link::{
    DiskRun, LinkRun, LinkSource, MAX_DISK_RUNS, MAX_LINK_RUNS, MAX_PEER_RUNS, MeasuredDisk, MeasuredLink,
    MeasuredPeer, PeerRun,
};
pub use machine::{DeviceFacts, Machine, PeerDevice, PeerShare, TimeModel};
pub use phases::{PhaseReport, PhaseTiming, Phases};
pub use planner::{ComponentPlan, Plan, enable_offload, plan_pipeline};
pub use preset::{PRESET_NAMES, PinPolicy, Preset, PresetDefaults, ResidentPolicy, Routing, presets_table};
pub use settings::{HostTierSetting, KEYS, KeyInfo, Kind, MAX_PREFETCH_DEPTH, Settings, SettingsLayer, settings_table};
