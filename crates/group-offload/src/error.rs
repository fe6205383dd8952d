//! The crate's error type: one enum whose messages name the operation, the group, the bytes and what to do.

use offload_core::{ComponentError, format_size};

/// Everything `group-offload` can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Uploading a group onto the execution device failed (the ledger refused the allocation, the transfer failed,
    /// or the disk copy could not be read). The host copy is intact and nothing stays allocated for the group.
    #[error(
        "cannot onload group {group} ({}) onto {device}: {source}; the host copy is intact, so free memory \
         (a smaller prefetch depth or resident budget, leaf level instead of block level) and run again",
        format_size(*bytes)
    )]
    Onload {
        /// The group's record id, `model/group`.
        group: String,
        /// The group's size in bytes.
        bytes: u64,
        /// The execution device.
        device: String,
        /// What the ledger (or the disk store) reported.
        source: ComponentError,
    },

    /// A model was run on a device other than the one its group offload was prepared for.
    #[error(
        "group offload of {model} was prepared for {prepared}, but it was run on {requested}; build the \
         offloader with GroupOffloadConfig::new(.., device) for {requested}, or move the inputs to {prepared}"
    )]
    WrongDevice {
        /// The model's name.
        model: String,
        /// The device the offloader uploads to.
        prepared: String,
        /// The device the caller used.
        requested: String,
    },

    /// No group has this name.
    #[error("{model} has no group {group:?}; known groups: {known}")]
    UnknownGroup {
        /// The model's name.
        model: String,
        /// The name asked for.
        group: String,
        /// The groups of that part, comma-separated.
        known: String,
    },

    /// A leaf-level block was asked for a field path that is no leaf of its own and that no one group holds: a
    /// module of several leaves, or a path that names no field of the block (a path written by hand).
    #[error("{model}: block {block} has no leaf at {path:?}: {problem}")]
    NoLeaf {
        /// The model's name.
        model: String,
        /// The block's part name (`blocks.3`, `down.0.blocks.1`), as the record's group ids show it.
        block: String,
        /// The field path inside the block (`attention.to_q`).
        path: String,
        /// What the path is instead, and what to write.
        problem: String,
    },

    /// A configuration value is out of range.
    #[error("invalid group offload configuration for {model}: {problem}")]
    InvalidConfig {
        /// The model's name.
        model: String,
        /// What is wrong and what to use instead.
        problem: String,
    },

    /// A group was asked to move while a guard on another thread still borrows it.
    #[error("group {group} is still borrowed by {users} guard(s); drop them before offloading the model")]
    InUse {
        /// The group's record id.
        group: String,
        /// How many guards hold it.
        users: usize,
    },

    /// Writing or reading a group's file in the disk store failed.
    #[error("disk store for group {group} at {path}: {message}; remove the file or pick another directory")]
    Disk {
        /// The group's record id.
        group: String,
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },

    /// A device of a kind this build has no backend for.
    #[error("{device} needs burn's {feature} backend, which this build does not include: {fix}")]
    DeviceNotBuilt {
        /// The device asked for.
        device: String,
        /// The cargo feature that brings its backend.
        feature: &'static str,
        /// What to do.
        fix: &'static str,
    },

    /// The runtime found no device to open: no driver, or none that works.
    #[error("cannot open {device}: {message}; {fix}")]
    NoDriver {
        /// The device asked for.
        device: String,
        /// The runtime's words.
        message: String,
        /// What to install or check.
        fix: String,
    },

    /// A device index the runtime does not have (`cuda:7` on a machine with one card): the driver is there.
    #[error(
        "cannot open {device}: {reason}; pick one of the devices `nvidia-smi -L` lists (cuda:0 is the first), or another --device"
    )]
    NoSuchDevice {
        /// The device asked for.
        device: String,
        /// How many devices the driver lists, or the driver's own words where it could not count them.
        reason: String,
    },

    /// The device's driver is there but one of its calls failed, in the driver's own words: not a missing driver.
    #[error(
        "the CUDA driver failed to {operation} {device}: it returned {code} ({words}); check that `nvidia-smi` lists \
         the card and the driver's messages (`dmesg`), or pick another --device"
    )]
    DriverFailed {
        /// The device.
        device: String,
        /// What was asked of the driver, as a verb phrase before the device (`open`, `read the free memory of`).
        operation: &'static str,
        /// The driver's error code, by name (`CUDA_ERROR_NOT_INITIALIZED`).
        code: String,
        /// The driver's own description of it, or that it gave none.
        words: String,
    },

    /// A device kind no backend serves.
    #[error("unknown device {kind}: use cpu, cuda:N (feature cuda) or wgpu:N (feature wgpu)")]
    UnknownDevice {
        /// The kind as written.
        kind: String,
    },

    /// Memory readings were asked of a backend without a memory pool.
    #[error(
        "{device} has no memory pool to read (burn's CPU backend keeps tensors in host memory); on the CPU, \
         simulate a card's readings instead (memory-sim's SimCard, `--card SIZE` in the CLI)"
    )]
    NoPoolReadings {
        /// The device.
        device: String,
    },

    /// Neither the driver, nor the runtime, nor the caller gave the device's total memory.
    #[error(
        "{device} reports no total memory (no driver memory call, and no device-local heap was read: {why}): give \
         the device's size (`--device-memory 8GB` in the CLI)"
    )]
    UnknownTotal {
        /// The device.
        device: String,
        /// Why the runtime's capacity was not read.
        why: String,
    },

    /// A route this model cannot take (group offload of a model that declares no blocks).
    #[error("cannot apply {route} to {component}: {reason}")]
    RouteUnsupported {
        /// The component.
        component: String,
        /// The route asked for.
        route: String,
        /// Why, and what the model can take instead.
        reason: String,
    },

    /// A quantization scheme the backend in use does not compute: quantizing with it would give wrong values
    /// (or none), so it is refused before any weight is touched.
    #[error(
        "cannot quantize {component} with {scheme} on {device}: {reason}; choose one of the schemes this backend \
         computes: {supported}"
    )]
    SchemeUnsupported {
        /// The component.
        component: String,
        /// The scheme asked for, as its name reads (`Q8S per tensor`).
        scheme: String,
        /// The device.
        device: String,
        /// What the backend does with it.
        reason: String,
        /// The schemes that work there, comma-separated.
        supported: String,
    },

    /// A plan routed a component `off`, which leaves it unmanaged, but a pipeline runs every component through
    /// its manager.
    #[error(
        "cannot apply preset {preset} to {component}: route `off` leaves it unmanaged, but the pipeline runs every \
         component through its manager; choose another preset, or place components yourself with \
         enable_auto_offload and enable_group_offload"
    )]
    Unmanaged {
        /// The component.
        component: String,
        /// The preset that routed it `off`.
        preset: String,
    },

    /// Offload was already set up in a way the call cannot undo.
    #[error("cannot {action} {component}: {reason}; load the model again and set offload up once")]
    AlreadyApplied {
        /// The component.
        component: String,
        /// What was asked.
        action: String,
        /// What was set up before.
        reason: String,
    },

    /// A model's forward does not stream as it runs resident ([`crate::model::check_streaming`]).
    #[error("{model} does not stream correctly at {level}: {problem}")]
    Streaming {
        /// The model's class.
        model: String,
        /// The level, or `resident` when the resident forward itself failed.
        level: String,
        /// What differed, and what to fix in the forward.
        problem: String,
    },

    /// The planner refused the settings, the components or the device, or a capacity profile could not be read or
    /// written.
    #[error(transparent)]
    Plan(#[from] offload_core::plan::PlanError),

    /// The manager refused a registration, removal or inspection.
    #[error(transparent)]
    Manager(#[from] offload_core::Error),

    /// The device is poisoned (a kernel faulted, the device was lost): every later operation on it fails, so this is
    /// never an out-of-memory and never retried.
    #[error(
        "{device} is poisoned during {operation}: {message}; nothing run on it can succeed any more, and offloading \
         would not help: restart the process (check the driver's logs for the fault)"
    )]
    DevicePoisoned {
        /// The device.
        device: String,
        /// What was running: `run`, `upload`, `onload`.
        operation: &'static str,
        /// The runtime's first lines.
        message: String,
    },

    /// A device's memory could not be read; nothing is known of it, so nothing was decided on it.
    #[error(transparent)]
    ReadingUnavailable(#[from] offload_core::device::ReadingUnavailable),

    /// A whole model registered on a device that computes elsewhere than the host (a GPU, a wgpu runtime) was run
    /// while it sat on the host and its device's manager had no auto offload: it would have run on the host's CPU,
    /// and the device never been used. Nothing ran and nothing moved.
    #[error(
        "{model} is registered on {device}, but it is on the host and {device}'s manager has no auto offload, so \
         it would run on the CPU: call enable_auto_offload(reserve) on the device (or the pipeline's) first"
    )]
    NotOnDevice {
        /// The model's id in its manager.
        model: String,
        /// The device it was registered on.
        device: String,
    },

    /// Timing copies from a peer device onto this one failed ([`OffloadDevice::time_copies_from`]): both compute on
    /// the same burn device, or the probe's allocation, a copy or its read-back failed. Nothing of the probe stays
    /// allocated on either device.
    ///
    /// [`OffloadDevice::time_copies_from`]: crate::OffloadDevice::time_copies_from
    #[error(
        "cannot time copies from {peer} onto {device}: {problem}; declare the link's rate instead (PeerDonor's \
         bytes_per_second, --donor DEVICE@LINK) or free memory on both devices and try again"
    )]
    PeerCopy {
        /// The device copied from.
        peer: String,
        /// The device copied onto.
        device: String,
        /// What went wrong.
        problem: String,
    },

    /// The prefetch worker thread is gone (it panicked); the offloader cannot be used any more.
    #[error("the prefetch worker of {model} stopped; build a new offloader")]
    WorkerGone {
        /// The model's name.
        model: String,
    },

    /// A task on a device's upload thread panicked for a reason other than the device (a bug in a ledger, in a host
    /// read, in the task itself). The thread caught it and goes on serving every other model on the device; the
    /// upload's reservation on the ledger was given back and its host copy is intact.
    #[error(
        "{what} for {device} panicked: {message}; nothing of it stays reserved on the device and the host copy is \
         intact, so running again is safe, but this is a bug outside the device: report it with this message"
    )]
    UploadPanicked {
        /// What panicked: `the prefetch of group unet/blocks_0_0`, `a task on the upload thread`.
        what: String,
        /// The execution device.
        device: String,
        /// The panic's message.
        message: String,
    },

    /// A device's upload thread could not take a task: it could not be started, or it ended.
    #[error("the upload thread of {device} cannot take {what}: {problem}; restart the process")]
    UploadThread {
        /// What it was given: `the upload of group unet/blocks_0_0`, `a task on the upload thread`.
        what: String,
        /// The execution device.
        device: String,
        /// What went wrong.
        problem: String,
    },

    /// A checkpoint file the file tier cannot use: it does not open, its header is damaged or past safetensors'
    /// limit, it is shorter than its header says, or two of its tensors reach one name.
    #[error("cannot use the checkpoint file {path}: {problem}; {fix}")]
    WeightFile {
        /// The file.
        path: String,
        /// What is wrong with it.
        problem: String,
        /// What to do.
        fix: String,
    },

    /// A file tensor's shape is not the shape of the model's parameter of the same name.
    #[error(
        "cannot bind {tensor} from {file}: it has shape {found:?}, the model's parameter {expected:?}; the checkpoint \
         does not match the model's config"
    )]
    WeightShape {
        /// The parameter's path.
        tensor: String,
        /// The file that holds the tensor.
        file: String,
        /// The parameter's shape.
        expected: Vec<usize>,
        /// The tensor's shape in the file.
        found: Vec<usize>,
    },

    /// A file tensor's dtype is not one the model's parameter of the same name holds (an integer tensor for a
    /// float parameter, a dtype burn does not read).
    #[error(
        "cannot bind {tensor} from {file}: it is stored as {found}, which a {expected} parameter cannot hold; the \
         checkpoint does not match the model"
    )]
    WeightDType {
        /// The parameter's path.
        tensor: String,
        /// The file that holds the tensor.
        file: String,
        /// The kind of parameter: `float`, `int`, `bool`.
        expected: String,
        /// The dtype the file stores, as safetensors names it (`I32`).
        found: String,
    },

    /// A binding left parameters without a file tensor or file tensors without a parameter.
    #[error(
        "binding to the checkpoint left {} parameter(s) missing (first: {}) and {} file tensor(s) unused (first: {}); \
         the checkpoint does not match the model, or it needs key renames: allow a partial binding only if that is \
         intended",
        missing.len(),
        missing.first().map_or("none", String::as_str),
        unused.len(),
        unused.first().map_or("none", String::as_str)
    )]
    PartialBind {
        /// Parameters no file holds, sorted.
        missing: Vec<String>,
        /// File tensors no parameter took, sorted.
        unused: Vec<String>,
    },

    /// A tensor could not be read from its checkpoint file (the file tier): the file was truncated or replaced
    /// after it was opened, or the disk failed. Nothing was uploaded for it.
    #[error(
        "cannot read {tensor} from {file} ({} at offset {offset}): {message}; the checkpoint file changed or was \
         truncated after it was opened: restore it (re-download it) and load the model again",
        format_size(*bytes)
    )]
    FileRead {
        /// The tensor's name in the file.
        tensor: String,
        /// The file.
        file: String,
        /// Where its bytes start.
        offset: u64,
        /// Its bytes.
        bytes: u64,
        /// What the read reported.
        message: String,
    },

    /// A tensor transform (quantization, say) failed on a tensor read from its checkpoint file.
    #[error("the tensor transform failed on {tensor}: {message}; leave this tensor out of the transform")]
    Transform {
        /// The parameter's path.
        tensor: String,
        /// What the transform reported.
        message: String,
    },
}

impl Error {
    /// Whether this is an out-of-memory failure of an upload, the one a caller can recover from by freeing memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::Onload { source, .. } if source.is_out_of_memory())
    }
}

impl From<Error> for ComponentError {
    /// Keeps out-of-memory failures recognisable by the manager's OOM retry; wraps everything else.
    fn from(error: Error) -> Self {
        match error {
            Error::Onload { source: ComponentError::OutOfMemory { device, requested, available }, .. } => {
                ComponentError::OutOfMemory { device, requested, available }
            }
            Error::Onload { source: ComponentError::Device { device, message }, .. } => {
                ComponentError::Device { device, message }
            }
            other => ComponentError::other(other),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What [`panic_text`] gives for a panic whose payload is neither a `String` nor a `&str`
/// (`std::panic::panic_any` with another type): an error message then still says what happened.
pub const NON_TEXT_PANIC: &str = "a panic whose payload is not text (std::panic::panic_any)";

/// A panic's message: its payload's text when it is a `String` or a `&str` (what `panic!` and `unwrap` give),
/// [`NON_TEXT_PANIC`] otherwise.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_else(|| NON_TEXT_PANIC.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic's text is its message, and a payload that is not text still gives a message that says so, never
    /// an empty one in an error.
    #[test]
    fn a_panic_text_is_its_message_or_says_it_was_not_text() {
        let text = |payload: Box<dyn std::any::Any + Send>| panic_text(payload.as_ref());
        assert_eq!(text(Box::new("a &str")), "a &str");
        assert_eq!(text(Box::new(String::from("a String"))), "a String");
        assert_eq!(text(Box::new(42u32)), NON_TEXT_PANIC);
    }
}
