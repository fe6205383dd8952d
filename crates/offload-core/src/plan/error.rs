//! The planning layer's error type: one enum for presets, settings, host readings, planning and profiles.

use std::fmt;
use std::path::PathBuf;

use crate::size::format_size;

/// Where a setting's value came from, in precedence order: an explicit argument beats the environment, which
/// beats the TOML file, which beats the preset's default.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Passed by the program (a function argument, a command-line flag).
    Explicit,
    /// An `OFFLOAD_*` environment variable, by name.
    Environment(String),
    /// The TOML settings file.
    File,
    /// Nobody set it: the preset's default applies.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Explicit => f.write_str("an explicit argument"),
            Origin::Environment(name) => write!(f, "environment variable {name}"),
            Origin::File => f.write_str("the TOML settings file"),
            Origin::Default => f.write_str("the preset default"),
        }
    }
}

/// Everything the planning layer can fail with. Messages are lowercase, name the key, component or file, and
/// say what to do next.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A preset name that is not one of the presets.
    #[error("unknown preset {input:?}; use one of: {accepted}")]
    UnknownPreset {
        /// The name as given.
        input: String,
        /// The accepted names, comma-separated.
        accepted: &'static str,
    },

    /// A key in the TOML file, or one passed by name, that is not a setting.
    #[error("unknown setting {key:?} in {origin}; use one of: {accepted}")]
    UnknownKey {
        /// The key as written.
        key: String,
        /// Where it was found.
        origin: Origin,
        /// Every setting's name, comma-separated.
        accepted: String,
    },

    /// An `OFFLOAD_*` environment variable that names no setting.
    #[error("unknown environment variable {name}; unset it or use one of: {accepted}")]
    UnknownVariable {
        /// The variable's name.
        name: String,
        /// Every recognised variable, comma-separated.
        accepted: String,
    },

    /// A setting whose value cannot be read.
    #[error("invalid value {value:?} for setting {key} from {origin}: expected {expected}; change it there")]
    InvalidValue {
        /// The setting's name.
        key: &'static str,
        /// The value as given.
        value: String,
        /// Where it came from.
        origin: Origin,
        /// The accepted values, in words.
        expected: &'static str,
    },

    /// The settings file is not valid TOML.
    #[error("cannot read the settings file: {message}; fix the TOML syntax")]
    InvalidToml {
        /// The parser's message.
        message: String,
    },

    /// Reading a settings file failed.
    #[error("cannot read the settings file {path}: {source}; check OFFLOAD_CONFIG")]
    ConfigFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },

    /// Host memory cannot be read on this platform, or the reading is malformed.
    #[error(
        "cannot read host memory on {platform}: {problem}; pass it explicitly with HostMemory::new or the \
         host_available setting (OFFLOAD_HOST_AVAILABLE)"
    )]
    HostMemory {
        /// `std::env::consts::OS`.
        platform: &'static str,
        /// What went wrong.
        problem: String,
    },

    /// A component description is inconsistent.
    #[error("invalid description of component {component:?}: {problem}")]
    InvalidComponent {
        /// The component's name.
        component: String,
        /// What is wrong, and how to fix it.
        problem: String,
    },

    /// A time model figure is not a finite positive number.
    #[error(
        "invalid time model: {field} is {value}; give a finite positive number (a measurement or a datasheet figure)"
    )]
    InvalidTimeModel {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },

    /// No route fits the component on the device.
    #[error(
        "cannot plan {component}: {route} needs {} on the device, {} available ({reason}); {advice}",
        format_size(*needs),
        format_size(*available)
    )]
    DoesNotFit {
        /// The component's name.
        component: String,
        /// The cheapest route in device memory that the component was allowed.
        route: String,
        /// What that route needs, activations included.
        needs: u64,
        /// What the device has.
        available: u64,
        /// Why no cheaper route was allowed.
        reason: String,
        /// What to do next.
        advice: &'static str,
    },

    /// The host copies the plan must keep in RAM do not fit in the usable host RAM, even with every copy that can
    /// move out of RAM read from its checkpoint file or kept in the disk store: the run would swap.
    #[error(
        "cannot plan the host copies: {in_ram} must stay in RAM and need {}, {} of host RAM usable ({} available \
         less the {} margin); {advice}",
        format_size(*needs),
        format_size(*usable),
        format_size(*available),
        format_size(*margin)
    )]
    HostDoesNotFit {
        /// The copies that stay in RAM, each with its bytes and why it cannot leave.
        in_ram: String,
        /// Host bytes those copies need.
        needs: u64,
        /// Host bytes the plan may fill: available less the margin.
        usable: u64,
        /// Host bytes available (the reading, or the `host_available` setting).
        available: u64,
        /// Host bytes left to the rest of the machine ([`crate::plan::budget::host_margin`]).
        margin: u64,
        /// What would fit: the settings or the RAM that would make the plan fit.
        advice: String,
    },

    /// A donor problem that cannot be searched: a rate or latency that is not a finite number, a budget that does
    /// not exist, a group of no bytes.
    #[error("invalid donor placement problem: {problem}")]
    InvalidDonors {
        /// What is wrong, and how to fix it.
        problem: String,
    },

    /// The streamed groups fit in no placement over the donors: every donor that holds them has a budget, and the
    /// budgets cannot hold them all.
    #[error(
        "cannot place {groups} streamed groups ({}, the largest {}) over the donors: their budgets ({budgets}) cannot \
         hold them; add a donor without a budget (the checkpoint file), more host RAM or a second card, or keep more \
         groups resident on the execution device",
        format_size(*needs),
        format_size(*largest)
    )]
    DonorsTooSmall {
        /// How many groups stream.
        groups: usize,
        /// Their bytes.
        needs: u64,
        /// The largest group's bytes.
        largest: u64,
        /// Each budget with its bytes, comma-separated.
        budgets: String,
    },

    /// A disk run that timed no read at a positive rate, refused before anything is stored.
    #[error(
        "cannot store the disk run of {disk}: it timed {reads} reads at a median of {median} bytes/s; store only runs \
         that timed reads (DiskRun::from_rate gives None for a run that timed none)"
    )]
    InvalidDiskRun {
        /// The disk's label.
        disk: String,
        /// Reads the run timed.
        reads: u64,
        /// Their median rate, bytes per second.
        median: f64,
    },

    /// A peer link run that timed no copy at a positive rate, refused before anything is stored.
    #[error(
        "cannot store the run of the copies from {peer} onto {device}: it timed {copies} copies at a median of \
         {median} bytes/s; store only runs that timed copies (PeerRun::from_rate gives None for a run that timed none)"
    )]
    InvalidPeerRun {
        /// The execution device's label.
        device: String,
        /// The peer's name.
        peer: String,
        /// Copies the run timed.
        copies: u64,
        /// Their median rate, bytes per second.
        median: f64,
    },

    /// The platform's data directory is unknown, so profiles have nowhere to live.
    #[error("cannot find the platform's data directory for capacity profiles; set profile_dir (OFFLOAD_PROFILE_DIR)")]
    NoDataDir,

    /// A profile file could not be read or written.
    #[error(
        "cannot {operation} capacity profile {path}: {source}; check the directory's permissions or set profile_dir"
    )]
    ProfileIo {
        /// `read`, `write`, `create the directory of`.
        operation: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },

    /// A profile file exists but is not a valid profile.
    #[error("capacity profile {path} is malformed: {message}; delete it to start the profile over")]
    ProfileFormat {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
}
