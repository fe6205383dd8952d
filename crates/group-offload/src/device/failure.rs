//! Failure classification: a runtime's words or panic turned into a typed error (out-of-memory, poisoned,
//! unallocated, anything else), read by their first line only.

use std::panic::AssertUnwindSafe;

use offload_core::{ComponentError, DeviceMemory, DeviceName};

use crate::error::Error;
#[cfg(feature = "wgpu")]
use std::sync::atomic::{AtomicU64, Ordering};

/// A device failure caught as a panic, before it knows which device and operation it belongs to.
#[derive(Debug)]
pub struct DevicePanic {
    message: String,
}

impl DevicePanic {
    /// The panic's message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The typed error for `operation` on `name`.
    pub fn with_device(
        self,
        name: &DeviceName,
        operation: &'static str,
        memory: Option<&dyn DeviceMemory>,
    ) -> ComponentError {
        classify(name, operation, &self.message, false, memory)
    }
}

impl std::fmt::Display for DevicePanic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the device runtime panicked: {}", self.message)
    }
}

pub use crate::error::panic_text;

/// Runs `f`, catching a panic of the device runtime as a [`DevicePanic`]: a read of a tensor whose computation
/// failed on the device (burn's `into_data` panics with the runtime's error), or a runtime that panics on a failed
/// allocation. Any other panic (a bug, not a device failure) goes on unwinding. The one boundary where a panic is
/// turned into an error: the library uses it around its own device operations (an upload, an onload, a sync, a
/// read-back), never around a caller's code such as a model's forward, whose panic is its own.
pub fn catch_device_panic<R>(f: impl FnOnce() -> R) -> std::result::Result<R, DevicePanic> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let message = panic_text(payload.as_ref());
        if !is_device_failure(&message) {
            std::panic::resume_unwind(payload);
        }
        DevicePanic { message }
    })
}

/// Whether a panic's message is the device runtime's: burn's read of a tensor whose computation failed (its
/// `into_data` panics with [`BURN_READ_PANIC`] and the runtime's error), a runtime error's own text, or the panic
/// cubecl-wgpu raises for wgpu's out-of-memory ([`WGPU_OUT_OF_MEMORY`]), each recognised by its first line
/// ([`RuntimeFailure::of`]).
pub(super) fn is_device_failure(message: &str) -> bool {
    let text = message.strip_prefix(BURN_READ_PANIC).unwrap_or(message);
    let first = text.lines().next().unwrap_or("").trim();
    RUNTIME_WRAPPERS.iter().any(|wrapper| wrapper.matches(first))
        || is_poisoned_line(first)
        || RuntimeFailure::of(text) != RuntimeFailure::Other
}

/// The words burn's `Tensor::into_data` panics with before the runtime's error (`burn-tensor` 0.22.1,
/// `tensor/api/base.rs`: `expect` adds `": "` and the error).
pub const BURN_READ_PANIC: &str =
    "Error while reading data: use `try_into_data` instead to catch the error at runtime: ";

/// The panic cubecl-wgpu 0.11.3 raises for wgpu's out-of-memory on the default (WGSL) build, whole.
///
/// Without its `spirv` feature, cubecl-wgpu's storage creates buffers through `wgpu::Device::create_buffer`
/// (`compute/storage.rs`), which returns no error: wgpu reports a failed allocation to the device's
/// uncaptured-error handler, and the one cubecl installs (`compute/device_poison.rs`, `PoisonWatch::watch`) panics
/// with `"wgpu error: {error}"` on a device that is not lost, where wgpu 30's `Error::OutOfMemory` displays as
/// `Out of Memory` (`api/device.rs`). The panic happens on cubecl's device runner thread. For a task the caller
/// waits for (a read, a sync, a cleanup) cubecl's channel catches it and raises the same payload again in the
/// caller (`cubecl-common` 0.11.3, `device/handle/channel.rs`, `run_scoped`, then `unwrap_or_resume`), so the
/// caller sees exactly this line; [`catch_device_panic`] catches it around the library's own device operations.
/// For a task nobody waits for (a buffer's creation, a launch) the channel only logs the panic, and the memory that
/// task was for is never written: a later read fails with cubecl's words for that, which do not say why, and is a
/// device error, not an out-of-memory (`docs/devices.md`).
pub const WGPU_OUT_OF_MEMORY: &str = "wgpu error: Out of Memory";

/// A first line of the runtime's that wraps another error, whose own text follows a `Caused by:` line.
pub(super) enum Wrapper {
    /// The whole line.
    Line(&'static str),
    /// A line that begins so (its counts vary).
    Prefix(&'static str),
}

impl Wrapper {
    pub(super) fn matches(&self, line: &str) -> bool {
        match self {
            Wrapper::Line(whole) => line == *whole,
            Wrapper::Prefix(start) => line.starts_with(start),
        }
    }
}

/// The runtime's wrappers, in their exact words: burn's `ExecutionError` (`burn-std` 0.22.1,
/// `device_settings.rs`) and cubecl's `ServerError` and `LaunchError` (`cubecl-runtime` 0.11.3, `server/base.rs`).
/// A compilation error is followed too, because the error it carries can be a poisoned device
/// (`CompilationError::DevicePoisoned`); any other compiler error is `Other` by its own first line.
pub(super) const RUNTIME_WRAPPERS: [Wrapper; 5] = [
    Wrapper::Line("An error happened during execution"),
    Wrapper::Line("An IO error happened"),
    Wrapper::Line("A launch error happened"),
    Wrapper::Line("A compilation error happened during launch"),
    Wrapper::Prefix("The bytes were never written (failure #"),
];

/// cubecl's and burn's first lines for a poisoned device, whole: `ServerError::DevicePoisoned`,
/// `LaunchError::DevicePoisoned`, burn's `ExecutionError::DevicePoisoned`, and `CompilationError::DevicePoisoned`
/// (`cubecl-runtime` 0.11.3, `compiler.rs`: the device was poisoned before a compiled kernel could be loaded).
pub(super) const POISONED: [&str; 3] = [
    "The device is poisoned",
    "The device was poisoned during launch",
    "The device is poisoned, the kernel could not be loaded",
];

/// How `IoError::DevicePoisoned` begins (`"The device is poisoned: {0}"`, `cubecl-runtime` 0.11.3,
/// `server/base.rs`): the driver's reason follows on the same line.
pub(super) const POISONED_IO: &str = "The device is poisoned: ";

/// Whether a first line is one of the runtime's own for a poisoned device.
pub(super) fn is_poisoned_line(line: &str) -> bool {
    POISONED.contains(&line) || line.starts_with(POISONED_IO)
}

/// What a runtime's error says went wrong, read from the runtime's own first lines, never searched for in the
/// whole text (a cause chain or a backtrace can say anything).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeFailure {
    /// The runtime's own out-of-memory, in its exact words: cubecl's `IoError::OutOfMemory` ("out of device memory
    /// allocating N bytes", what its CUDA storage reports for `CUDA_ERROR_OUT_OF_MEMORY` and its SPIR-V Vulkan
    /// storage, the `vulkan` feature, for `VK_ERROR_OUT_OF_DEVICE_MEMORY` / `VK_ERROR_OUT_OF_HOST_MEMORY`),
    /// `IoError::PageSizesExhausted` ("Can't allocate N bytes: every page size the memory tracks still holds live
    /// allocations", which cubecl documents as one a cleanup and a retry can resolve), `LaunchError::OutOfMemory`
    /// ("An out-of-memory error happened during launch"), and the panic the default wgpu build raises for wgpu's
    /// out-of-memory ([`WGPU_OUT_OF_MEMORY`]). The bytes asked for, where the runtime says.
    OutOfMemory {
        /// The allocation's size, when the runtime names it.
        requested: Option<u64>,
    },
    /// The device is poisoned (a faulted kernel, a lost device): every later operation fails, and only a new
    /// process can use it again. Never retried.
    Poisoned,
    /// The memory a read needed was never allocated: cubecl's `IoError::NotFound` with the reason "Memory location
    /// was never initialized" (`cubecl-server` 0.11.3, `memory_management/memory_manage.rs`), which a read meets when
    /// the runner task that was to allocate the memory panicked instead of recording a failure. The text does not
    /// say why. On the default wgpu build that panic is wgpu's out-of-memory ([`WGPU_OUT_OF_MEMORY`]; measured on
    /// lavapipe under an address-space limit, `docs/devices.md`), which the runner thread's panic records; the
    /// typed error decides with that record (`classify`), never from these words alone.
    Unallocated,
    /// Anything else (a buffer larger than the device can ever give, a compilation error, a failure of several
    /// kinds at once): a device error, never an out-of-memory.
    Other,
}

impl RuntimeFailure {
    /// Classifies a runtime's error text: the wrappers above are followed through their `Caused by:` line to the
    /// error they carry, and the first line of that error alone decides.
    pub fn of(text: &str) -> RuntimeFailure {
        let mut rest = text.strip_prefix(BURN_READ_PANIC).unwrap_or(text);
        loop {
            let first = rest.lines().next().unwrap_or("").trim();
            if is_poisoned_line(first) {
                return RuntimeFailure::Poisoned;
            }
            if first == SEVERAL {
                // Failures of several kinds are none of them, unless the first is memory never allocated: the one
                // failure a wgpu out-of-memory leaves, which cubecl reported so with only itself listed (measured).
                return match Self::of(caused_by(rest).unwrap_or("")) {
                    RuntimeFailure::Unallocated => RuntimeFailure::Unallocated,
                    _ => RuntimeFailure::Other,
                };
            }
            if RUNTIME_WRAPPERS.iter().any(|wrapper| wrapper.matches(first)) {
                // The wrapped error is the line after the first `Caused by:` line.
                match caused_by(rest) {
                    Some(wrapped) => rest = wrapped,
                    None => return RuntimeFailure::Other,
                }
                continue;
            }
            return Self::of_line(first);
        }
    }

    /// The runtime's own out-of-memory lines, whole, and its line for memory never allocated.
    pub(super) fn of_line(line: &str) -> RuntimeFailure {
        if line == "An out-of-memory error happened during launch" || line == WGPU_OUT_OF_MEMORY {
            return RuntimeFailure::OutOfMemory { requested: None };
        }
        if line == NEVER_INITIALIZED {
            return RuntimeFailure::Unallocated;
        }
        let out_of_memory =
            line.strip_prefix("out of device memory allocating ").and_then(|rest| rest.strip_suffix(" bytes"));
        let no_page_size = line.strip_prefix("Can't allocate ").and_then(|rest| {
            rest.strip_suffix(" bytes: every page size the memory tracks still holds live allocations")
        });
        match out_of_memory.or(no_page_size).map(str::parse::<u64>) {
            Some(Ok(bytes)) => RuntimeFailure::OutOfMemory { requested: Some(bytes) },
            _ => RuntimeFailure::Other,
        }
    }
}

/// cubecl's `ServerError::Several` (`cubecl-runtime` 0.11.3, `server/base.rs`): the failures follow its `Caused by:`.
pub(super) const SEVERAL: &str = "Several failures at once";

/// cubecl's `IoError::NotFound` for memory whose allocation never happened (`cubecl-runtime` 0.11.3: `"couldn't find
/// resource for that handle: {reason}"`; `cubecl-server` 0.11.3, `memory_management/memory_manage.rs`: the reason).
pub(super) const NEVER_INITIALIZED: &str =
    "couldn't find resource for that handle: Memory location was never initialized";

/// The text after the first `Caused by:` line of `text`, if it has one.
pub(super) fn caused_by(text: &str) -> Option<&str> {
    let mut consumed = 0;
    for line in text.split_inclusive('\n') {
        consumed += line.len();
        if line.trim() == "Caused by:" {
            return Some(&text[consumed..]);
        }
    }
    None
}

/// What the panic hook the wgpu runtime installs counts: the out-of-memory panics cubecl's runner threads raised
/// ([`WGPU_OUT_OF_MEMORY`]), and how many of them a failed read has been typed by. A read that meets memory never
/// allocated ([`RuntimeFailure::Unallocated`]) is an out-of-memory when a panic is left unclaimed, and claims it.
#[cfg(feature = "wgpu")]
pub(super) struct WgpuOutOfMemory {
    pub(super) raised: AtomicU64,
    pub(super) claimed: AtomicU64,
}

/// The wgpu runtime is one per process (its runner threads are cubecl's), so its panic record is too.
#[cfg(feature = "wgpu")]
pub(super) static WGPU_OUT_OF_MEMORY_PANICS: WgpuOutOfMemory =
    WgpuOutOfMemory { raised: AtomicU64::new(0), claimed: AtomicU64::new(0) };

/// Installs, on top of the process's panic hook (which still runs, so the runtime's panic is still printed), a hook
/// that counts cubecl-wgpu's out-of-memory panics: they happen on cubecl's runner thread, where nothing of this
/// library runs, and a task nobody waits for swallows them, so this record is the only trace of why an allocation
/// never happened. Called once, when the wgpu runtime opens.
#[cfg(feature = "wgpu")]
pub(super) fn record_wgpu_out_of_memory_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if panic_text(info.payload()) == WGPU_OUT_OF_MEMORY {
            WGPU_OUT_OF_MEMORY_PANICS.raised.fetch_add(1, Ordering::SeqCst);
        }
        previous(info);
    }));
}

/// Whether a wgpu out-of-memory panic is recorded that no failed read has been typed by yet; claims every one
/// recorded so far (a failure read twice, by a sync and a read-back, is one out-of-memory).
pub(super) fn claim_wgpu_out_of_memory() -> bool {
    #[cfg(feature = "wgpu")]
    {
        let raised = WGPU_OUT_OF_MEMORY_PANICS.raised.load(Ordering::SeqCst);
        WGPU_OUT_OF_MEMORY_PANICS.claimed.fetch_max(raised, Ordering::SeqCst) < raised
    }
    #[cfg(not(feature = "wgpu"))]
    false
}

/// Whether a runtime's error text is the runtime's own out-of-memory, and the bytes it asked for when it says;
/// see [`RuntimeFailure::of`].
pub fn out_of_memory_in(message: &str) -> Option<Option<u64>> {
    match RuntimeFailure::of(message) {
        RuntimeFailure::OutOfMemory { requested } => Some(requested),
        _ => None,
    }
}

/// The typed error of a device failure: an out-of-memory the manager can retry, a poisoned device it must not,
/// or a device error.
pub(super) fn classify(
    name: &DeviceName,
    operation: &'static str,
    message: &str,
    poisoned: bool,
    memory: Option<&dyn DeviceMemory>,
) -> ComponentError {
    // The runtime's text carries a backtrace after its first lines; the first lines are the message.
    let short: String = message.lines().take(3).collect::<Vec<_>>().join(" ");
    let failure = match RuntimeFailure::of(message) {
        _ if poisoned => RuntimeFailure::Poisoned,
        // Memory never allocated is an out-of-memory only where the runtime's runner recorded one (wgpu).
        RuntimeFailure::Unallocated if claim_wgpu_out_of_memory() => RuntimeFailure::OutOfMemory { requested: None },
        failure => failure,
    };
    match failure {
        RuntimeFailure::OutOfMemory { requested } => ComponentError::OutOfMemory {
            device: name.clone(),
            requested: requested.unwrap_or(0),
            available: memory.map_or(0, |m| m.available()),
        },
        RuntimeFailure::Poisoned => {
            ComponentError::other(Error::DevicePoisoned { device: name.to_string(), operation, message: short })
        }
        RuntimeFailure::Other | RuntimeFailure::Unallocated => {
            ComponentError::Device { device: name.clone(), message: format!("during {operation}: {short}") }
        }
    }
}
