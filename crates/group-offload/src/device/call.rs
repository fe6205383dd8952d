//! The call protocol: one component call accounted, run, synced and read back ([`run_call`]), and a whole
//! component's call footprint measured ([`measure_call`]).

use burn::tensor::Device;
use offload_core::plan::CallPages;
use offload_core::{ComponentError, DeviceLedger, DeviceMemory};

use crate::OffloadDevice;

use super::probe::{DeviceOutput, check_device, check_outputs};

/// Closes a call's account when the call leaves, whichever way it leaves: a user's forward that panics unwinds
/// through here, and the reservation its `begin_call` made is still given back.
pub(super) struct OpenCall<'a> {
    pub(super) ledger: &'a dyn DeviceLedger,
    pub(super) estimate: u64,
    pub(super) open: bool,
}

impl OpenCall<'_> {
    pub(super) fn close(mut self) -> std::result::Result<(), ComponentError> {
        self.open = false;
        self.ledger.end_call(self.estimate)
    }
}

impl Drop for OpenCall<'_> {
    fn drop(&mut self) {
        if self.open {
            // Only reached while a panic unwinds: the panic is the error the caller sees.
            let _ = self.ledger.end_call(self.estimate);
        }
    }
}

/// Runs one call of a component (a forward, an encode, a decode) computing on `burn` (the device object's
/// execution device while the component is resident there, the host otherwise), with its activations accounted
/// on `on`'s ledger ([`DeviceLedger::begin_call`] and [`end_call`](DeviceLedger::end_call)) and its failures read
/// through `on`'s readings and named after it,
/// and reports success only once the device has done the call's work: a failed sync ([`check_device`]), an
/// output that cannot be read back ([`check_outputs`]) and a call the ledger refuses afterwards (a hard cap's
/// high-water) are errors here, so nothing surfaces later when the result is read. An out-of-memory stays
/// [`ComponentError::OutOfMemory`], the one the manager's OOM retry handles.
///
/// `f` is the caller's code and is never caught: a panic in it (a bug in a model, whatever its words) unwinds to
/// the caller, with the call's account closed on the way. Only the library's own device operations (the sync
/// and the read-back here, uploads and onloads elsewhere) are guarded against a runtime that panics.
pub fn run_call<R: DeviceOutput>(
    on: &OffloadDevice,
    burn: &Device,
    estimate: u64,
    f: impl FnOnce() -> std::result::Result<R, ComponentError>,
) -> std::result::Result<R, ComponentError> {
    run_call_making_room(on, burn, estimate, || false, f)
}

/// [`run_call`] for a component that can give memory back before its call runs: when the ledger refuses the
/// call's activations for lack of room, `make_room` is called once (a grouped model gives back the groups its
/// prefetch worker uploaded that nobody borrows yet: they come back on their first take) and, when it freed
/// anything, the reservation is tried again. Nothing has run at that point, so this is no retry of the call: an
/// out-of-memory that remains is the manager's to handle, as before.
pub fn run_call_making_room<R: DeviceOutput>(
    on: &OffloadDevice,
    burn: &Device,
    estimate: u64,
    make_room: impl FnOnce() -> bool,
    f: impl FnOnce() -> std::result::Result<R, ComponentError>,
) -> std::result::Result<R, ComponentError> {
    let (device, name, ledger, memory) = (burn, on.name(), on.ledger().as_ref(), on.memory().as_deref());
    match ledger.begin_call(estimate) {
        Err(refused) if refused.is_out_of_memory() => {
            if !make_room() {
                return Err(refused);
            }
            ledger.begin_call(estimate)?;
        }
        other => other?,
    }
    let call = OpenCall { ledger, estimate, open: true };
    let result = f();
    let synced = check_device(device, name, "run", memory);
    let read = match &result {
        Ok(value) => check_outputs(value, device, name, "run", memory),
        Err(_) => Ok(()),
    };
    let closed = call.close();
    // A device failure explains a failed call better than the call's own error, which may be its symptom.
    synced?;
    read?;
    closed?;
    result
}

/// What a whole component measured of its calls' pages: its call count at the latest activation estimate, and
/// the pages its second call at that estimate took ([`measure_call`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CallMeasure {
    estimate: u64,
    calls: u32,
    pages: Option<CallPages>,
}

impl CallMeasure {
    /// The call footprint measured at the latest estimate, once there is one.
    pub(crate) fn footprint(&self) -> Option<CallPages> {
        self.pages.filter(|p| p.estimate_bytes == self.estimate)
    }
}

/// Runs `call` and, where `memory` has pages of its own ([`DeviceMemory::held`]), measures what the component's
/// second call at `estimate` took: the pool's cache is released first, so that the call's pages are its own, and
/// the high-water of a window over the call, less its start, becomes the component's call footprint
/// ([`Offloadable::call_footprint`](offload_core::Offloadable::call_footprint)). Not the first call: it takes the
/// runtime's first buffers for the call's kernels (measured on lavapipe: the tiny text encoder's first call took
/// 110.50 KB of pages, its later ones about 87 KB). Only for a component whose weights are all on the device
/// before the call begins (a streamed one's uploads would count as its call's). A call that fails measures
/// nothing, and a reading that fails is no figure.
pub(crate) fn measure_call<R>(
    device: &Device,
    memory: Option<&dyn DeviceMemory>,
    measure: &mut CallMeasure,
    estimate: u64,
    call: impl FnOnce() -> std::result::Result<R, ComponentError>,
) -> std::result::Result<R, ComponentError> {
    if measure.estimate != estimate {
        *measure = CallMeasure { estimate, calls: 0, pages: None };
    }
    measure.calls = measure.calls.saturating_add(1);
    let window = match memory {
        Some(memory) if measure.calls == 2 && matches!(memory.held(), Ok(Some(_))) => {
            device.memory_cleanup();
            memory.open_call_window().ok().flatten().map(|token| (memory, token))
        }
        _ => None,
    };
    let result = call();
    if let Some((memory, token)) = window {
        let pages = memory.close_call_window(token);
        if let (Ok(_), Ok(Some(pages))) = (&result, pages)
            && pages > 0
        {
            measure.pages = Some(CallPages { estimate_bytes: estimate, device_bytes: pages });
        }
    }
    result
}
