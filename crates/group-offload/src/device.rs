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
//! (a component's onload, a group's upload) is refused as an out-of-memory before it is made, and a call during
//! which the pool's pages passed the cap fails as an out-of-memory once it has run ([`DeviceLedger::end_call`]):
//! the device had the memory, a card of the cap's size would not have. Pages are what a card gives cubecl's
//! pool: it asks the driver for a page when its pages cannot hold an allocation, and fails there when the card
//! has none left; it neither defragments nor retries. Before each call the pool's cache is released when its
//! pages hold the device past the cap, as torch releases its cache before it raises. Pages are sized to the
//! largest allocation so far (2 MiB and more), so on a tiny workload they are mostly cache: the tiny pipeline's
//! 4.0 MB of weights sat in 10.8 MB of pages on lavapipe. The pages also make the decision exact where a
//! sampled in-use high-water is not: the pool's pages only grow during a call, so the reading after it is their
//! high-water.

//! # Failures
//!
//! cubecl does not fail the allocating call: a failed allocation is carried by the memory it was for, every
//! kernel that needs that memory is skipped and passes the failure on to its outputs, and the failure surfaces
//! when a result is read (measured on wgpu/lavapipe: `Device::sync` returned `Ok` after a failed 64 GiB
//! allocation; reading the result returned the error). So a move or a call is checked by reading back one value
//! of each of its outputs ([`DeviceOutput`], [`check_outputs`]) after a sync ([`check_device`]): a failure of
//! anything the outputs depend on surfaces there, typed, instead of later at `into_data`. cubecl's
//! out-of-memory (`IoError::OutOfMemory`, `LaunchError::OutOfMemory`, which burn passes on as text) becomes
//! [`ComponentError::OutOfMemory`] with the bytes asked for and the bytes available; anything else (a buffer
//! larger than the device can ever give, a poisoned device) is [`ComponentError::Device`], never labelled
//! out-of-memory. [`catch_device_panic`] catches a runtime that panics instead of returning an error, at the
//! same boundary.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::ThreadId;
use std::time::Duration;

use burn::tensor::{DType, Device, Tensor};
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

#[cfg(feature = "cuda")]
fn open_cuda(name: &DeviceName) -> Result<Device> {
    // burn's CUDA runtime panics on first use when there is no driver; ask the driver first, so a machine
    // without one gets a typed error.
    let index = device_index(name);
    cudarc::driver::CudaContext::new(index as usize).map_err(|error| Error::NoDriver {
        device: name.to_string(),
        message: format!("{error:?}"),
        fix: "install the NVIDIA driver, check `nvidia-smi` lists the card, or pick another --device".into(),
    })?;
    Ok(Device::cuda(index))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(name: &DeviceName) -> Result<Device> {
    Err(Error::DeviceNotBuilt {
        device: name.to_string(),
        feature: "cuda",
        fix: "run `cargo xtask setup-cuda`, then build with `--features cuda`",
    })
}

/// The wgpu runtime's answer, once per process: the device and a description of its adapter, or why not.
/// The wgpu runtime can be initialised once per process; every later open shares the first answer.
#[cfg(feature = "wgpu")]
static WGPU: std::sync::OnceLock<std::result::Result<(Device, String), String>> = std::sync::OnceLock::new();

#[cfg(feature = "wgpu")]
fn wgpu_runtime(pages: PagePolicy) -> &'static std::result::Result<(Device, String), String> {
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
        // A device that cannot run one small kernel is no device: probe it here, where the error is typed.
        catch_device_panic(|| {
            let x = Tensor::<1>::ones([4], &device);
            (x * 2.0).sum().try_into_data().map(|_| ()).map_err(|error| error.to_string())
        })
        .map_err(|panic| panic.to_string())??;
        Ok((device, adapter))
    })
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
        Ok((device, _)) => Ok(device.clone()),
        Err(message) => Err(Error::NoDriver {
            device: name.to_string(),
            message: message.clone(),
            fix: "install a Vulkan driver (on Debian: `apt-get install mesa-vulkan-drivers libvulkan1`, whose \
                  lavapipe runs on the CPU), check `vulkaninfo --summary` lists a device, or pick another --device"
                .into(),
        }),
    }
}

/// What the device `name` is, in the runtime's words (the adapter and graphics API of `wgpu:0`, the index of a
/// CUDA device); `None` before it was opened or for the host.
pub fn describe_device(name: &DeviceName) -> Option<String> {
    match name.kind() {
        #[cfg(feature = "wgpu")]
        "wgpu" | "vulkan" => WGPU.get()?.as_ref().ok().map(|(_, adapter)| adapter.clone()),
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
    /// The device's capacity, from the driver or given.
    total: u64,
    driver: Driver,
    peak: AtomicU64,
    reserved_peak: AtomicU64,
    /// Per thread running a call: the highest in-use reading since the call began.
    windows: Mutex<HashMap<ThreadId, CallWindow>>,
    stop: AtomicBool,
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
    fn for_device(name: &DeviceName) -> Self {
        #[cfg(feature = "cuda")]
        if name.kind() == "cuda"
            && let Ok(context) = cudarc::driver::CudaContext::new(device_index(name) as usize)
        {
            return Driver::Cuda(context);
        }
        let _ = name;
        Driver::None
    }

    /// `(free, total)` from the driver.
    fn memory(&self) -> Option<(u64, u64)> {
        match self {
            Driver::None => None,
            #[cfg(feature = "cuda")]
            Driver::Cuda(context) => context.mem_get_info().ok().map(|(free, total)| (free as u64, total as u64)),
        }
    }
}

impl PoolState {
    fn snapshot(&self) -> PoolSnapshot {
        let usage = self.device.memory_pool_usage().unwrap_or_default();
        let (driver_free, total) = match self.driver.memory() {
            Some((free, total)) => (Some(free), total),
            None => (None, self.total),
        };
        PoolSnapshot {
            in_use: usage.bytes_in_use,
            padding: usage.bytes_padding,
            reserved: usage.bytes_reserved,
            total,
            driver_free,
        }
    }

    /// Reads the pool and counts the reading in the peaks and every open window. The reading is taken under the
    /// windows' lock, so a reading the sampler took before a window opened (or a peak was reset) can never be
    /// counted in it.
    fn observe(&self) -> PoolSnapshot {
        let mut windows = self.windows.lock();
        let snapshot = self.snapshot();
        self.peak.fetch_max(snapshot.in_use, Ordering::Relaxed);
        self.reserved_peak.fetch_max(snapshot.reserved, Ordering::Relaxed);
        for window in windows.values_mut() {
            window.high_in_use = window.high_in_use.max(snapshot.in_use);
            window.high_reserved = window.high_reserved.max(snapshot.reserved);
        }
        snapshot
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
    /// `total` is the device's capacity where the runtime reports none (wgpu); a CUDA device's comes from the
    /// driver and `total` is ignored. Fails with [`Error::NoPoolReadings`] for a backend without a memory pool
    /// (the CPU backend `flex`), and [`Error::UnknownTotal`] when neither the driver nor `total` gives a size.
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
        let driver = Driver::for_device(&name);
        let total = match (driver.memory(), total) {
            (Some((_, total)), _) => total,
            (None, Some(total)) if total > 0 => total,
            _ => return Err(Error::UnknownTotal { device: name.to_string() }),
        };
        let state = Arc::new(PoolState {
            device,
            name,
            total,
            driver,
            peak: AtomicU64::new(0),
            reserved_peak: AtomicU64::new(0),
            windows: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
        });
        state.observe();
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

    /// Reads the pool (and the driver) now, and counts the reading in the peak.
    pub fn observe(&self) -> PoolSnapshot {
        self.state.observe()
    }

    /// Starts a new peak: the next readings alone count.
    pub fn reset_peak(&self) {
        let _windows = self.state.windows.lock();
        let snapshot = self.state.snapshot();
        self.state.peak.store(snapshot.in_use, Ordering::Relaxed);
        self.state.reserved_peak.store(snapshot.reserved, Ordering::Relaxed);
    }

    /// The highest reserved (pool pages) reading since the last reset: an upper bound of what the pool's
    /// allocations held, where [`peak`](DeviceMemory::peak) is the in-use high-water.
    pub fn reserved_peak(&self) -> u64 {
        self.state.reserved_peak.load(Ordering::Relaxed)
    }

    /// Whether the driver's free memory is read (CUDA), rather than derived from the given total.
    pub fn has_driver_readings(&self) -> bool {
        !matches!(self.state.driver, Driver::None)
    }

    /// Opens a call window on this thread: from now until [`end_window`](Self::end_window), the highest readings
    /// are kept for it.
    pub fn begin_window(&self) -> PoolSnapshot {
        let mut windows = self.state.windows.lock();
        let start = self.state.snapshot();
        let window = CallWindow { start, high_in_use: start.in_use, high_reserved: start.reserved };
        windows.insert(std::thread::current().id(), window);
        start
    }

    /// Closes this thread's call window, with a last reading taken now. `None` when no window was open.
    pub fn end_window(&self) -> Option<CallWindow> {
        self.state.observe();
        self.state.windows.lock().remove(&std::thread::current().id())
    }
}

fn sample(state: &Weak<PoolState>, interval: Duration) {
    loop {
        let Some(state) = state.upgrade() else { return };
        if state.stop.load(Ordering::Relaxed) {
            return;
        }
        state.observe();
        drop(state);
        std::thread::sleep(interval);
    }
}

impl DeviceMemory for PoolReadings {
    fn device(&self) -> DeviceName {
        self.state.name.clone()
    }

    fn total(&self) -> u64 {
        self.state.snapshot().total
    }

    fn available(&self) -> u64 {
        self.observe().available()
    }

    fn allocated(&self) -> u64 {
        self.observe().in_use
    }

    fn peak(&self) -> u64 {
        self.observe();
        self.state.peak.load(Ordering::Relaxed)
    }
}

/// A card of `capacity` bytes imposed over a real device's readings; see the [module docs](self).
#[derive(Debug)]
pub struct CappedDevice {
    readings: Arc<PoolReadings>,
    capacity: u64,
    hard: bool,
    label: String,
}

impl CappedDevice {
    /// A cap of `capacity` bytes over `readings`, labelled `label` (`"16GB"`) in messages; in `hard` mode
    /// allocations and calls past the cap fail with out-of-memory, otherwise only the readings change.
    pub fn new(readings: Arc<PoolReadings>, capacity: u64, hard: bool, label: impl Into<String>) -> Arc<Self> {
        Arc::new(Self { readings, capacity, hard, label: label.into() })
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

    fn out_of_memory(&self, requested: u64, available: u64) -> ComponentError {
        tracing::debug!(
            card = %self.label,
            requested = %format_size(requested),
            available = %format_size(available),
            "the cap over the real device refused an allocation"
        );
        ComponentError::OutOfMemory { device: self.readings.device(), requested, available }
    }
}

impl DeviceMemory for CappedDevice {
    fn device(&self) -> DeviceName {
        self.readings.device()
    }

    fn total(&self) -> u64 {
        self.capacity.min(self.readings.total())
    }

    fn available(&self) -> u64 {
        self.readings.observe().available_under(self.capacity)
    }

    fn allocated(&self) -> u64 {
        self.readings.allocated()
    }

    fn peak(&self) -> u64 {
        self.readings.peak()
    }
}

impl DeviceLedger for CappedDevice {
    /// In hard mode, refuses `bytes` the cap cannot hold now; the real device then allocates for itself.
    fn allocate(&self, bytes: u64) -> std::result::Result<(), ComponentError> {
        if !self.hard {
            return Ok(());
        }
        let available = self.available();
        if bytes > available {
            return Err(self.out_of_memory(bytes, available));
        }
        Ok(())
    }

    /// The real device frees for itself.
    fn free(&self, _bytes: u64) {}

    /// Opens a window that keeps the call's high-water; the estimate is not charged, the measurement decides. In
    /// hard mode the pool's cache is released first when its pages hold the device past the cap, as torch's
    /// caching allocator releases its cache before it raises under a per-process memory fraction.
    fn begin_call(&self, _estimate: u64) -> std::result::Result<(), ComponentError> {
        if self.hard {
            let now = self.readings.observe();
            if now.outside_pool() + now.reserved > self.capacity {
                self.readings.burn_device().memory_cleanup();
            }
        }
        self.readings.begin_window();
        Ok(())
    }

    /// In hard mode, fails when the pages the pool took from the device during the call, with what else is on
    /// the device, passed the cap: a card of that size could not have given them, and cubecl, which neither
    /// defragments nor retries, would have failed the allocation there.
    fn end_call(&self, _estimate: u64) -> std::result::Result<(), ComponentError> {
        let Some(window) = self.readings.end_window() else { return Ok(()) };
        let start = window.start;
        if !self.hard || start.outside_pool() + window.high_reserved <= self.capacity {
            return Ok(());
        }
        let requested = window.high_reserved.saturating_sub(start.reserved) + start.cache();
        Err(self.out_of_memory(requested, start.available_under(self.capacity)))
    }
}

/// Runs one call of a component (a forward, an encode, a decode) on `device`, named `name`, with its
/// activations accounted on `ledger` ([`DeviceLedger::begin_call`] and [`end_call`](DeviceLedger::end_call)),
/// and reports success only once the device has done the call's work: a runtime panic inside `f`, a failed sync
/// ([`check_device`]), an output that cannot be read back ([`check_outputs`]) and a call the ledger refuses
/// afterwards (a hard cap's high-water) are errors here, so nothing surfaces later when the result is read. An
/// out-of-memory stays [`ComponentError::OutOfMemory`], the one the manager's OOM retry handles.
pub fn run_call<R: DeviceOutput>(
    device: &Device,
    name: &DeviceName,
    ledger: &dyn DeviceLedger,
    memory: Option<&dyn DeviceMemory>,
    estimate: u64,
    f: impl FnOnce() -> std::result::Result<R, ComponentError>,
) -> std::result::Result<R, ComponentError> {
    ledger.begin_call(estimate)?;
    let result = catch_device_panic(f);
    let synced = check_device(device, name, "run", memory);
    let read = match &result {
        Ok(Ok(value)) => check_outputs(value, device, name, "run", memory),
        _ => Ok(()),
    };
    let closed = ledger.end_call(estimate);
    let value = match result {
        Ok(value) => value,
        Err(panic) => return Err(panic.with_device(name, "run", memory)),
    };
    // A device failure explains a failed call better than the call's own error, which may be its symptom.
    synced?;
    read?;
    closed?;
    value
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
    match catch_device_panic(|| Tensor::cat(probes, 0).try_into_data()) {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(classify(name, operation, error.reason(), memory)),
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
    match catch_device_panic(|| device.sync()) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(classify(name, operation, error.reason(), memory)),
        Err(error) => Err(error.with_device(name, operation, memory)),
    }
}

/// Whether `device` can fail after the call that asked for the work: every device but burn's CPU backend, which
/// computes eagerly in host memory (so the checks above skip it, keeping the simulated card's hot paths free of
/// a sync and a read-back per call and per group upload).
fn defers_failures(device: &Device) -> bool {
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
        classify(name, operation, &self.message, memory)
    }
}

impl std::fmt::Display for DevicePanic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the device runtime panicked: {}", self.message)
    }
}

/// Runs `f`, catching a panic of the device runtime as a [`DevicePanic`]: a read of a tensor whose computation
/// failed on the device (burn's `into_data` panics with the runtime's error), or a runtime that panics on a failed
/// allocation. Any other panic (a bug, not a device failure) goes on unwinding. The one boundary where a panic is
/// turned into an error: callers use it around a move or a call, nowhere else.
pub fn catch_device_panic<R>(f: impl FnOnce() -> R) -> std::result::Result<R, DevicePanic> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_default();
        if !is_device_failure(&message) {
            std::panic::resume_unwind(payload);
        }
        DevicePanic { message }
    })
}

/// Whether a panic's message is the device runtime's: burn's execution errors, cubecl's server and memory errors,
/// or an out-of-memory in any runtime's words.
fn is_device_failure(message: &str) -> bool {
    const RUNTIME: [&str; 6] = [
        "an error happened during execution",
        "the device is poisoned",
        "an io error happened",
        "can't allocate buffer",
        "happened during launch",
        "the bytes were never written",
    ];
    let lower = message.to_ascii_lowercase();
    out_of_memory_in(&lower).is_some() || RUNTIME.iter().any(|needle| lower.contains(needle))
}

/// Whether a runtime's error text is an out-of-memory, and the bytes it asked for when it says.
///
/// cubecl types it (`IoError::OutOfMemory`: "out of device memory allocating N bytes"; `LaunchError::OutOfMemory`:
/// "An out-of-memory error happened during launch"), burn passes it on as text; drivers word it "out of memory".
pub fn out_of_memory_in(message: &str) -> Option<Option<u64>> {
    let lower = message.to_ascii_lowercase();
    let oom = ["out of device memory", "out-of-memory", "out of memory", "outofmemory", "error_out_of_device_memory"]
        .iter()
        .any(|needle| lower.contains(needle));
    if !oom {
        return None;
    }
    let requested = lower.split("allocating ").nth(1).and_then(|rest| {
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    });
    Some(requested)
}

fn classify(
    name: &DeviceName,
    operation: &'static str,
    message: &str,
    memory: Option<&dyn DeviceMemory>,
) -> ComponentError {
    // The runtime's text carries a backtrace after its first lines; the first lines are the message.
    let short: String = message.lines().take(3).collect::<Vec<_>>().join(" ");
    match out_of_memory_in(message) {
        Some(requested) => ComponentError::OutOfMemory {
            device: name.clone(),
            requested: requested.unwrap_or(0),
            available: memory.map_or(0, |m| m.available()),
        },
        None => ComponentError::Device { device: name.clone(), message: format!("during {operation}: {short}") },
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

    #[test]
    fn out_of_memory_is_recognised_in_the_runtimes_words_and_nothing_else_is() {
        assert_eq!(out_of_memory_in("out of device memory allocating 4096 bytes\nbacktrace"), Some(Some(4096)));
        assert_eq!(out_of_memory_in("An out-of-memory error happened during launch\nCaused by: x"), Some(None));
        assert_eq!(out_of_memory_in("CUDA_ERROR_OUT_OF_MEMORY: out of memory"), Some(None));
        assert_eq!(out_of_memory_in("A compilation error happened during launch"), None);
        assert_eq!(out_of_memory_in("The device is poisoned"), None);
    }

    #[test]
    fn a_failure_that_is_not_memory_is_a_device_error_never_an_out_of_memory() {
        let error = classify(&name(), "run", "The device is poisoned\nCaused by:\n  illegal address\nbt", None);
        match &error {
            ComponentError::Device { device, message } => {
                assert_eq!(device.as_str(), "wgpu:0");
                assert!(message.starts_with("during run: "), "{message}");
                assert!(message.contains("illegal address") && !message.contains("bt"), "{message}");
            }
            other => panic!("expected a device error, got {other:?}"),
        }
        assert!(!error.is_out_of_memory());
        let oom = classify(&name(), "upload", "out of device memory allocating 77 bytes", None);
        assert!(matches!(oom, ComponentError::OutOfMemory { requested: 77, available: 0, .. }), "{oom:?}");
    }

    #[test]
    fn a_runtime_panic_is_caught_with_its_message_and_a_bug_is_not() {
        let caught = catch_device_panic(|| -> u32 { panic!("out of device memory allocating 12 bytes") });
        let error = caught.expect_err("the panic is caught").with_device(&name(), "run", None);
        assert!(matches!(error, ComponentError::OutOfMemory { requested: 12, .. }), "{error:?}");
        let caught = catch_device_panic(|| -> u32 { panic!("An error happened during execution\nCaused by: x") });
        let error = caught.expect_err("the panic is caught").with_device(&name(), "run", None);
        assert!(matches!(error, ComponentError::Device { .. }), "{error:?}");
        assert_eq!(catch_device_panic(|| 5).expect("no panic"), 5);
        // A bug is not a device failure: it goes on unwinding.
        let bug = std::panic::catch_unwind(|| catch_device_panic(|| -> u32 { panic!("index out of bounds") }));
        assert!(bug.is_err(), "the bug's panic was not swallowed");
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
    fn the_cpu_backend_has_no_pool_to_read() {
        let error = PoolReadings::open(Device::flex(), DeviceName::cpu(), Some(1 << 30)).expect_err("flex has no pool");
        assert!(matches!(error, Error::NoPoolReadings { .. }), "{error:?}");
    }
}
