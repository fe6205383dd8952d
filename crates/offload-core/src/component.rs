//! The component model: what a model must do to be moved between the host and an execution device.

use std::any::Any;

use crate::name::DeviceName;
use crate::size::format_size;

/// An error raised by a component while it moves or runs.
///
/// [`ComponentError::OutOfMemory`] is the variant the manager's OOM retry recognises; everything else is passed
/// through to the caller unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ComponentError {
    /// The device could not give the memory asked for.
    #[error("out of memory on {device}: asked for {}, {} available", format_size(*requested), format_size(*available))]
    OutOfMemory {
        /// The device that ran out.
        device: DeviceName,
        /// Bytes asked for.
        requested: u64,
        /// Bytes the device could still give.
        available: u64,
    },
    /// Moving weights between the host and the device failed; the host copy is intact.
    #[error("transfer of {what} failed: {message}; the host copy is intact, so retrying the run is safe")]
    Transfer {
        /// What was being moved.
        what: String,
        /// What went wrong.
        message: String,
    },
    /// The execution device failed for a reason other than memory (a kernel that faulted, a lost device, a
    /// buffer larger than the device can ever give); never an out-of-memory, so the OOM retry does not handle it.
    #[error(
        "device {device} failed {message}; this is not an out-of-memory, so offloading more would not help: \
         check the device's driver and logs, and restart the process if the device is poisoned"
    )]
    Device {
        /// The device that failed.
        device: DeviceName,
        /// What was running and the runtime's own words (`during run: ...`).
        message: String,
    },
    /// The component's own computation failed.
    #[error("{0}")]
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl ComponentError {
    /// Whether this is an out-of-memory error, the one the OOM retry handles.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, ComponentError::OutOfMemory { .. })
    }

    /// Wraps any error as [`ComponentError::Other`].
    pub fn other(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        ComponentError::Other(error.into())
    }
}

/// A model (or any weight-holding component) that can live on the host or on an execution device.
///
/// # Contract
///
/// - The manager calls [`onload`](Offloadable::onload) only when [`device`](Offloadable::device) is the host,
///   and [`offload`](Offloadable::offload) only when it is not.
/// - A failed `onload` leaves the component on the host with its weights intact; a failed `offload` leaves it on
///   the device with its weights intact. An out-of-memory failure is reported as
///   [`ComponentError::OutOfMemory`], so the manager can make room and try again.
/// - [`resident_bytes`](Offloadable::resident_bytes) is what the component holds on the device while resident:
///   its whole size for a plain model, its resident budget for a model under group offload.
/// - A component under group offload ([`evictable`](Offloadable::evictable) is false) moves its own
///   groups; the manager never chooses it for eviction, but counts its resident bytes.
/// - [`window_bytes`](Offloadable::window_bytes) is what the component's next call will bring onto the device
///   beyond its resident bytes and beyond what it already holds there: a streamed model's window (the groups it
///   holds at once while it computes), 0 for a plain model (the default). The manager asks for it, with the
///   component's slot held and no call running, before every run while auto offload is on: on an onload the
///   strategy sees `resident_bytes + window_bytes` as the incoming component's size; for a component already on
///   the device, when the window does not fit beside the reserve in the reading, the strategy is asked the same
///   question with the window as the incoming size, and the components it chooses leave, recorded as
///   `release_memory_for:<id>`. So a model that streams never finds its prefetches refused because another
///   component was onloaded while it held its next call's first groups.
/// - The manager calls `onload` and `offload` with its registry lock held, so they must not call back into the
///   manager (its timeline and record are reached through the handles it gave out before).
///
/// ```
/// use offload_core::{ComponentError, DeviceName, Offloadable};
///
/// /// A component that only tracks where it is.
/// struct Tiny { bytes: u64, device: DeviceName }
///
/// impl Offloadable for Tiny {
///     fn bytes(&self) -> u64 { self.bytes }
///     fn device(&self) -> DeviceName { self.device.clone() }
///     fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
///         self.device = device.clone();
///         Ok(())
///     }
///     fn offload(&mut self) -> Result<(), ComponentError> {
///         self.device = DeviceName::cpu();
///         Ok(())
///     }
/// }
/// ```
pub trait Offloadable: Any + Send {
    /// Total size of the component's weights in bytes.
    fn bytes(&self) -> u64;

    /// Where the component's weights are now.
    fn device(&self) -> DeviceName;

    /// Moves the weights onto `device`.
    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError>;

    /// Moves the weights to the host.
    fn offload(&mut self) -> Result<(), ComponentError>;

    /// Bytes held on the execution device while the component is resident.
    fn resident_bytes(&self) -> u64 {
        self.bytes()
    }

    /// Bytes the component's next call will still bring onto the execution device beyond
    /// [`resident_bytes`](Offloadable::resident_bytes), less what it already holds there beyond them (they are in
    /// the device's reading already): for a model under group offload, its window (the `1 + prefetch depth`
    /// largest groups it streams) less the streamed groups it holds now (the first groups of its next forward,
    /// prefetched at the end of its last). 0 by default: a plain model holds all it needs once onloaded. Read by
    /// the manager before each run (see the trait's contract); it must be cheap and must not move anything.
    fn window_bytes(&self) -> u64 {
        0
    }

    /// What the weights took on the execution device at the component's first whole onload there, as the device's
    /// allocator counts them (its pages held after the onload less before, its cache released first), where the
    /// component measured it; `None` where it did not (a device whose readings have no pages, such as a simulated
    /// card, which holds the bytes asked). The manager keeps it for the plans
    /// ([`ComponentsManager::device_footprints`](crate::ComponentsManager::device_footprints)).
    fn device_footprint(&self) -> Option<u64> {
        None
    }

    /// What the component's first call at its latest activation estimate took on the execution device, in the
    /// device allocator's pages (the high-water during the call over what it held when the call began, the cache
    /// released first), where the component measured it; `None` where it did not (a device without pages of its
    /// own, [`DeviceMemory::held`](crate::DeviceMemory::held)). The manager hands it out for the plans
    /// ([`ComponentsManager::call_footprints`](crate::ComponentsManager::call_footprints)).
    fn call_footprint(&self) -> Option<crate::measured::CallPages> {
        None
    }

    /// Whether the manager may evict the component wholesale to make room for another (true by default). A
    /// model under group offload moves its own groups and answers false, unless its plan lets the manager
    /// release it whole between phases.
    fn evictable(&self) -> bool {
        true
    }

    /// Gives back what the component holds on the device only in anticipation of its next call (a model under
    /// group offload: the groups its prefetch worker uploaded that no call borrows yet, which come back on their
    /// first take); returns the bytes given back. The manager calls it, on the components it may not evict and
    /// that no call holds, when another component ran out of memory and nothing evictable is left, before it
    /// reports that the component does not fit; and, once a run, on the component whose own call ran out of memory
    /// with nothing of the others left to give, once that call has ended, before it runs the call again. Nothing by
    /// default.
    fn release_idle(&mut self) -> u64 {
        0
    }

    /// Gives back what a failed call still holds on the device. The manager calls it once it has handled a
    /// call's out-of-memory error: after the `oom_retry` offload it recorded (whose readings show what the
    /// failed call held, as the anchor's do while the exception is alive) and before the call runs again or the
    /// error is returned. Nothing by default: a burn component's partial activations are freed when the failed
    /// call's tensors drop.
    fn release_failed_call(&mut self) {}

    /// A class name for summaries, e.g. `ZImageTransformer2DModel`.
    fn class_name(&self) -> String {
        let full = std::any::type_name::<Self>();
        full.rsplit("::").next().unwrap_or(full).to_string()
    }
}
