//! The crate's error type: one enum, each message naming the operation, the component and what to do next.

use crate::component::ComponentError;
use crate::device::DeviceName;
use crate::size::{SizeError, format_size};

/// Everything `offload-core` can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Planning or settings failed: an unknown preset, a bad setting, an impossible plan.
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),

    /// A size string was malformed.
    #[error(transparent)]
    Size(#[from] SizeError),

    /// A device string was malformed.
    #[error(transparent)]
    DeviceName(#[from] crate::device::DeviceNameError),

    /// No component has this id.
    #[error("no component with id {id:?}; known ids: {known}")]
    UnknownComponent {
        /// The id asked for.
        id: String,
        /// The ids the manager holds, comma-separated.
        known: String,
    },

    /// A lookup matched nothing.
    #[error("no components found matching {query}; list them with the manager's summary")]
    NoMatch {
        /// The filter as written.
        query: String,
    },

    /// A lookup that must be exact matched several components.
    #[error("multiple components found matching {query}: {ids:?}; add a collection or use an id")]
    MultipleMatches {
        /// The filter as written.
        query: String,
        /// The ids it matched, sorted.
        ids: Vec<String>,
    },

    /// A lookup mixed an id with other filters.
    #[error("a lookup by id takes no other filter (got {query}); pass the id alone")]
    AmbiguousLookup {
        /// The filter as written.
        query: String,
    },

    /// A component name was empty or contained characters that ids cannot carry.
    #[error("invalid component name {name:?}: use letters, digits, '-' or '_', not empty")]
    InvalidName {
        /// The name given.
        name: String,
    },

    /// The component is not of the type the caller asked for.
    #[error("component {id} is a {actual}, not a {requested}; run it with its own type")]
    WrongType {
        /// The component's id.
        id: String,
        /// Its class name.
        actual: String,
        /// The type asked for.
        requested: String,
    },

    /// Auto offload was asked with the host as the execution device: there is nowhere to offload to.
    #[error(
        "cannot enable auto offload onto {device}: the execution device is the host, so there is nothing to \
         offload to; run on an accelerator (a device such as cuda:0 or wgpu:0), or simulate one on the CPU with a \
         simulated card's readings (memory-sim's SimCard, `--card 16GB` in the CLI)"
    )]
    HostExecution {
        /// The device the readings were for.
        device: DeviceName,
    },

    /// An operation that needs auto offload was called before `enable_auto_offload`.
    #[error("auto offloading is not enabled; call `enable_auto_offload` first")]
    NotEnabled,

    /// A component is running on another thread, so it cannot be moved or removed now.
    #[error("component {id} is running on another thread; {operation} it once that run returns")]
    InUse {
        /// The component's id.
        id: String,
        /// What was attempted.
        operation: &'static str,
    },

    /// The strategy returned something it may not: an id that is not resident, or a protected component.
    #[error("strategy {strategy} chose {id} to make room for {incoming}, but {problem}; fix the strategy")]
    InvalidDecision {
        /// The strategy's name.
        strategy: String,
        /// The id it returned.
        id: String,
        /// The component being onloaded.
        incoming: String,
        /// What is wrong with the choice.
        problem: &'static str,
    },

    /// A component ran out of memory with every other managed component already offloaded.
    #[error(
        "{id} ({}) ran out of device memory on {device} ({source}) with every other managed component already \
         offloaded, so it does not fit on its own; use group offloading for it (block or leaf level), which \
         streams its layers through the device, or a larger card",
        format_size(*bytes)
    )]
    DoesNotFit {
        /// The component's id.
        id: String,
        /// Its size.
        bytes: u64,
        /// The execution device.
        device: DeviceName,
        /// The out-of-memory error of the last attempt.
        source: ComponentError,
    },

    /// Moving or running a component failed with an error other than a handled out-of-memory.
    #[error("{operation} {id} failed: {source}")]
    Component {
        /// What the manager was doing: `onload`, `offload`, `run`.
        operation: &'static str,
        /// The component's id.
        id: String,
        /// The component's error.
        source: ComponentError,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
