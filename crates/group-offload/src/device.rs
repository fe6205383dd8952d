//! Real devices: opening a burn device by name, its memory readings from burn's pool (and the driver's where it
//! has a call), a smaller card imposed over those readings, and the one boundary where a device's failures
//! become typed errors.
//!
//! # Readings
//!
//! [`PoolReadings`] is the [`DeviceMemory`] of a cubecl device (CUDA, wgpu). burn exposes what its memory pool
//! holds ([`Device::memory_pool_usage`]: bytes in use, padding, reserved pages) but no free-memory call, so:
//!
//! - `allocated` is the pool's bytes in use;
//! - `total` is the driver's (CUDA: `cuDeviceTotalMem` through `cuMemGetInfo`), or the size the caller gives
//!   for a runtime that reports none (wgpu);
//! - `available` is what diffusers computes: the driver's free memory plus the pool's reusable cache
//!   (reserved − in use − padding), or `total − in use − padding` where there is no driver call;
//! - `peak` is the highest in-use reading seen since the last [`reset_peak`](PoolReadings::reset_peak): the pool
//!   keeps no high-water of its own, so a sampler thread reads it every [`PoolReadings::SAMPLE_EVERY`], and every
//!   reading and [`observe`](PoolReadings::observe) counts too. A sampled peak can miss a spike shorter than
//!   the interval; it never reports more than the pool held.
//!
//! # A smaller card over a real device
//!
//! [`CappedDevice`] is what `--card SIZE` means on a real device, as diffusers' `simulate_accelerator_memory`
//! does on a real GPU: its readings are the real ones capped at the size, with everything on the device that
//! is not the pool's reusable cache counted against the cap (the context and other processes where the driver
//! shows them, the pool's padding). In hard mode it caps what the pool may take from the device, as torch's
//! per-process memory fraction caps its caching allocator's reserved memory: an allocation the cap cannot hold
//! (a component's onload, a group's upload) is refused as an out-of-memory before it is made, a call whose
//! activation estimate it cannot hold is refused before it runs ([`DeviceLedger::begin_call`]), and a call during
//! which the pool's pages passed the cap fails as an out-of-memory once it has run ([`DeviceLedger::end_call`]):
//! the device had the memory, a card of the cap's size would not have. Pages are what a card gives cubecl's
//! pool: it asks the driver for a page when its pages cannot hold an allocation, and fails there when the card
//! has none left; it neither defragments nor retries. Before each call the pool's cache is released when its
//! pages hold the device past the cap, as torch releases its cache before it raises. Pages are sized to the
//! largest allocation so far (2 MiB and more), so on a tiny workload they are mostly cache: the tiny pipeline's
//! 4.0 MB of weights sat in 10.8 MB of pages on lavapipe. Pages are also steadier than bytes in use: an
//! allocation takes a page and keeps it until the pool's cache is released, so a spike of activations leaves its
//! pages behind where a sampled in-use reading would miss it. The pages are not monotone during a call, though: a
//! reservation that finds too little room releases the pool's cache (`memory_cleanup`) in the middle of another
//! thread's call (and a whole onload or offload releases it too). So a call's page high-water is the highest of
//! the readings taken over the call (the sampler's and every other), which can miss a peak that came and went
//! between two readings: a lower bound, exact only where the pages did not shrink in between.
//!
//! The hard cap keeps one account of what the library reserved (placements and the estimates of calls in flight,
//! in the [`PageRule`]'s pages), behind one mutex that is held from the reading to the reservation: the main thread
//! and a prefetch worker can never both pass on the same free bytes. A check charges the pool's pages plus the
//! reservations the pool does not show yet, never less than the reservations (the rule and how "not yet" is read
//! are on the account's type, `Account`).

//! # Failures
//!
//! cubecl does not fail the allocating call: a failed allocation is carried by the memory it was for, every
//! kernel that needs that memory is skipped and passes the failure on to its outputs, and the failure surfaces
//! when a result is read (measured on wgpu/lavapipe: `Device::sync` returned `Ok` after a failed 64 GiB
//! allocation; reading the result returned the error). So a move or a call is checked by reading back one value
//! of each of its outputs ([`DeviceOutput`], [`check_outputs`]) after a sync ([`check_device`]): a failure of
//! anything the outputs depend on surfaces there, typed, instead of later at `into_data`. cubecl's
//! out-of-memory (`IoError::OutOfMemory`, `IoError::PageSizesExhausted`, `LaunchError::OutOfMemory`, which burn
//! passes on as text, and the default wgpu build's panic [`WGPU_OUT_OF_MEMORY`]) becomes
//! [`ComponentError::OutOfMemory`] with the bytes asked for and the bytes available. The runtime's words are
//! read by their first line only ([`RuntimeFailure::of`]), never searched for in the cause chain or the
//! backtrace. A poisoned device is [`Error::DevicePoisoned`] (as [`ComponentError::Other`]), never retried;
//! memory never allocated ([`RuntimeFailure::Unallocated`]) is an out-of-memory only where the wgpu runtime's
//! runner recorded one; anything else (a buffer larger than the device can ever give) is
//! [`ComponentError::Device`], never labelled out-of-memory. [`catch_device_panic`] catches a runtime that panics
//! instead of returning an error, around the library's own device operations only: a model's forward is never
//! caught.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::ThreadId;
use std::time::Duration;

use burn::tensor::{DType, Device, Tensor};
pub use offload_core::device::ReadingUnavailable;
use offload_core::offload_strategy::MemoryReading;
use offload_core::plan::CallPages;
use offload_core::{ComponentError, DeviceLedger, DeviceMemory, DeviceName, format_size};
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Opens the burn device `name` names: `cpu` is burn's `flex` CPU backend, `cuda:N` a CUDA device (feature
/// `cuda`), `wgpu:0` (or `vulkan:0`) the default adapter of burn's wgpu backend (feature `wgpu`; on a CPU-only
/// Linux machine that is Mesa's lavapipe Vulkan driver).
///
/// Fails with [`Error::DeviceNotBuilt`] for a kind this build has no backend for, [`Error::NoDriver`] when the
/// runtime finds no device (no Vulkan driver installed, say), and [`Error::UnknownDevice`] for any other kind.
pub fn open_device(name: &DeviceName) -> Result<Device> {
    open_device_with(name, PagePolicy::Adaptive)
}

/// How a runtime's memory pool takes pages from the device, where the runtime lets it be chosen (wgpu; CUDA
/// keeps its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PagePolicy {
    /// cubecl's default: small allocations share pages, larger ones are carved from pages sized to the largest
    /// allocation so far (fast; on a small workload the pages are mostly cache).
    #[default]
    Adaptive,
    /// One page per allocation, sized to it (measured on lavapipe: reserved within 12 KB of the bytes in use), so
    /// the pool's pages follow what a workload allocates: what a cap on the pages ([`CappedDevice`]) wants.
    Exclusive,
}

/// [`open_device`] with a page policy for the runtime's pool. A runtime is set up once per process: the first
/// open of a wgpu device chooses its policy, later opens share it ([`describe_device`] says which).
pub fn open_device_with(name: &DeviceName, pages: PagePolicy) -> Result<Device> {
    match name.kind() {
        "cpu" => Ok(Device::flex()),
        "cuda" => open_cuda(name),
        "wgpu" | "vulkan" => open_wgpu(name, pages),
        other => Err(Error::UnknownDevice { kind: other.to_string() }),
    }
}

/// The index of an indexed device name (`1` for `cuda:1`), 0 for the host.
pub fn device_index(name: &DeviceName) -> u32 {
    name.as_str().split(':').nth(1).and_then(|index| index.parse().ok()).unwrap_or(0)
}

/// The words cudarc panics with when it cannot load NVIDIA's driver library (`cudarc` 0.19, `lib.rs`,
/// `panic_no_lib_found`).
#[cfg(feature = "cuda")]
const CUDA_NO_LIBRARY: &str = "Unable to dynamically load the \"cuda\" shared library";

/// Opens a CUDA context on device `index` through cudarc, as burn's runtime will: a machine without NVIDIA's
/// driver library makes cudarc panic while it loads `libcuda` (there is no safe call that asks first), so that
/// one panic, recognised by cudarc's own words, becomes [`Error::NoDriver`] naming the driver; any other panic
/// goes on unwinding. A driver that loads but fails is named as it is ([`cuda_failure`]): a wrong index is
/// [`Error::NoSuchDevice`] with the number of devices there are, anything else [`Error::DriverFailed`] with the
/// driver's words.
#[cfg(feature = "cuda")]
fn cuda_context(name: &DeviceName) -> Result<Arc<cudarc::driver::CudaContext>> {
    let no_driver = |message: String| Error::NoDriver {
        device: name.to_string(),
        message,
        fix: "install NVIDIA's driver (it provides libcuda.so.1; on Debian the `nvidia-driver` package, or the \
              driver from nvidia.com), check that `nvidia-smi` lists the card and that LD_LIBRARY_PATH reaches \
              libcuda, or pick another --device (cpu, wgpu)"
            .into(),
    };
    let index = device_index(name) as usize;
    // The default hook would print cudarc's panic and a backtrace above the typed error (seen with the CUDA
    // release build of gpu_check on a machine without the driver): silence it for this one call.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let opened = std::panic::catch_unwind(|| cudarc::driver::CudaContext::new(index));
    std::panic::set_hook(hook);
    let opened = opened.map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_default();
        if !message.starts_with(CUDA_NO_LIBRARY) {
            std::panic::resume_unwind(payload);
        }
        no_driver(message)
    })?;
    opened.map_err(|error| {
        let (code, words) = driver_words(&error);
        cuda_failure(name, "open", &code, words.as_deref(), || {
            cudarc::driver::CudaContext::device_count().map(|count| count.max(0) as u32).map_err(|error| {
                let (code, words) = driver_words(&error);
                format!("{code} ({})", words.as_deref().unwrap_or(NO_WORDS))
            })
        })
    })
}

/// A CUDA driver error's code by name (`CUDA_ERROR_INVALID_DEVICE`, cudarc's `CUresult` as it prints) and the
/// driver's own words for it (`cuGetErrorString`), where the driver gives them. Only called with an error the
/// driver returned, so its library is loaded and asking it for the words cannot panic.
#[cfg(feature = "cuda")]
fn driver_words(error: &cudarc::driver::DriverError) -> (String, Option<String>) {
    let words = error.error_string().ok().map(|words| words.to_string_lossy().into_owned());
    (format!("{:?}", error.0), words)
}

/// What [`Error::DriverFailed`] says where the driver gave no words for its code.
const NO_WORDS: &str = "the driver gave no description";

/// The typed error of a CUDA driver call on `name` (`operation`: what was asked) that returned `code` (its name, as
/// cudarc prints a `CUresult`) with the driver's `words` for it. A wrong index (`CUDA_ERROR_INVALID_DEVICE`) and a
/// driver that sees no device (`CUDA_ERROR_NO_DEVICE`) are [`Error::NoSuchDevice`], saying how many devices there
/// are (`count`, asked only then: the driver's count, or its own words where it could not count); anything else is
/// [`Error::DriverFailed`] with the code and the words. Never [`Error::NoDriver`]: the driver answered.
pub fn cuda_failure(
    name: &DeviceName,
    operation: &'static str,
    code: &str,
    words: Option<&str>,
    count: impl FnOnce() -> std::result::Result<u32, String>,
) -> Error {
    let said = |code: &str| match words {
        Some(words) => format!("{code}: {words}"),
        None => code.to_string(),
    };
    match code {
        "CUDA_ERROR_INVALID_DEVICE" => {
            let reason = match count() {
                Ok(0) => format!("the driver lists no CUDA device ({})", said(code)),
                Ok(1) => format!("there is no such CUDA device: the driver lists 1, cuda:0 ({})", said(code)),
                Ok(n) => format!(
                    "there is no such CUDA device: the driver lists {n}, cuda:0 to cuda:{} ({})",
                    n - 1,
                    said(code)
                ),
                Err(why) => {
                    format!("the driver says {}, and could not count its devices ({why})", said(code))
                }
            };
            Error::NoSuchDevice { device: name.to_string(), reason }
        }
        "CUDA_ERROR_NO_DEVICE" => Error::NoSuchDevice {
            device: name.to_string(),
            reason: format!("the driver sees no CUDA device ({}; CUDA_VISIBLE_DEVICES can hide them)", said(code)),
        },
        _ => Error::DriverFailed {
            device: name.to_string(),
            operation,
            code: code.to_string(),
            words: words.unwrap_or(NO_WORDS).to_string(),
        },
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(name: &DeviceName) -> Result<Device> {
    // burn's CUDA runtime panics on first use when there is no driver; ask the driver first, so a machine
    // without one gets a typed error.
    cuda_context(name)?;
    Ok(Device::cuda(device_index(name)))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(name: &DeviceName) -> Result<Device> {
    Err(Error::DeviceNotBuilt {
        device: name.to_string(),
        feature: "cuda",
        fix: "run `cargo xtask setup-cuda`, then build with `--features cuda`",
    })
}

/// The wgpu runtime of this process: the device, the adapter in words, its pool's page policy, the adapter's
/// largest device-local Vulkan heap and that heap's budget when the runtime opened (each, or why it was not read).
#[cfg(feature = "wgpu")]
struct WgpuRuntime {
    device: Device,
    adapter: String,
    pages: PagePolicy,
    heap: std::result::Result<u64, String>,
    budget: std::result::Result<u64, String>,
}

/// The page policy `device`'s pool was opened with, where this library opened it and the runtime lets it be
/// chosen (the wgpu device); `None` otherwise (CUDA keeps its default, which shares pages).
pub fn page_policy(device: &Device) -> Option<PagePolicy> {
    #[cfg(feature = "wgpu")]
    if let Some(Ok(runtime)) = WGPU.get()
        && runtime.device == *device
    {
        return Some(runtime.pages);
    }
    let _ = device;
    None
}

/// The wgpu runtime can be initialised once per process; every later open shares the first answer.
#[cfg(feature = "wgpu")]
static WGPU: std::sync::OnceLock<std::result::Result<WgpuRuntime, String>> = std::sync::OnceLock::new();

#[cfg(feature = "wgpu")]
fn wgpu_runtime(pages: PagePolicy) -> &'static std::result::Result<WgpuRuntime, String> {
    use burn::tensor::wgpu::MemoryConfiguration;
    WGPU.get_or_init(|| {
        let memory = match pages {
            PagePolicy::Adaptive => MemoryConfiguration::default(),
            PagePolicy::Exclusive => MemoryConfiguration::ExclusivePages,
        };
        let (device, setup) =
            Device::wgpu_options().memory_config(memory).init_with_setup().map_err(|error| format!("{error}"))?;
        let info = setup.adapter.get_info();
        let adapter = format!(
            "{} on {:?} (driver {} {}), {pages:?} pages",
            info.name, info.backend, info.driver, info.driver_info
        );
        let (heap, budget) = match info.backend {
            burn::tensor::wgpu::wgpu::Backend::Vulkan => (vulkan_heap(&info), vulkan_budget(&info)),
            other => {
                let why = format!("the adapter runs on {other:?}, not Vulkan, whose heaps are the ones read");
                (Err(why.clone()), Err(why))
            }
        };
        record_wgpu_out_of_memory_panics();
        // A device that cannot run one small kernel is no device: probe it here, where the error is typed.
        catch_device_panic(|| {
            let x = Tensor::<1>::ones([4], &device);
            (x * 2.0).sum().try_into_data().map(|_| ()).map_err(|error| error.to_string())
        })
        .map_err(|panic| panic.to_string())??;
        Ok(WgpuRuntime { device, adapter, pages, heap, budget })
    })
}

/// The largest device-local memory heap of the Vulkan physical device wgpu chose (the one with the adapter's
/// vendor and device ids, and its name where several share them), read through vulkano on an instance of its own.
/// Where the driver lists a small host-visible window ahead of the real heap, the largest is the device's memory;
/// on an integrated adapter or lavapipe it is the share of system memory the driver gives the device.
#[cfg(feature = "wgpu")]
fn vulkan_heap(adapter: &burn::tensor::wgpu::wgpu::AdapterInfo) -> std::result::Result<u64, String> {
    use vulkano::instance::{Instance, InstanceCreateFlags, InstanceCreateInfo};
    use vulkano::memory::MemoryHeapFlags;
    let library = vulkano::VulkanLibrary::new().map_err(|error| format!("cannot load the Vulkan loader: {error}"))?;
    let instance = Instance::new(
        library,
        InstanceCreateInfo { flags: InstanceCreateFlags::ENUMERATE_PORTABILITY, ..Default::default() },
    )
    .map_err(|error| format!("cannot create a Vulkan instance to read the heaps: {error}"))?;
    let devices: Vec<_> = instance
        .enumerate_physical_devices()
        .map_err(|error| format!("cannot list the Vulkan devices: {error}"))?
        .filter(|device| {
            let properties = device.properties();
            properties.vendor_id == adapter.vendor && properties.device_id == adapter.device
        })
        .collect();
    let device = match devices.as_slice() {
        [one] => one,
        [] => {
            return Err(format!(
                "no Vulkan device has the adapter's ids ({:#x}:{:#x})",
                adapter.vendor, adapter.device
            ));
        }
        several => several.iter().find(|device| device.properties().device_name == adapter.name).ok_or_else(|| {
            format!("{} Vulkan devices share the adapter's ids and none is named {:?}", several.len(), adapter.name)
        })?,
    };
    device
        .memory_properties()
        .memory_heaps
        .iter()
        .filter(|heap| heap.flags.intersects(MemoryHeapFlags::DEVICE_LOCAL))
        .map(|heap| heap.size)
        .max()
        .filter(|&size| size > 0)
        .ok_or_else(|| format!("the Vulkan device {:?} lists no device-local heap", adapter.name))
}

/// The budget of the adapter's largest device-local Vulkan heap (`VK_EXT_memory_budget`), read from `vulkaninfo
/// --text` ([`crate::vulkaninfo`]): what a new process may allocate from the heap now, the heap less what other
/// processes hold. Read before this process allocates, it is this process's room. Why not, in words, where
/// `vulkaninfo` is missing (Debian's `vulkan-tools`), fails, does not answer within
/// [`crate::vulkaninfo::TIMEOUT`] (a hung driver: it is stopped, and the open goes on with the heap), or the driver
/// does not offer the extension (lavapipe does not).
#[cfg(feature = "wgpu")]
fn vulkan_budget(adapter: &burn::tensor::wgpu::wgpu::AdapterInfo) -> std::result::Result<u64, String> {
    let report = crate::vulkaninfo::run("vulkaninfo".as_ref(), crate::vulkaninfo::TIMEOUT)?;
    crate::vulkaninfo::device_local_budget(&report, adapter.vendor, adapter.device, &adapter.name)
}

#[cfg(feature = "wgpu")]
fn open_wgpu(name: &DeviceName, pages: PagePolicy) -> Result<Device> {
    if device_index(name) != 0 {
        return Err(Error::UnknownDevice {
            kind: format!(
                "{name} (only wgpu:0, the default adapter, is supported; choose the adapter with the \
                 CUBECL_WGPU_DEFAULT_DEVICE variable)"
            ),
        });
    }
    match wgpu_runtime(pages) {
        Ok(runtime) => Ok(runtime.device.clone()),
        Err(message) => Err(Error::NoDriver {
            device: name.to_string(),
            message: message.clone(),
            fix: "install a Vulkan driver (on Debian: `apt-get install mesa-vulkan-drivers libvulkan1`, whose \
                  lavapipe runs on the CPU), check `vulkaninfo --summary` lists a device, or pick another --device"
                .into(),
        }),
    }
}

/// Waits for the queued work of every device runtime this process opened (the wgpu device, once opened), so a
/// process can leave with no runtime thread still working on its behalf: call it last, after the pipeline and
/// everything holding device memory is dropped. `Ok` when nothing was opened; the runtime's error, typed, when a
/// device fails to finish.
pub fn drain_devices() -> std::result::Result<(), ComponentError> {
    #[cfg(feature = "wgpu")]
    if let Some(Ok(runtime)) = WGPU.get() {
        let name = DeviceName::parse("wgpu:0").map_err(ComponentError::other)?;
        runtime.device.memory_cleanup();
        check_device(&runtime.device, &name, "drain", None)?;
    }
    Ok(())
}

/// What the device `name` is, in the runtime's words (the adapter and graphics API of `wgpu:0`, the index of a
/// CUDA device); `None` before it was opened or for the host.
pub fn describe_device(name: &DeviceName) -> Option<String> {
    match name.kind() {
        #[cfg(feature = "wgpu")]
        "wgpu" | "vulkan" => WGPU.get()?.as_ref().ok().map(|runtime| runtime.adapter.clone()),
        "cuda" => Some(format!("CUDA device {}", device_index(name))),
        _ => None,
    }
}

#[cfg(not(feature = "wgpu"))]
fn open_wgpu(name: &DeviceName, _pages: PagePolicy) -> Result<Device> {
    Err(Error::DeviceNotBuilt {
        device: name.to_string(),
        feature: "wgpu",
        fix: "build with `--features wgpu` (pipeline-zimage) and install a Vulkan driver (on Debian: \
              `apt-get install mesa-vulkan-drivers libvulkan1`)",
    })
}

/// One reading of a device's memory: burn's pool and, where the runtime has a call, the driver.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolSnapshot {
    /// Bytes the pool's live allocations use (without padding).
    pub in_use: u64,
    /// Bytes of padding inside those allocations.
    pub padding: u64,
    /// Bytes of pages the pool holds: in use, padding, and cache it can reuse.
    pub reserved: u64,
    /// The device's capacity.
    pub total: u64,
    /// The driver's free bytes (CUDA), when it has a call.
    pub driver_free: Option<u64>,
}

impl PoolSnapshot {
    /// Pages the pool holds but nothing uses: reusable by the next allocation.
    pub fn cache(&self) -> u64 {
        self.reserved.saturating_sub(self.in_use + self.padding)
    }

    /// What a new allocation can still get: the driver's free memory plus the pool's cache, or, with no driver
    /// call, the capacity less what the pool's allocations take.
    pub fn available(&self) -> u64 {
        match self.driver_free {
            Some(free) => free + self.cache(),
            None => self.total.saturating_sub(self.in_use + self.padding),
        }
    }

    /// Bytes on the device that are neither the pool's allocations nor its cache: the context and other
    /// processes, as far as the driver shows them (0 where it has no call).
    pub fn outside_pool(&self) -> u64 {
        match self.driver_free {
            Some(free) => self.total.saturating_sub(free).saturating_sub(self.reserved),
            None => 0,
        }
    }

    /// What counts against a cap: everything on the device but the pool's reusable cache.
    pub fn charged(&self) -> u64 {
        self.outside_pool() + self.in_use + self.padding
    }

    /// What an allocation can still get under a cap of `capacity` bytes: the real availability, never more
    /// than the cap less what counts against it.
    pub fn available_under(&self, capacity: u64) -> u64 {
        self.available().min(capacity.saturating_sub(self.charged()))
    }
}

struct PoolState {
    device: Device,
    name: DeviceName,
    /// The device's capacity, from the driver, the caller or the runtime.
    total: u64,
    /// Where `total` came from.
    total_source: TotalSource,
    /// Whether each allocation has a page of its own ([`PagePolicy::Exclusive`]).
    exclusive_pages: bool,
    driver: Driver,
    peak: AtomicU64,
    reserved_peak: AtomicU64,
    /// The open call windows: one per thread running a capped call ([`PoolReadings::begin_window`]) and one per
    /// token of [`DeviceMemory::open_call_window`], each with the highest readings since it opened.
    windows: Mutex<HashMap<WindowKey, CallWindow>>,
    /// The next token [`DeviceMemory::open_call_window`] hands out.
    next_token: AtomicU64,
    stop: AtomicBool,
}

/// Who a call window belongs to: a thread (a capped device's call) or a token (a component measuring its call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum WindowKey {
    Thread(ThreadId),
    Token(u64),
}

/// What one call window saw: the reading when it began and the highest readings since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallWindow {
    /// The reading when the window opened.
    pub start: PoolSnapshot,
    /// The highest bytes in use seen (sampled), the last reading included.
    pub high_in_use: u64,
    /// The most pages the pool held (sampled), the last reading included: what the device had to give the pool.
    pub high_reserved: u64,
}

enum Driver {
    None,
    #[cfg(feature = "cuda")]
    Cuda(Arc<cudarc::driver::CudaContext>),
}

impl Driver {
    /// The driver of the device `name`: CUDA's for a `cuda` device, whose context must open (a failure is the
    /// driver's, typed, never read as a device without a driver); none for the others.
    fn for_device(name: &DeviceName) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if name.kind() == "cuda" {
            return Ok(Driver::Cuda(cuda_context(name)?));
        }
        let _ = name;
        Ok(Driver::None)
    }

    /// `(free, total)` from the driver: `Ok(None)` where there is no driver call, the driver's failure in its own
    /// words where the call failed (what other processes hold is then unknown, never taken as nothing).
    fn memory(&self) -> std::result::Result<Option<(u64, u64)>, DriverFailure> {
        match self {
            Driver::None => Ok(None),
            #[cfg(feature = "cuda")]
            Driver::Cuda(context) => match context.mem_get_info() {
                Ok((free, total)) => Ok(Some((free as u64, total as u64))),
                Err(error) => {
                    let (code, words) = driver_words(&error);
                    Err(DriverFailure { code, words })
                }
            },
        }
    }
}

/// A driver call that failed: its code by name and the driver's words for it, where it gave them.
// Only a CUDA build has a driver call that can fail; the reading's path is written once for every build.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, PartialEq, Eq)]
struct DriverFailure {
    code: String,
    words: Option<String>,
}

impl DriverFailure {
    /// What a reading says when the driver's free-memory call failed.
    fn unread(&self, device: &DeviceName) -> ReadingUnavailable {
        ReadingUnavailable {
            device: device.clone(),
            message: format!(
                "the CUDA driver's free-memory call (cuMemGetInfo) returned {} ({}), so what other processes hold on \
                 the device is unknown",
                self.code,
                self.words.as_deref().unwrap_or(NO_WORDS)
            ),
        }
    }
}

/// Where a [`PoolReadings`]' total came from, in the order they are tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TotalSource {
    /// The driver's memory call (CUDA's `cuMemGetInfo`).
    Driver,
    /// The caller's size (`--device-memory`), which overrides the runtime's.
    Given,
    /// The runtime's reading of the device ([`runtime_capacity`]: the adapter's largest device-local Vulkan heap on
    /// wgpu).
    RuntimeHeap,
    /// The budget of that heap when the device opened (`VK_EXT_memory_budget`, [`runtime_budget`]), where the
    /// driver offers it and it is below the heap: other processes hold the rest.
    RuntimeBudget,
}

impl std::fmt::Display for TotalSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TotalSource::Driver => "the driver's",
            TotalSource::Given => "given by --device-memory",
            TotalSource::RuntimeHeap => "the device's largest device-local Vulkan heap",
            TotalSource::RuntimeBudget => "the budget of the device's largest device-local Vulkan heap at open",
        })
    }
}

/// The capacity of the device, read where it was opened: on wgpu, the largest device-local memory heap Vulkan reports
/// for the adapter (cubecl-wgpu 0.11.3 reads it into its client's `MemoryDeviceProperties::max_memory` when its
/// SPIR-V backend is built, the `vulkan` feature; otherwise the library reads it through vulkano when the runtime
/// opens: [`open_device`]); Metal's recommended working set on Apple. `None` for a runtime or driver that reports
/// none ([`runtime_capacity_or_why`] says why). The heap is the device's size, not its budget: what other
/// processes hold on it is in [`runtime_budget`], which [`PoolReadings::open`] takes where it is lower.
pub fn runtime_capacity(device: &Device) -> Option<u64> {
    runtime_capacity_or_why(device).ok()
}

/// [`runtime_capacity`], or why the runtime read no capacity (the words go into [`Error::UnknownTotal`]).
pub fn runtime_capacity_or_why(device: &Device) -> std::result::Result<u64, String> {
    #[cfg(feature = "wgpu")]
    {
        #[allow(unreachable_patterns)]
        let cubecl = match device.as_dispatch() {
            burn_dispatch::DispatchDevice::Cube(cube) => cube.client().properties().memory.max_memory(),
            _ => return Err("the device is not a cubecl device".into()),
        };
        match (cubecl, WGPU.get()) {
            (Some(total), _) => Ok(total),
            (None, Some(Ok(runtime))) if runtime.device == *device => runtime.heap.clone(),
            (None, _) => Err("the runtime states no capacity for this device".into()),
        }
    }
    #[cfg(not(feature = "wgpu"))]
    {
        let _ = device;
        Err("this build reads no runtime's capacity (the `wgpu` feature is off)".into())
    }
}

/// The budget of the device's largest device-local Vulkan heap when the runtime opened it (`VK_EXT_memory_budget`,
/// read from `vulkaninfo`: what this process could allocate there, other processes' use taken off), or why there
/// is none: not a wgpu device this library opened, not on Vulkan, no `vulkaninfo`, or a driver without the
/// extension (lavapipe).
pub fn runtime_budget(device: &Device) -> std::result::Result<u64, String> {
    #[cfg(feature = "wgpu")]
    {
        match WGPU.get() {
            Some(Ok(runtime)) if runtime.device == *device => runtime.budget.clone(),
            _ => Err("the device is not the wgpu device this library opened".into()),
        }
    }
    #[cfg(not(feature = "wgpu"))]
    {
        let _ = device;
        Err("this build reads no runtime's budget (the `wgpu` feature is off)".into())
    }
}

impl PoolState {
    /// One reading, or why there is none: a pool that gives no answer is unknown, never an empty device.
    fn snapshot(&self) -> std::result::Result<PoolSnapshot, ReadingUnavailable> {
        let usage = self.device.memory_pool_usage().ok_or_else(|| ReadingUnavailable {
            device: self.name.clone(),
            message: "burn's memory_pool_usage gave no answer for the device's pool".into(),
        })?;
        let (driver_free, total) = match self.driver.memory().map_err(|failure| failure.unread(&self.name))? {
            Some((free, total)) => (Some(free), total),
            None => (None, self.total),
        };
        Ok(PoolSnapshot {
            in_use: usage.bytes_in_use,
            padding: usage.bytes_padding,
            reserved: usage.bytes_reserved,
            total,
            driver_free,
        })
    }

    /// Reads the pool and counts the reading in the peaks and every open window. The reading is taken under the
    /// windows' lock, so a reading the sampler took before a window opened (or a peak was reset) can never be
    /// counted in it. A failed reading changes nothing.
    fn observe(&self) -> std::result::Result<PoolSnapshot, ReadingUnavailable> {
        let mut windows = self.windows.lock();
        let snapshot = self.snapshot()?;
        self.peak.fetch_max(snapshot.in_use, Ordering::Relaxed);
        self.reserved_peak.fetch_max(snapshot.reserved, Ordering::Relaxed);
        for window in windows.values_mut() {
            window.high_in_use = window.high_in_use.max(snapshot.in_use);
            window.high_reserved = window.high_reserved.max(snapshot.reserved);
        }
        Ok(snapshot)
    }
}

/// The memory readings of a real burn device, from its pool and its driver; see the [module docs](self).
///
/// Shared between threads (the manager reads it, group offload records with it, a sampler thread refreshes its
/// peak); dropping the last handle stops the sampler.
pub struct PoolReadings {
    state: Arc<PoolState>,
}

impl std::fmt::Debug for PoolReadings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolReadings")
            .field("device", &self.state.name.as_str())
            .field("total", &self.state.total)
            .finish()
    }
}

impl Drop for PoolReadings {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
    }
}

impl PoolReadings {
    /// How often the sampler thread reads the pool for the peak.
    pub const SAMPLE_EVERY: Duration = Duration::from_micros(500);

    /// Readings of `device` (named `name` in the manager and the record), with a sampler thread for the peak.
    ///
    /// The device's capacity comes from the driver where it has a call (CUDA's `cuMemGetInfo`; `total` is then
    /// ignored), else from `total` when given (an override), else from the runtime ([`runtime_capacity`]: on wgpu
    /// the device-local Vulkan heap, or its budget when the device opened where the driver offers
    /// `VK_EXT_memory_budget` and it is lower, [`runtime_budget`]). Fails with [`Error::NoPoolReadings`] for a
    /// backend without a memory pool (the CPU backend `flex`), and [`Error::UnknownTotal`] when none of the three
    /// gives a size.
    pub fn open(device: Device, name: DeviceName, total: Option<u64>) -> Result<Arc<Self>> {
        Self::open_with(device, name, total, Some(Self::SAMPLE_EVERY))
    }

    /// As [`open`](Self::open), sampling every `sample_every` (no sampler thread with `None`: the peak then
    /// counts only readings and [`observe`](Self::observe) calls).
    pub fn open_with(
        device: Device,
        name: DeviceName,
        total: Option<u64>,
        sample_every: Option<Duration>,
    ) -> Result<Arc<Self>> {
        if device.memory_pool_usage().is_none() {
            return Err(Error::NoPoolReadings { device: name.to_string() });
        }
        let driver = Driver::for_device(&name)?;
        let memory = driver.memory().map_err(|failure| Error::DriverFailed {
            device: name.to_string(),
            operation: "read the free memory (cuMemGetInfo) of",
            code: failure.code,
            words: failure.words.unwrap_or_else(|| NO_WORDS.into()),
        })?;
        let (total, total_source) = match (memory, total) {
            (Some((_, total)), _) => (total, TotalSource::Driver),
            (None, Some(total)) if total > 0 => (total, TotalSource::Given),
            _ => match runtime_capacity_or_why(&device) {
                Ok(heap) if heap > 0 => match runtime_budget(&device) {
                    Ok(budget) if budget < heap => (budget, TotalSource::RuntimeBudget),
                    _ => (heap, TotalSource::RuntimeHeap),
                },
                Ok(_) => return Err(Error::UnknownTotal { device: name.to_string(), why: "its heap is empty".into() }),
                Err(why) => return Err(Error::UnknownTotal { device: name.to_string(), why }),
            },
        };
        let exclusive_pages = page_policy(&device) == Some(PagePolicy::Exclusive);
        let state = Arc::new(PoolState {
            device,
            name,
            total,
            total_source,
            exclusive_pages,
            driver,
            peak: AtomicU64::new(0),
            reserved_peak: AtomicU64::new(0),
            windows: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            stop: AtomicBool::new(false),
        });
        state.observe().map_err(|unknown| Error::NoPoolReadings { device: unknown.device.to_string() })?;
        if let Some(interval) = sample_every {
            let weak = Arc::downgrade(&state);
            std::thread::Builder::new().name("pool-readings".into()).spawn(move || sample(&weak, interval)).map_err(
                |error| Error::InvalidConfig {
                    model: "pool readings".into(),
                    problem: format!("cannot start the sampler thread: {error}"),
                },
            )?;
        }
        Ok(Arc::new(Self { state }))
    }

    /// The burn device read.
    pub fn burn_device(&self) -> &Device {
        &self.state.device
    }

    /// Reads the pool (and the driver) now, and counts the reading in the peak; a pool that gives no answer is
    /// [`ReadingUnavailable`], never a reading of zeros.
    pub fn observe(&self) -> std::result::Result<PoolSnapshot, ReadingUnavailable> {
        self.state.observe()
    }

    /// The one explicit reset of the peaks: from now they start again at the pool's present reading, and until the
    /// next reset they only rise (the [`DeviceMemory`] contract). Nothing else lowers them. Fails, resetting
    /// nothing, when the pool cannot be read.
    pub fn reset_peak(&self) -> std::result::Result<(), ReadingUnavailable> {
        let _windows = self.state.windows.lock();
        let snapshot = self.state.snapshot()?;
        self.state.peak.store(snapshot.in_use, Ordering::Relaxed);
        self.state.reserved_peak.store(snapshot.reserved, Ordering::Relaxed);
        Ok(())
    }

    /// The highest reserved (pool pages) reading since the last reset: an upper bound of what the pool's
    /// allocations held, where [`peak`](DeviceMemory::peak) is the in-use high-water.
    pub fn reserved_peak(&self) -> u64 {
        self.state.reserved_peak.load(Ordering::Relaxed)
    }

    /// Where the device's total came from.
    pub fn total_source(&self) -> TotalSource {
        self.state.total_source
    }

    /// Whether the driver's free memory is read (CUDA), rather than derived from the given total.
    pub fn has_driver_readings(&self) -> bool {
        !matches!(self.state.driver, Driver::None)
    }

    /// Opens a call window on this thread: from now until [`end_window`](Self::end_window), the highest readings
    /// are kept for it.
    pub fn begin_window(&self) -> std::result::Result<PoolSnapshot, ReadingUnavailable> {
        let mut windows = self.state.windows.lock();
        let start = self.state.snapshot()?;
        let window = CallWindow { start, high_in_use: start.in_use, high_reserved: start.reserved };
        windows.insert(WindowKey::Thread(std::thread::current().id()), window);
        Ok(start)
    }

    /// Closes this thread's call window, with a last reading taken now. `Ok(None)` when no window was open; when
    /// the last reading fails the window is closed and the failure returned, since its high-water is not known.
    pub fn end_window(&self) -> std::result::Result<Option<CallWindow>, ReadingUnavailable> {
        let last = self.state.observe();
        let window = self.state.windows.lock().remove(&WindowKey::Thread(std::thread::current().id()));
        last.map(|_| window)
    }
}

fn sample(state: &Weak<PoolState>, interval: Duration) {
    loop {
        let Some(state) = state.upgrade() else { return };
        if state.stop.load(Ordering::Relaxed) {
            return;
        }
        // A failed sample counts nothing: the peak is what was read, never a guess.
        let _ = state.observe();
        drop(state);
        std::thread::sleep(interval);
    }
}

/// The plain readings cannot carry an error: where the pool gives no answer they read as a full device (nothing
/// available, everything allocated), so nothing is decided on an empty device that was never read; the manager
/// decides on [`DeviceMemory::try_reading`], which returns the failure.
impl DeviceMemory for PoolReadings {
    fn device(&self) -> DeviceName {
        self.state.name.clone()
    }

    fn total(&self) -> u64 {
        self.state.snapshot().map_or(self.state.total, |now| now.total)
    }

    fn available(&self) -> u64 {
        self.observe().map_or(0, |now| now.available())
    }

    fn allocated(&self) -> u64 {
        self.observe().map_or(self.state.total, |now| now.in_use)
    }

    fn peak(&self) -> u64 {
        let _ = self.observe();
        self.state.peak.load(Ordering::Relaxed)
    }

    fn try_reading(&self) -> std::result::Result<MemoryReading, ReadingUnavailable> {
        let now = self.observe()?;
        Ok(MemoryReading {
            available: now.available(),
            total: now.total,
            peak: self.state.peak.load(Ordering::Relaxed),
        })
    }

    /// The pool's pages ([`PoolSnapshot::reserved`]: in use, padding and cache) where each allocation has a page
    /// of its own ([`PagePolicy::Exclusive`]), so that what an onload adds is its own; `None` where pages are
    /// shared ([`PagePolicy::Adaptive`], CUDA's pool: measured on lavapipe, the first onload into an empty pool
    /// took an 8 MB page for 123 KB of weights, and the next ones fitted in it). Bytes in use would not do either:
    /// they are the weight bytes exactly, with no padding, whatever pages the pool took.
    fn held(&self) -> std::result::Result<Option<u64>, ReadingUnavailable> {
        if !self.state.exclusive_pages {
            return Ok(None);
        }
        Ok(Some(self.observe()?.reserved))
    }

    /// A window of its own (independent of a capped device's per-thread window), where each allocation has a page
    /// of its own; `Ok(None)` where pages are shared, for the reason [`held`](Self::held) gives.
    fn open_call_window(&self) -> std::result::Result<Option<u64>, ReadingUnavailable> {
        if !self.state.exclusive_pages {
            return Ok(None);
        }
        let mut windows = self.state.windows.lock();
        let start = self.state.snapshot()?;
        let token = self.state.next_token.fetch_add(1, Ordering::Relaxed);
        let window = CallWindow { start, high_in_use: start.in_use, high_reserved: start.reserved };
        windows.insert(WindowKey::Token(token), window);
        Ok(Some(token))
    }

    fn close_call_window(&self, token: u64) -> std::result::Result<Option<u64>, ReadingUnavailable> {
        let last = self.state.observe();
        let window = self.state.windows.lock().remove(&WindowKey::Token(token));
        last.map(|_| window.map(|w| w.high_reserved.saturating_sub(w.start.reserved)))
    }
}

/// How a device turns one allocation into the memory it takes from the device: the unit a [`CappedDevice`]'s
/// account counts in.
///
/// cubecl's pools never give an allocation less than its size rounded up to the device's alignment
/// (`cubecl-server` 0.11.3, `memory_pool/exclusive_pool.rs`: a page is `max(average, size)` rounded up to the
/// alignment; `memory_pool/sliced_pool.rs` pads each slice to it; `cubecl-wgpu` takes the alignment from the
/// device's `min_uniform_buffer_offset_alignment` and `min_storage_buffer_offset_alignment` limits). WebGPU caps
/// both limits at 256 B (an adapter must support 256 or better), so [`PageRule::CUBECL`] rounds each allocation
/// up to 256 B: never less than the pool takes for it. What a pool takes beyond that (an exclusive page sized
/// to the running average, a sliced page shared with others) is not predicted by the rule; it is measured, and
/// reconciled after each call ([`CappedDevice::last_call`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageRule {
    /// Bytes as asked: the simulated card, whose ledger is its memory.
    Bytes,
    /// Each allocation rounded up to a multiple of `granularity` bytes (0 counts as 1).
    RoundUp {
        /// The page granularity in bytes.
        granularity: u64,
    },
}

impl PageRule {
    /// The rule of cubecl's pools on every runtime (CUDA, wgpu): each allocation rounded up to 256 B.
    pub const CUBECL: PageRule = PageRule::RoundUp { granularity: 256 };

    /// What an allocation of `bytes` takes under this rule (saturating at `u64::MAX`).
    pub fn pages(&self, bytes: u64) -> u64 {
        match *self {
            PageRule::Bytes => bytes,
            PageRule::RoundUp { granularity } => {
                let granularity = granularity.max(1);
                bytes.div_ceil(granularity).saturating_mul(granularity)
            }
        }
    }

    /// What allocations of `sizes` take together, each rounded on its own.
    pub fn pages_of(&self, sizes: &[u64]) -> u64 {
        sizes.iter().fold(0u64, |sum, &bytes| sum.saturating_add(self.pages(bytes)))
    }
}

/// What a call reserved before it ran and what it took: the reconciliation [`CappedDevice::end_call`] makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallCharge {
    /// The call's activation estimate, in pages, reserved in `begin_call`.
    pub reserved: u64,
    /// The pages the pool took from the device during the call (its high-water less what it held when the call
    /// began): measured.
    pub measured_pages: u64,
}

/// The one account of reservations of a [`CappedDevice`], guarded by one mutex: every check against the cap and
/// the reservation it allows happen in one critical section.
///
/// # What counts against the cap
///
/// A card of the cap's size has to hold every page the pool holds (whatever part of it the allocations use), and
/// every reservation the pool does not show yet. So a check charges, besides what is outside the pool:
///
/// ```text
/// charged = max(pool pages + reservations not yet allocated, reservations)
/// ```
///
/// The pool's pages count what is there: reserved weights already uploaded, and what nobody reserved (a call's
/// inputs and outputs, the pages' own overhead beyond the [`PageRule`]). The reservations not yet allocated
/// ([`pending`](Self::pending)) count what is promised and not there: a call's activation estimate before the call
/// allocates, an upload's tensors before the copy makes them. Neither counts the other's bytes, so they add. (The
/// larger of the two alone, the rule before, let a prefetch pass while a call's estimate was reserved and not yet
/// allocated: the device then held more than the cap, and only the call's end noticed.)
///
/// Which reservations are allocated is read from the pool, since the runtime says nothing when an allocation lands:
/// a reservation is pending from its grant until the pool's pages have grown by its size since then (the growth
/// seen at each reading under the lock goes to the oldest pending reservations first), or until the thread that
/// made it goes on (each thread makes one upload at a time, so its next call on the ledger means its last upload
/// is on the device or failed; a call's estimate is pending until its call ends). Growth is device-wide, so it can
/// be credited to the wrong reservation; the floor (never less than the reservations themselves) keeps a
/// misattribution from charging less than the account holds.
#[derive(Debug, Default)]
struct Account {
    /// Pages of what the library placed on the device (component onloads, group uploads), in the page rule.
    placed: u64,
    /// Per thread running a call: the pages of its activation estimate, reserved until the call ends.
    calls: HashMap<ThreadId, u64>,
    /// The reservations the pool does not show yet, oldest first.
    pending: Vec<Pending>,
    /// The pool's pages at the last reading taken under the account's lock.
    seen: Option<u64>,
    /// The last call's reconciliation.
    last_call: Option<CallCharge>,
    /// The most the account held at once: its own high-water, never over the cap in hard mode.
    high_water: u64,
}

/// A reservation the pool does not show yet: who made it and what of it is still to come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    thread: ThreadId,
    /// A call's estimate (`true`) or an upload's tensors.
    call: bool,
    pages: u64,
}

impl Account {
    /// Everything reserved: the placements and the estimates of the calls in flight.
    fn reserved(&self) -> u64 {
        self.calls.values().fold(self.placed, |sum, &bytes| sum.saturating_add(bytes))
    }

    /// The reservations not yet allocated.
    fn pending(&self) -> u64 {
        self.pending.iter().fold(0u64, |sum, p| sum.saturating_add(p.pages))
    }

    /// Takes a reading of the pool: what its pages grew by since the last one is allocated, and goes to the oldest
    /// pending reservations first. A pool that shrank (its cache released) allocated nothing.
    fn settle(&mut self, now: &PoolSnapshot) {
        let mut grown = self.seen.map_or(0, |seen| now.reserved.saturating_sub(seen));
        self.seen = Some(now.reserved);
        for pending in &mut self.pending {
            let made = pending.pages.min(grown);
            pending.pages -= made;
            grown -= made;
        }
        self.pending.retain(|p| p.pages > 0);
    }

    /// What counts against the cap with the pool reading `now` (see the type's docs).
    fn charged(&self, now: &PoolSnapshot) -> u64 {
        let in_pool = now.reserved.saturating_add(self.pending()).max(self.reserved());
        now.outside_pool().saturating_add(in_pool)
    }

    /// `thread` goes on: its last upload is on the device, or failed and was given back.
    fn goes_on(&mut self, thread: ThreadId) {
        self.pending.retain(|p| p.thread != thread || p.call);
    }

    /// Reserves an upload of `pages` on `thread`, pending until the pool shows it.
    fn place(&mut self, thread: ThreadId, pages: u64) {
        self.goes_on(thread);
        self.placed = self.placed.saturating_add(pages);
        self.pending.push(Pending { thread, call: false, pages });
    }

    /// Gives back `pages` of placements, on `thread`.
    fn unplace(&mut self, thread: ThreadId, pages: u64) {
        self.goes_on(thread);
        self.placed = self.placed.saturating_sub(pages);
    }

    /// Reserves a call's estimate of `pages` on `thread`, pending until the pool shows it or the call ends.
    fn begin_call(&mut self, thread: ThreadId, pages: u64) {
        // Its last upload is made, and a thread runs one call at a time.
        self.pending.retain(|p| p.thread != thread);
        self.calls.insert(thread, pages);
        self.pending.push(Pending { thread, call: true, pages });
    }

    /// Ends `thread`'s call: its estimate is given back, whatever of it was not allocated too. Returns the estimate.
    fn end_call(&mut self, thread: ThreadId) -> u64 {
        self.pending.retain(|p| p.thread != thread);
        self.calls.remove(&thread).unwrap_or(0)
    }
}

/// A card of `capacity` bytes imposed over a real device's readings; see the [module docs](self).
///
/// In hard mode it keeps one account of what the library reserved on the device (weights and the activation
/// estimates of calls in flight, in the [`PageRule`]'s pages), under one mutex: a check against the cap and the
/// reservation it allows are one step, so the main thread and a prefetch worker can never both pass on the
/// same free bytes. What counts against the cap is everything on the device outside the pool (as the driver
/// shows it), plus the pool's pages and the reservations the pool does not show yet (never less than the
/// reservations): the rule is written out on the account's type.
#[derive(Debug)]
pub struct CappedDevice {
    readings: Arc<PoolReadings>,
    capacity: u64,
    hard: bool,
    label: String,
    pages: PageRule,
    account: Mutex<Account>,
}

impl CappedDevice {
    /// A cap of `capacity` bytes over `readings`, labelled `label` (`"16GB"`) in messages; in `hard` mode
    /// allocations and calls past the cap fail with out-of-memory, otherwise only the readings change. The
    /// account counts in cubecl's pages ([`PageRule::CUBECL`]).
    pub fn new(readings: Arc<PoolReadings>, capacity: u64, hard: bool, label: impl Into<String>) -> Arc<Self> {
        Self::with_pages(readings, capacity, hard, label, PageRule::CUBECL)
    }

    /// [`new`](Self::new) with the page rule `pages`.
    pub fn with_pages(
        readings: Arc<PoolReadings>,
        capacity: u64,
        hard: bool,
        label: impl Into<String>,
        pages: PageRule,
    ) -> Arc<Self> {
        Arc::new(Self { readings, capacity, hard, label: label.into(), pages, account: Mutex::new(Account::default()) })
    }

    /// The real readings under the cap.
    pub fn readings(&self) -> &Arc<PoolReadings> {
        &self.readings
    }

    /// The cap in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether allocations past the cap fail.
    pub fn is_hard(&self) -> bool {
        self.hard
    }

    /// The label the cap was asked for by.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The page rule the account counts in.
    pub fn page_rule(&self) -> PageRule {
        self.pages
    }

    /// Bytes the account holds now: the library's placements and the estimates of the calls in flight.
    pub fn reserved(&self) -> u64 {
        self.account.lock().reserved()
    }

    /// The most the account held at once (in hard mode never more than the cap less what was outside the pool).
    pub fn reserved_high_water(&self) -> u64 {
        self.account.lock().high_water
    }

    /// The last call's estimate beside the pages it took.
    pub fn last_call(&self) -> Option<CallCharge> {
        self.account.lock().last_call
    }

    fn out_of_memory(&self, requested: u64, available: u64) -> ComponentError {
        tracing::debug!(
            card = %self.label,
            requested = %format_size(requested),
            available = %format_size(available),
            "the cap over the real device refused an allocation"
        );
        ComponentError::OutOfMemory { device: self.readings.device(), requested, available }
    }

    fn unreadable(&self, unknown: ReadingUnavailable) -> ComponentError {
        ComponentError::Device { device: unknown.device.clone(), message: format!("during a reservation: {unknown}") }
    }

    /// Checks `pages` against the cap and reserves them with `take`, in one critical section.
    fn reserve(&self, pages: u64, take: impl FnOnce(&mut Account)) -> std::result::Result<(), ComponentError> {
        let (read, release) = (|| self.readings.observe(), || self.readings.burn_device().memory_cleanup());
        match reserve_in(&self.account, self.capacity, pages, read, release, take) {
            Ok(()) => Ok(()),
            Err(Refusal::Full { requested, free }) => Err(self.out_of_memory(requested, free)),
            Err(Refusal::Unreadable(unknown)) => Err(self.unreadable(unknown)),
        }
    }
}

/// Why a reservation was refused.
#[derive(Debug)]
enum Refusal {
    /// The cap cannot hold it.
    Full { requested: u64, free: u64 },
    /// The pool could not be read, so nothing is known of what the device holds.
    Unreadable(ReadingUnavailable),
}

/// What a cap of `capacity` can still give with `account` and the pool reading `now`: the cap less what counts
/// against it ([`Account::charged`]: what is outside the pool, the pool's pages and the reservations not yet
/// allocated), and never more than the device itself can give.
fn free_under(capacity: u64, now: &PoolSnapshot, account: &Account) -> u64 {
    capacity.saturating_sub(account.charged(now)).min(now.available())
}

/// The check and the reservation in one critical section: the account's lock is held from the reading to the
/// reservation, so two threads can never both pass on the same free bytes. When the pool's pages leave too little
/// and some of them are its cache, the cache is released (`release`) and the pool read again before the request
/// is refused, as torch's caching allocator empties its cache before it raises under a per-process memory
/// fraction.
fn reserve_in(
    account: &Mutex<Account>,
    capacity: u64,
    pages: u64,
    mut read: impl FnMut() -> std::result::Result<PoolSnapshot, ReadingUnavailable>,
    release: impl FnOnce(),
    take: impl FnOnce(&mut Account),
) -> std::result::Result<(), Refusal> {
    let mut account = account.lock();
    let mut now = read().map_err(Refusal::Unreadable)?;
    account.settle(&now);
    let mut free = free_under(capacity, &now, &account);
    if pages > free && now.cache() > 0 {
        release();
        now = read().map_err(Refusal::Unreadable)?;
        account.settle(&now);
        free = free_under(capacity, &now, &account);
    }
    if pages > free {
        return Err(Refusal::Full { requested: pages, free });
    }
    take(&mut account);
    account.high_water = account.high_water.max(account.reserved());
    Ok(())
}

impl DeviceMemory for CappedDevice {
    fn device(&self) -> DeviceName {
        self.readings.device()
    }

    fn total(&self) -> u64 {
        self.capacity.min(self.readings.total())
    }

    /// In hard mode what the account leaves under the cap; in soft mode the real availability under the cap.
    /// Reads 0 when the pool cannot be read ([`try_reading`](DeviceMemory::try_reading) says why).
    fn available(&self) -> u64 {
        self.try_available().unwrap_or(0)
    }

    fn allocated(&self) -> u64 {
        self.readings.allocated()
    }

    fn peak(&self) -> u64 {
        self.readings.peak()
    }

    fn try_reading(&self) -> std::result::Result<MemoryReading, ReadingUnavailable> {
        let available = self.try_available()?;
        Ok(MemoryReading { available, total: self.total(), peak: self.readings.peak() })
    }

    /// The pool's pages, as the readings under the cap read them.
    fn held(&self) -> std::result::Result<Option<u64>, ReadingUnavailable> {
        self.readings.held()
    }

    /// The readings' own window ([`PoolReadings`]), beside the cap's per-thread one.
    fn open_call_window(&self) -> std::result::Result<Option<u64>, ReadingUnavailable> {
        self.readings.open_call_window()
    }

    fn close_call_window(&self, token: u64) -> std::result::Result<Option<u64>, ReadingUnavailable> {
        self.readings.close_call_window(token)
    }
}

impl CappedDevice {
    fn try_available(&self) -> std::result::Result<u64, ReadingUnavailable> {
        if self.hard {
            let mut account = self.account.lock();
            let now = self.readings.observe()?;
            account.settle(&now);
            Ok(free_under(self.capacity, &now, &account))
        } else {
            Ok(self.readings.observe()?.available_under(self.capacity))
        }
    }
}

impl DeviceLedger for CappedDevice {
    /// In hard mode, checks `bytes` (in pages) against the cap and reserves them in one step, or refuses them;
    /// the real device then allocates for itself.
    fn allocate(&self, bytes: u64) -> std::result::Result<(), ComponentError> {
        self.allocate_tensors(&[bytes])
    }

    /// Gives back the pages of `bytes` reserved by [`allocate`](DeviceLedger::allocate).
    fn free(&self, bytes: u64) {
        self.free_tensors(&[bytes]);
    }

    /// In hard mode, checks the pages of every size in `sizes` against the cap and reserves them in one step.
    fn allocate_tensors(&self, sizes: &[u64]) -> std::result::Result<(), ComponentError> {
        if !self.hard {
            return Ok(());
        }
        let pages = self.pages.pages_of(sizes);
        let thread = std::thread::current().id();
        self.reserve(pages, |account| account.place(thread, pages))
    }

    /// Gives back the pages [`allocate_tensors`](DeviceLedger::allocate_tensors) reserved for `sizes`.
    fn free_tensors(&self, sizes: &[u64]) {
        if !self.hard {
            return;
        }
        let pages = self.pages.pages_of(sizes);
        self.account.lock().unplace(std::thread::current().id(), pages);
    }

    /// In hard mode, reserves the call's activation estimate (in pages) on this thread before the call runs, or
    /// refuses the call with out-of-memory; then opens a window that keeps the call's high-water. The estimate
    /// is checked against the pool's pages, its cache released first when those leave too little room (the
    /// call's new pages come on top of every page the pool holds).
    fn begin_call(&self, estimate: u64) -> std::result::Result<(), ComponentError> {
        if self.hard {
            let pages = self.pages.pages(estimate);
            let thread = std::thread::current().id();
            self.reserve(pages, |account| account.begin_call(thread, pages))?;
        }
        if let Err(unknown) = self.readings.begin_window() {
            self.account.lock().end_call(std::thread::current().id());
            return Err(self.unreadable(unknown));
        }
        Ok(())
    }

    /// Gives the call's reservation back and reconciles it with the pages the call took (kept as
    /// [`last_call`](CappedDevice::last_call)). In hard mode, fails when those pages, with what else is on the
    /// device, passed the cap: a card of that size could not have given them, and cubecl, which neither
    /// defragments nor retries, would have failed the allocation there.
    fn end_call(&self, _estimate: u64) -> std::result::Result<(), ComponentError> {
        let thread = std::thread::current().id();
        let closed = self.readings.end_window();
        let reserved = self.account.lock().end_call(thread);
        let window = match closed {
            Ok(Some(window)) => window,
            Ok(None) => return Ok(()),
            Err(unknown) => return Err(self.unreadable(unknown)),
        };
        let start = window.start;
        let measured_pages = window.high_reserved.saturating_sub(start.reserved);
        self.account.lock().last_call = Some(CallCharge { reserved, measured_pages });
        if !self.hard || start.outside_pool() + window.high_reserved <= self.capacity {
            return Ok(());
        }
        let requested = measured_pages + start.cache();
        Err(self.out_of_memory(requested, start.available_under(self.capacity)))
    }
}

/// Closes a call's account when the call leaves, whichever way it leaves: a user's forward that panics unwinds
/// through here, and the reservation its `begin_call` made is still given back.
struct OpenCall<'a> {
    ledger: &'a dyn DeviceLedger,
    estimate: u64,
    open: bool,
}

impl OpenCall<'_> {
    fn close(mut self) -> std::result::Result<(), ComponentError> {
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

/// Runs one call of a component (a forward, an encode, a decode) on `device`, named `name`, with its
/// activations accounted on `ledger` ([`DeviceLedger::begin_call`] and [`end_call`](DeviceLedger::end_call)),
/// and reports success only once the device has done the call's work: a failed sync ([`check_device`]), an
/// output that cannot be read back ([`check_outputs`]) and a call the ledger refuses afterwards (a hard cap's
/// high-water) are errors here, so nothing surfaces later when the result is read. An out-of-memory stays
/// [`ComponentError::OutOfMemory`], the one the manager's OOM retry handles.
///
/// `f` is the caller's code and is never caught: a panic in it (a bug in a model, whatever its words) unwinds to
/// the caller, with the call's account closed on the way. Only the library's own device operations (the sync
/// and the read-back here, uploads and onloads elsewhere) are guarded against a runtime that panics.
pub fn run_call<R: DeviceOutput>(
    device: &Device,
    name: &DeviceName,
    ledger: &dyn DeviceLedger,
    memory: Option<&dyn DeviceMemory>,
    estimate: u64,
    f: impl FnOnce() -> std::result::Result<R, ComponentError>,
) -> std::result::Result<R, ComponentError> {
    run_call_making_room(device, name, ledger, memory, estimate, || false, f)
}

/// [`run_call`] for a component that can give memory back before its call runs: when the ledger refuses the
/// call's activations for lack of room, `make_room` is called once (a grouped model gives back the groups its
/// prefetch worker uploaded that nobody borrows yet: they come back on their first take) and, when it freed
/// anything, the reservation is tried again. Nothing has run at that point, so this is no retry of the call: an
/// out-of-memory that remains is the manager's to handle, as before.
pub fn run_call_making_room<R: DeviceOutput>(
    device: &Device,
    name: &DeviceName,
    ledger: &dyn DeviceLedger,
    memory: Option<&dyn DeviceMemory>,
    estimate: u64,
    make_room: impl FnOnce() -> bool,
    f: impl FnOnce() -> std::result::Result<R, ComponentError>,
) -> std::result::Result<R, ComponentError> {
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

/// What a component call returns, as far as the device is concerned: the tensors whose computation must have
/// succeeded before the call reports success. [`check_outputs`] reads one value of each back.
pub trait DeviceOutput {
    /// One-element probes of the output's float tensors (empty for outputs without device tensors).
    fn probes(&self) -> Vec<Tensor<1>>;
}

impl<const D: usize> DeviceOutput for Tensor<D> {
    fn probes(&self) -> Vec<Tensor<1>> {
        let elements = self.shape().num_elements();
        if elements == 0 {
            return Vec::new();
        }
        vec![self.clone().reshape([elements]).narrow(0, 0, 1).cast(DType::F32)]
    }
}

impl<T: DeviceOutput> DeviceOutput for Vec<T> {
    fn probes(&self) -> Vec<Tensor<1>> {
        self.iter().flat_map(DeviceOutput::probes).collect()
    }
}

impl<T: DeviceOutput> DeviceOutput for [T] {
    fn probes(&self) -> Vec<Tensor<1>> {
        self.iter().flat_map(DeviceOutput::probes).collect()
    }
}

impl DeviceOutput for () {
    fn probes(&self) -> Vec<Tensor<1>> {
        Vec::new()
    }
}

impl<A: DeviceOutput, B: DeviceOutput> DeviceOutput for (A, B) {
    fn probes(&self) -> Vec<Tensor<1>> {
        let mut probes = self.0.probes();
        probes.extend(self.1.probes());
        probes
    }
}

/// The syncs and read-backs the library's checks ([`check_device`], [`check_outputs`]) made on devices that
/// defer failures, since the process started, split by the thread that made them: the prefetch workers
/// (threads named `group-offload-<model>`) and every other thread (the compute thread). The CPU backend is
/// never checked, so it counts none. Read it before and after a run to get that run's checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceChecks {
    /// Syncs on compute threads.
    pub compute_syncs: u64,
    /// Read-backs on compute threads.
    pub compute_read_backs: u64,
    /// Syncs on prefetch workers.
    pub worker_syncs: u64,
    /// Read-backs on prefetch workers.
    pub worker_read_backs: u64,
}

impl std::ops::Sub for DeviceChecks {
    type Output = Self;

    fn sub(self, earlier: Self) -> Self {
        Self {
            compute_syncs: self.compute_syncs - earlier.compute_syncs,
            compute_read_backs: self.compute_read_backs - earlier.compute_read_backs,
            worker_syncs: self.worker_syncs - earlier.worker_syncs,
            worker_read_backs: self.worker_read_backs - earlier.worker_read_backs,
        }
    }
}

/// `[compute syncs, compute read-backs, worker syncs, worker read-backs]`.
static CHECKS: [AtomicU64; 4] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// The checks made so far ([`DeviceChecks`]).
pub fn device_checks() -> DeviceChecks {
    let read = |i: usize| CHECKS[i].load(Ordering::Relaxed);
    DeviceChecks {
        compute_syncs: read(0),
        compute_read_backs: read(1),
        worker_syncs: read(2),
        worker_read_backs: read(3),
    }
}

/// Counts one check of `kind` (0 a sync, 1 a read-back) on the calling thread.
fn count_check(kind: usize) {
    let worker = std::thread::current().name().is_some_and(|name| name.starts_with("group-offload-"));
    CHECKS[kind + if worker { 2 } else { 0 }].fetch_add(1, Ordering::Relaxed);
}

/// Reads back one value of each of `output`'s tensors in one transfer, so that a failure anything they depend on
/// met on the device (an allocation the runtime refused, a kernel that faulted) surfaces now, typed as
/// [`check_device`] types it; `Ok` when every value arrived.
pub fn check_outputs(
    output: &(impl DeviceOutput + ?Sized),
    device: &Device,
    name: &DeviceName,
    operation: &'static str,
    memory: Option<&dyn DeviceMemory>,
) -> std::result::Result<(), ComponentError> {
    if !defers_failures(device) {
        return Ok(());
    }
    let probes = output.probes();
    if probes.is_empty() {
        return Ok(());
    }
    count_check(1);
    match catch_device_panic(|| Tensor::cat(probes, 0).try_into_data()) {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(classify(name, operation, error.reason(), error.is_device_poisoned(), memory)),
        Err(panic) => Err(panic.with_device(name, operation, memory)),
    }
}

/// Waits for `device`'s queued work (on this thread's stream) and turns a failure into a typed error:
/// [`ComponentError::OutOfMemory`] for the runtime's out-of-memory, with the bytes it asked for and what
/// `memory` reads as available (0 without readings), [`ComponentError::Device`] for anything else.
pub fn check_device(
    device: &Device,
    name: &DeviceName,
    operation: &'static str,
    memory: Option<&dyn DeviceMemory>,
) -> std::result::Result<(), ComponentError> {
    if !defers_failures(device) {
        return Ok(());
    }
    count_check(0);
    match catch_device_panic(|| device.sync()) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(classify(name, operation, error.reason(), error.is_device_poisoned(), memory)),
        Err(error) => Err(error.with_device(name, operation, memory)),
    }
}

/// Whether `device` can fail after the call that asked for the work: every device but burn's CPU backend, which
/// computes eagerly in host memory (so the checks above skip it, keeping the simulated card's hot paths free of
/// a sync and a read-back per call and per group upload).
pub(crate) fn defers_failures(device: &Device) -> bool {
    *device != Device::flex()
}

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

/// A panic's message: its payload's text when it is a `String` or a `&str` (what `panic!` and `unwrap` give),
/// empty otherwise.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_default()
}

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
fn is_device_failure(message: &str) -> bool {
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
enum Wrapper {
    /// The whole line.
    Line(&'static str),
    /// A line that begins so (its counts vary).
    Prefix(&'static str),
}

impl Wrapper {
    fn matches(&self, line: &str) -> bool {
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
const RUNTIME_WRAPPERS: [Wrapper; 5] = [
    Wrapper::Line("An error happened during execution"),
    Wrapper::Line("An IO error happened"),
    Wrapper::Line("A launch error happened"),
    Wrapper::Line("A compilation error happened during launch"),
    Wrapper::Prefix("The bytes were never written (failure #"),
];

/// cubecl's and burn's first lines for a poisoned device, whole: `ServerError::DevicePoisoned`,
/// `LaunchError::DevicePoisoned`, burn's `ExecutionError::DevicePoisoned`, and `CompilationError::DevicePoisoned`
/// (`cubecl-runtime` 0.11.3, `compiler.rs`: the device was poisoned before a compiled kernel could be loaded).
const POISONED: [&str; 3] = [
    "The device is poisoned",
    "The device was poisoned during launch",
    "The device is poisoned, the kernel could not be loaded",
];

/// How `IoError::DevicePoisoned` begins (`"The device is poisoned: {0}"`, `cubecl-runtime` 0.11.3,
/// `server/base.rs`): the driver's reason follows on the same line.
const POISONED_IO: &str = "The device is poisoned: ";

/// Whether a first line is one of the runtime's own for a poisoned device.
fn is_poisoned_line(line: &str) -> bool {
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
    /// typed error decides with that record ([`classify`]), never from these words alone.
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
    fn of_line(line: &str) -> RuntimeFailure {
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
const SEVERAL: &str = "Several failures at once";

/// cubecl's `IoError::NotFound` for memory whose allocation never happened (`cubecl-runtime` 0.11.3: `"couldn't find
/// resource for that handle: {reason}"`; `cubecl-server` 0.11.3, `memory_management/memory_manage.rs`: the reason).
const NEVER_INITIALIZED: &str = "couldn't find resource for that handle: Memory location was never initialized";

/// The text after the first `Caused by:` line of `text`, if it has one.
fn caused_by(text: &str) -> Option<&str> {
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
struct WgpuOutOfMemory {
    raised: AtomicU64,
    claimed: AtomicU64,
}

/// The wgpu runtime is one per process (its runner threads are cubecl's), so its panic record is too.
#[cfg(feature = "wgpu")]
static WGPU_OUT_OF_MEMORY_PANICS: WgpuOutOfMemory =
    WgpuOutOfMemory { raised: AtomicU64::new(0), claimed: AtomicU64::new(0) };

/// Installs, on top of the process's panic hook (which still runs, so the runtime's panic is still printed), a hook
/// that counts cubecl-wgpu's out-of-memory panics: they happen on cubecl's runner thread, where nothing of this
/// library runs, and a task nobody waits for swallows them, so this record is the only trace of why an allocation
/// never happened. Called once, when the wgpu runtime opens.
#[cfg(feature = "wgpu")]
fn record_wgpu_out_of_memory_panics() {
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
fn claim_wgpu_out_of_memory() -> bool {
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
fn classify(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn name() -> DeviceName {
        DeviceName::parse("wgpu:0").expect("a device name")
    }

    #[test]
    fn availability_is_free_plus_cache_with_a_driver_and_total_less_in_use_without() {
        let with_driver =
            PoolSnapshot { in_use: 600, padding: 40, reserved: 1_000, total: 10_000, driver_free: Some(7_000) };
        assert_eq!(with_driver.cache(), 360);
        assert_eq!(with_driver.available(), 7_360);
        // 10,000 − 7,000 = 3,000 used on the device, 1,000 of it the pool's pages: 2,000 is the context and others.
        assert_eq!(with_driver.outside_pool(), 2_000);
        assert_eq!(with_driver.charged(), 2_640);
        let without = PoolSnapshot { driver_free: None, ..with_driver };
        assert_eq!(without.available(), 9_360);
        assert_eq!(without.outside_pool(), 0);
        assert_eq!(without.charged(), 640);
        // A cap counts the context, the others and the padding, not the reusable cache.
        assert_eq!(with_driver.available_under(5_000), 2_360);
        assert_eq!(with_driver.available_under(100_000), 7_360);
        assert_eq!(with_driver.available_under(2_000), 0);
    }

    /// The runtime's texts as cubecl 0.11.3 and burn 0.22.1 format them (`ServerError`, `IoError`, `LaunchError`,
    /// `ExecutionError`, burn's `into_data` panic), one file each: `oom-*` are out-of-memory, `poisoned-*` a poisoned
    /// device, `unallocated-*` memory never allocated, `other-*` anything else. Most were assembled from the runtimes'
    /// format strings. Two were captured from a failing run on lavapipe, made to run out under an address-space
    /// limit (`docs/devices.md`): the panic of cubecl's runner thread (`oom-wgpu-panic.txt`) and what the read of
    /// the memory it was allocating returned (`unallocated-wgpu-oom-read.txt`).
    fn fixtures() -> Vec<(String, String)> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/runtime-errors");
        let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
            .expect("the fixtures directory")
            .map(|entry| {
                let path = entry.expect("an entry").path();
                let name = path.file_name().expect("a name").to_string_lossy().into_owned();
                (name, std::fs::read_to_string(&path).expect("a fixture"))
            })
            .collect();
        files.sort();
        files
    }

    #[test]
    fn each_runtime_fixture_is_classified_by_its_first_lines_alone() {
        let files = fixtures();
        assert!(files.len() >= 12, "{} fixtures", files.len());
        for (name, text) in &files {
            let failure = RuntimeFailure::of(text);
            let expected = name.split('-').next().expect("a prefix");
            let got = match failure {
                RuntimeFailure::OutOfMemory { .. } => "oom",
                RuntimeFailure::Poisoned => "poisoned",
                RuntimeFailure::Unallocated => "unallocated",
                RuntimeFailure::Other => "other",
            };
            assert_eq!(got, expected, "{name}: {failure:?}");
        }
        let sized = |file: &str| {
            let text = &files.iter().find(|(name, _)| name == file).expect("the fixture").1;
            out_of_memory_in(text)
        };
        assert_eq!(sized("oom-io-vulkan.txt"), Some(Some(68_719_476_736)));
        assert_eq!(sized("oom-io-cuda.txt"), Some(Some(268_435_456)));
        assert_eq!(sized("oom-unwritten-root.txt"), Some(Some(4_194_304)));
        assert_eq!(sized("oom-read-panic.txt"), Some(Some(1024)));
        assert_eq!(sized("oom-launch.txt"), Some(None));
        assert_eq!(sized("oom-wgpu-panic.txt"), Some(None));
        assert_eq!(sized("oom-page-sizes-exhausted.txt"), Some(Some(2_097_152)));
        assert_eq!(sized("oom-page-sizes-read-panic.txt"), Some(Some(512)));
    }

    #[test]
    fn memory_never_allocated_is_an_out_of_memory_only_where_the_runtime_recorded_one() {
        let text = "An error happened during execution\nCaused by:\n  Several failures at once\nCaused by:\n  The \
                    bytes were never written (failure #32, still claiming 1 buffer(s))\nCaused by:\n  An IO error \
                    happened\nCaused by:\n  couldn't find resource for that handle: Memory location was never \
                    initialized\nNo backtrace available";
        assert_eq!(RuntimeFailure::of(text), RuntimeFailure::Unallocated);
        assert_eq!(out_of_memory_in(text), None, "the words alone are no out-of-memory");
        // No runtime here recorded an out-of-memory panic (the flex build has no wgpu runner): a device error.
        if !cfg!(feature = "wgpu") {
            let error = classify(&name(), "run", text, false, None);
            assert!(matches!(error, ComponentError::Device { .. }), "{error:?}");
        }
    }

    #[test]
    fn the_default_wgpu_builds_out_of_memory_panic_is_caught_and_retryable_and_other_wgpu_panics_are_not() {
        // What cubecl raises again in the caller for wgpu's out-of-memory on its runner thread.
        let caught = catch_device_panic(|| -> u32 { std::panic::panic_any(WGPU_OUT_OF_MEMORY.to_string()) });
        let error = caught.expect_err("the runtime's panic is caught").with_device(&name(), "upload", None);
        assert!(matches!(error, ComponentError::OutOfMemory { requested: 0, available: 0, .. }), "{error:?}");
        // A validation error is a bug in the runtime's use, not a device failure: it goes on unwinding.
        let unwound = std::panic::catch_unwind(|| {
            catch_device_panic(|| -> u32 { panic!("wgpu error: Validation Error\n\nCaused by:\n  Out of Memory") })
        });
        assert!(unwound.is_err(), "a wgpu validation panic was swallowed");
    }

    #[test]
    fn every_poisoned_text_of_cubecl_is_poisoned_on_the_panic_path_too() {
        for text in [
            "The device is poisoned: Lost: the GPU went away\nBacktrace:\n   0: x",
            "A launch error happened\nCaused by:\n  A compilation error happened during launch\nCaused by:\n  \
             The device is poisoned, the kernel could not be loaded\nCaused by:\n  Lost",
        ] {
            // The panic path passes no poisoned flag: the words alone decide.
            let caught = catch_device_panic(|| -> u32 { std::panic::panic_any(text.to_string()) });
            let error = caught.expect_err("the runtime's panic is caught").with_device(&name(), "run", None);
            let inner = match &error {
                ComponentError::Other(inner) => inner.downcast_ref::<Error>(),
                _ => None,
            };
            assert!(matches!(inner, Some(Error::DevicePoisoned { .. })), "{text}: {error:?}");
        }
        assert_eq!(RuntimeFailure::of("The device is poisoned by my model"), RuntimeFailure::Other);
    }

    #[test]
    fn out_of_memory_is_recognised_in_the_runtimes_words_and_nothing_else_is() {
        assert_eq!(out_of_memory_in("out of device memory allocating 4096 bytes\nbacktrace"), Some(Some(4096)));
        assert_eq!(out_of_memory_in("An out-of-memory error happened during launch\nCaused by: x"), Some(None));
        // A driver's or a model's words are not the runtime's out-of-memory.
        assert_eq!(out_of_memory_in("CUDA_ERROR_OUT_OF_MEMORY: out of memory"), None);
        assert_eq!(out_of_memory_in("my model ran out of memory"), None);
        assert_eq!(out_of_memory_in("out of device memory allocating many bytes"), None);
        assert_eq!(out_of_memory_in("A compilation error happened during launch"), None);
        assert_eq!(out_of_memory_in("The device is poisoned"), None);
        // A wrapper without the line that names what it wraps is not read further.
        assert_eq!(out_of_memory_in("An IO error happened\n  out of device memory allocating 4 bytes"), None);
    }

    #[test]
    fn a_poisoned_device_is_its_own_error_and_never_an_out_of_memory() {
        let error = classify(&name(), "run", "The device is poisoned\nCaused by:\n  illegal address\nbt", false, None);
        assert!(!error.is_out_of_memory());
        match &error {
            ComponentError::Other(inner) => {
                let inner = inner.downcast_ref::<Error>().expect("group-offload's error");
                assert!(matches!(inner, Error::DevicePoisoned { operation: "run", .. }), "{inner:?}");
                assert!(inner.to_string().contains("restart the process"), "{inner}");
            }
            other => panic!("expected the poisoned device, got {other:?}"),
        }
        // burn's own flag decides even where the words would say out-of-memory.
        let flagged = classify(&name(), "run", "out of device memory allocating 77 bytes", true, None);
        assert!(!flagged.is_out_of_memory(), "{flagged:?}");
    }

    #[test]
    fn a_failure_that_is_not_memory_is_a_device_error_never_an_out_of_memory() {
        let text = "An IO error happened\nCaused by:\n  can't allocate buffer of size: 99\nbt";
        let error = classify(&name(), "run", text, false, None);
        match &error {
            ComponentError::Device { device, message } => {
                assert_eq!(device.as_str(), "wgpu:0");
                assert!(message.starts_with("during run: "), "{message}");
                assert!(message.contains("can't allocate buffer") && !message.contains("bt"), "{message}");
            }
            other => panic!("expected a device error, got {other:?}"),
        }
        assert!(!error.is_out_of_memory());
        let oom = classify(&name(), "upload", "out of device memory allocating 77 bytes", false, None);
        assert!(matches!(oom, ComponentError::OutOfMemory { requested: 77, available: 0, .. }), "{oom:?}");
    }

    #[test]
    fn a_runtime_panic_is_caught_with_its_message_and_a_bug_is_not() {
        let caught = catch_device_panic(|| -> u32 {
            panic!(
                "{BURN_READ_PANIC}An error happened during execution\nCaused by:\n  An IO error happened\nCaused by:\n  out of device memory allocating 12 bytes"
            )
        });
        let error = caught.expect_err("the panic is caught").with_device(&name(), "run", None);
        assert!(matches!(error, ComponentError::OutOfMemory { requested: 12, .. }), "{error:?}");
        let caught = catch_device_panic(|| -> u32 { panic!("An error happened during execution\nCaused by:\n  x") });
        let error = caught.expect_err("the panic is caught").with_device(&name(), "run", None);
        assert!(matches!(error, ComponentError::Device { .. }), "{error:?}");
        assert_eq!(catch_device_panic(|| 5).expect("no panic"), 5);
        // A bug is not a device failure, whatever its words: it goes on unwinding.
        for bug in ["index out of bounds", "my model is out of memory", "oops: out of device memory allocating 1 bytes"]
        {
            let unwound = std::panic::catch_unwind(|| catch_device_panic(|| -> u32 { panic!("{bug}") }));
            assert!(unwound.is_err(), "the bug's panic {bug:?} was not swallowed");
        }
    }

    #[test]
    fn a_users_forward_that_panics_is_never_caught_and_its_call_is_closed() {
        struct Calls(Mutex<(u32, u32)>);
        impl DeviceLedger for Calls {
            fn allocate(&self, _bytes: u64) -> std::result::Result<(), ComponentError> {
                Ok(())
            }
            fn free(&self, _bytes: u64) {}
            fn begin_call(&self, _estimate: u64) -> std::result::Result<(), ComponentError> {
                self.0.lock().0 += 1;
                Ok(())
            }
            fn end_call(&self, _estimate: u64) -> std::result::Result<(), ComponentError> {
                self.0.lock().1 += 1;
                Ok(())
            }
        }
        let ledger = Calls(Mutex::new((0, 0)));
        let device = Device::flex();
        // Even a panic in the runtime's own words is the forward's: run_call does not catch it.
        let unwound = std::panic::catch_unwind(AssertUnwindSafe(|| {
            run_call(&device, &DeviceName::cpu(), &ledger, None, 10, || -> std::result::Result<(), ComponentError> {
                panic!("out of device memory allocating 12 bytes")
            })
        }));
        assert!(unwound.is_err(), "the forward's panic reached the caller");
        assert_eq!(*ledger.0.lock(), (1, 1), "begin_call and end_call matched");
        let ran = run_call(&device, &DeviceName::cpu(), &ledger, None, 10, || Ok(()));
        assert!(ran.is_ok());
        assert_eq!(*ledger.0.lock(), (2, 2));
    }

    #[test]
    fn the_cap_counts_what_is_outside_the_pool_the_pools_pages_and_what_it_does_not_show_yet() {
        let now = PoolSnapshot { in_use: 600, padding: 40, reserved: 1_000, total: 10_000, driver_free: Some(7_000) };
        let empty = Account::default();
        // 2,000 outside the pool, 1,000 of pages in it (640 of them allocated: the rest a card must hold too).
        assert_eq!(free_under(5_000, &now, &empty), 2_000);
        // A reservation the pool does not show yet counts on top of its pages.
        let mut account = Account::default();
        account.settle(&now);
        account.place(std::thread::current().id(), 640);
        assert_eq!(free_under(5_000, &now, &account), 1_360);
        // The account holds more than the pool and its pending reservations (a misattributed growth): it counts.
        let held = Account { placed: 2_500, ..Account::default() };
        assert_eq!(free_under(5_000, &now, &held), 500);
        // Never more than the device itself can give.
        assert_eq!(free_under(100_000, &now, &empty), 7_360);
        assert_eq!(free_under(1_000, &now, &empty), 0);
    }

    #[test]
    fn a_prefetch_cannot_pass_the_cap_while_a_calls_estimate_is_reserved_but_not_yet_allocated() {
        // 600 B of weights placed and on the pool, beside 400 B of pages nobody reserved (an earlier call's outputs).
        let account = Mutex::new(Account { placed: 600, ..Account::default() });
        let pool = PoolSnapshot { in_use: 1_000, padding: 0, reserved: 1_000, total: 1 << 20, driver_free: None };
        let main = std::thread::current().id();
        // The main thread's call reserves its 1,000 B estimate under a 2,200 B cap; nothing of it is allocated yet.
        reserve_in(&account, 2_200, 1_000, || Ok(pool), || (), |a| a.begin_call(main, 1_000))
            .expect("the call's estimate fits");
        // A prefetch of 500 B now would put 2,500 B on a 2,200 B card once the call allocates.
        let worker = std::thread::spawn(|| std::thread::current().id()).join().expect("a thread id");
        let refused = reserve_in(&account, 2_200, 500, || Ok(pool), || (), |a| a.place(worker, 500));
        assert!(matches!(refused, Err(Refusal::Full { requested: 500, free: 200 })), "{refused:?}");
        // The call allocates its activations: the pool shows them, and they are charged once, not twice.
        let during = PoolSnapshot { in_use: 2_000, reserved: 2_000, ..pool };
        let refused = reserve_in(&account, 2_200, 500, || Ok(during), || (), |a| a.place(worker, 500));
        assert!(matches!(refused, Err(Refusal::Full { requested: 500, free: 200 })), "{refused:?}");
        assert_eq!(account.lock().pending(), 0, "the call's estimate is on the pool");
        // The call ends and frees its activations (cache now): the prefetch is granted once the cache is released.
        assert_eq!(account.lock().end_call(main), 1_000);
        let after = PoolSnapshot { in_use: 1_000, reserved: 2_000, ..pool };
        let released = std::cell::Cell::new(false);
        let read = || Ok(if released.get() { pool } else { after });
        reserve_in(&account, 2_200, 500, read, || released.set(true), |a| a.place(worker, 500)).expect("granted");
        assert!(released.get());
        let account = account.lock();
        assert_eq!((account.reserved(), account.pending()), (1_100, 500), "the upload is pending until the pool grows");
    }

    #[test]
    fn reservations_are_pending_until_the_pool_grows_by_them_or_their_thread_goes_on() {
        let (main, worker) =
            (std::thread::current().id(), std::thread::spawn(|| std::thread::current().id()).join().expect("an id"));
        let mut account = Account::default();
        let at =
            |reserved: u64| PoolSnapshot { in_use: reserved, padding: 0, reserved, total: 1 << 20, driver_free: None };
        account.settle(&at(1_000));
        account.place(worker, 300);
        account.begin_call(main, 400);
        assert_eq!((account.reserved(), account.pending()), (700, 700));
        // Charged: the pool, and what it does not show yet, on top of what is outside it (nothing here).
        assert_eq!(account.charged(&at(1_000)), 1_700);
        // The pool grows by 200: the oldest reservation (the upload) is credited first.
        account.settle(&at(1_200));
        assert_eq!(
            account.pending,
            vec![Pending { thread: worker, call: false, pages: 100 }, Pending { thread: main, call: true, pages: 400 }]
        );
        // A shrink (the cache released) allocates nothing; the next growth counts from there.
        account.settle(&at(900));
        account.settle(&at(1_000));
        assert_eq!(account.pending(), 400);
        // The worker goes on (its next reservation): its last upload is on the device.
        account.place(worker, 50);
        assert_eq!(
            account.pending,
            vec![Pending { thread: main, call: true, pages: 400 }, Pending { thread: worker, call: false, pages: 50 }]
        );
        // The call ends: what it did not allocate is no longer promised.
        assert_eq!(account.end_call(main), 400);
        assert_eq!(account.pending(), 50);
        // Never less than the reservations: growth credited to them that the pool then gave back.
        account.settle(&at(1_050));
        assert_eq!((account.reserved(), account.pending()), (350, 0));
        assert_eq!(account.charged(&at(100)), 350);
        // A failed upload is given back on its thread: nothing of it stays pending.
        account.place(worker, 70);
        account.unplace(worker, 70);
        assert_eq!((account.reserved(), account.pending()), (350, 0));
    }

    #[test]
    fn a_request_the_pages_refuse_is_granted_once_the_cache_is_released_and_only_then() {
        let account = Mutex::new(Account::default());
        // 3,000 of pages, 1,000 of them cache; a cap of 4,000 leaves 1,000, and 1,500 are asked.
        let before = PoolSnapshot { in_use: 2_000, padding: 0, reserved: 3_000, total: 1 << 20, driver_free: None };
        let after = PoolSnapshot { reserved: 2_000, ..before };
        let released = std::cell::Cell::new(false);
        let read = || Ok(if released.get() { after } else { before });
        reserve_in(&account, 4_000, 1_500, read, || released.set(true), |a| a.placed += 1_500).expect("granted");
        assert!(released.get(), "the cache was released before the request was granted");
        assert_eq!(account.lock().placed, 1_500);
        // A request that fits is granted without a release; one that the released pool still refuses is refused.
        let (account, released) = (Mutex::new(Account::default()), std::cell::Cell::new(false));
        let read = || Ok(after);
        reserve_in(&account, 4_000, 100, read, || released.set(true), |a| a.placed += 100).expect("granted");
        assert!(!released.get(), "nothing was released for a request that fitted");
        let refused = reserve_in(&account, 4_000, 2_500, read, || (), |a| a.placed += 2_500);
        assert!(matches!(refused, Err(Refusal::Full { requested: 2_500, free: 2_000 })), "{refused:?}");
    }

    #[test]
    fn two_threads_never_both_pass_on_the_same_free_bytes() {
        // Eight threads holding up to 768 B each want up to 6,144 B of a 4,096 B cap: they contend.
        const CAPACITY: u64 = 16 * 256;
        let account = Arc::new(Mutex::new(Account::default()));
        let empty = PoolSnapshot { in_use: 0, padding: 0, reserved: 0, total: 1 << 30, driver_free: None };
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let account = account.clone();
                std::thread::spawn(move || {
                    let (mut granted, mut refused) = (0u64, 0u64);
                    for round in 0..2_000u64 {
                        let pages = PageRule::CUBECL.pages(1 + round % 700);
                        // The reading is slow, so a check without the lock would let others in between.
                        let read = || {
                            std::thread::yield_now();
                            Ok(empty)
                        };
                        if reserve_in(&account, CAPACITY, pages, read, || (), |a| a.placed += pages).is_ok() {
                            granted += 1;
                            assert!(account.lock().reserved() <= CAPACITY);
                            std::thread::yield_now();
                            account.lock().placed -= pages;
                        } else {
                            refused += 1;
                        }
                    }
                    (granted, refused)
                })
            })
            .collect();
        let counts: Vec<(u64, u64)> = threads.into_iter().map(|t| t.join().expect("a thread")).collect();
        let (granted, refused) = counts.iter().fold((0, 0), |(g, r), (a, b)| (g + a, r + b));
        let account = account.lock();
        assert!(granted > 0 && refused > 0, "granted {granted}, refused {refused}");
        assert_eq!(account.placed, 0);
        assert!(account.high_water <= CAPACITY, "the account held {} of {CAPACITY}", account.high_water);
        let refused = reserve_in(&Mutex::new(Account::default()), 100, 101, || Ok(empty), || (), |_| {});
        assert!(matches!(refused, Err(Refusal::Full { requested: 101, free: 100 })), "{refused:?}");
        let unknown = ReadingUnavailable { device: DeviceName::cpu(), message: "no answer".into() };
        let refused = reserve_in(&Mutex::new(Account::default()), 100, 1, || Err(unknown.clone()), || (), |_| {});
        assert!(matches!(refused, Err(Refusal::Unreadable(_))), "{refused:?}");
    }

    #[test]
    fn the_page_rule_rounds_each_allocation_up_on_its_own() {
        assert_eq!(PageRule::Bytes.pages(1001), 1001);
        assert_eq!(PageRule::CUBECL.pages(0), 0);
        assert_eq!(PageRule::CUBECL.pages(1), 256);
        assert_eq!(PageRule::CUBECL.pages(256), 256);
        assert_eq!(PageRule::CUBECL.pages(257), 512);
        assert_eq!(PageRule::CUBECL.pages_of(&[1, 1, 300]), 1024);
        assert_eq!(PageRule::RoundUp { granularity: 0 }.pages(7), 7);
        assert_eq!(PageRule::CUBECL.pages(u64::MAX), u64::MAX);
    }

    #[test]
    fn devices_are_opened_by_kind_and_unknown_kinds_are_typed_errors() {
        assert!(open_device(&DeviceName::cpu()).is_ok());
        let error = open_device(&DeviceName::parse("tpu:0").expect("a name")).expect_err("no such backend");
        assert!(matches!(error, Error::UnknownDevice { .. }), "{error:?}");
        #[cfg(not(feature = "cuda"))]
        {
            let error = open_device(&DeviceName::parse("cuda:0").expect("a name")).expect_err("not built");
            assert!(matches!(error, Error::DeviceNotBuilt { feature: "cuda", .. }), "{error:?}");
            assert!(error.to_string().contains("--features cuda"), "{error}");
        }
        #[cfg(not(feature = "wgpu"))]
        {
            let error = open_device(&name()).expect_err("not built");
            assert!(matches!(error, Error::DeviceNotBuilt { feature: "wgpu", .. }), "{error:?}");
            assert!(error.to_string().contains("mesa-vulkan-drivers"), "{error}");
        }
    }

    #[test]
    fn a_cuda_drivers_failure_is_named_as_it_is_and_never_as_a_missing_driver() {
        let seven = DeviceName::parse("cuda:7").expect("a name");
        let words = Some("invalid device ordinal");
        // A wrong index: the driver's count and its words.
        let error = cuda_failure(&seven, "open", "CUDA_ERROR_INVALID_DEVICE", words, || Ok(1));
        assert_eq!(
            error.to_string(),
            "cannot open cuda:7: there is no such CUDA device: the driver lists 1, cuda:0 (CUDA_ERROR_INVALID_DEVICE: \
             invalid device ordinal); pick one of the devices `nvidia-smi -L` lists (cuda:0 is the first), or another \
             --device"
        );
        let error = cuda_failure(&seven, "open", "CUDA_ERROR_INVALID_DEVICE", words, || Ok(4));
        assert!(error.to_string().contains("the driver lists 4, cuda:0 to cuda:3"), "{error}");
        let error = cuda_failure(&seven, "open", "CUDA_ERROR_INVALID_DEVICE", None, || {
            Err("CUDA_ERROR_NOT_INITIALIZED (initialization error)".into())
        });
        assert!(matches!(error, Error::NoSuchDevice { .. }), "{error:?}");
        assert!(
            error.to_string().contains(
                "the driver says CUDA_ERROR_INVALID_DEVICE, and could not count its devices \
                 (CUDA_ERROR_NOT_INITIALIZED (initialization error))"
            ),
            "{error}"
        );
        let zero = DeviceName::parse("cuda:0").expect("a name");
        let error =
            cuda_failure(&zero, "open", "CUDA_ERROR_NO_DEVICE", Some("no CUDA-capable device is detected"), || {
                panic!("the count is asked only for a wrong index")
            });
        assert!(error.to_string().contains("the driver sees no CUDA device (CUDA_ERROR_NO_DEVICE: no CUDA-capable"));
        // Anything else is the driver's failure, in its words.
        let error = cuda_failure(&zero, "open", "CUDA_ERROR_NOT_INITIALIZED", Some("initialization error"), || Ok(1));
        assert_eq!(
            error.to_string(),
            "the CUDA driver failed to open cuda:0: it returned CUDA_ERROR_NOT_INITIALIZED (initialization error); \
             check that `nvidia-smi` lists the card and the driver's messages (`dmesg`), or pick another --device"
        );
        let error = cuda_failure(&zero, "open", "CUDA_ERROR_UNKNOWN", None, || Ok(1));
        assert!(error.to_string().contains("CUDA_ERROR_UNKNOWN (the driver gave no description)"), "{error}");
        for error in [
            cuda_failure(&seven, "open", "CUDA_ERROR_INVALID_DEVICE", words, || Ok(1)),
            cuda_failure(&zero, "open", "CUDA_ERROR_OPERATING_SYSTEM", None, || Ok(1)),
        ] {
            assert!(!matches!(error, Error::NoDriver { .. }) && !error.to_string().contains("install"), "{error}");
        }
    }

    /// The names the classification reads are cudarc's codes as they print.
    #[cfg(feature = "cuda")]
    #[test]
    fn cudarcs_codes_print_as_the_names_the_classification_reads() {
        use cudarc::driver::{DriverError, sys::CUresult};
        for (code, name) in [
            (CUresult::CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"),
            (CUresult::CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"),
        ] {
            assert_eq!(format!("{:?}", DriverError(code).0), name);
        }
    }

    #[test]
    fn a_failed_free_memory_call_is_an_unknown_reading_in_the_drivers_words_never_an_empty_device() {
        let failure =
            DriverFailure { code: "CUDA_ERROR_ILLEGAL_ADDRESS".into(), words: Some("an illegal memory access".into()) };
        let unknown = failure.unread(&DeviceName::parse("cuda:0").expect("a name"));
        assert_eq!(
            unknown.message,
            "the CUDA driver's free-memory call (cuMemGetInfo) returned CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory \
             access), so what other processes hold on the device is unknown"
        );
    }

    #[test]
    fn the_cpu_backend_has_no_pool_to_read() {
        let error = PoolReadings::open(Device::flex(), DeviceName::cpu(), Some(1 << 30)).expect_err("flex has no pool");
        assert!(matches!(error, Error::NoPoolReadings { .. }), "{error:?}");
    }
}
