//! The readings of a cubecl device's memory: burn's pool, the driver's free memory where it has a call, the
//! sampler thread that keeps the peak, and the runtime's own capacity.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::ThreadId;
use std::time::Duration;

use burn::tensor::Device;
use offload_core::device::ReadingUnavailable;
use offload_core::offload_strategy::MemoryReading;
use offload_core::{DeviceMemory, DeviceName};
use parking_lot::Mutex;

#[cfg(feature = "wgpu")]
use super::open::wgpu_runtime_of;
use super::open::{NO_WORDS, PagePolicy, page_policy};
#[cfg(feature = "cuda")]
use super::open::{cuda_context, driver_words};
use crate::error::{Error, Result};

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
    /// Each stream's pages, where the runtime keeps a pool per stream (every cubecl runtime); empty otherwise.
    pub streams: StreamPools,
}

/// Each stream's pool in one reading. cubecl keeps a pool per stream (`cubecl-runtime` 0.11.3,
/// `Client::memory_report`: "Pools are per stream"), and by default a stream per thread that issues work, so what
/// one thread's allocations take (a call's activations) is told apart from another's (a worker's uploads). Holds
/// the first [`MAX`](Self::MAX) streams the runtime lists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamPools {
    len: usize,
    pools: [StreamPool; StreamPools::MAX],
}

/// One stream's pool in a reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamPool {
    /// The stream's id (burn's `StreamId`).
    pub stream: u64,
    /// Bytes of pages it holds: in use, padding and cache.
    pub reserved: u64,
    /// Bytes its live allocations use, their padding included.
    pub in_use: u64,
}

impl StreamPools {
    /// The most streams a reading keeps: a device object allocates on two (the computing thread's and its upload
    /// thread's), and a stream past the last is read as having no pool.
    pub const MAX: usize = 16;

    /// The first [`MAX`](Self::MAX) of `pools`.
    pub fn new(pools: impl IntoIterator<Item = StreamPool>) -> Self {
        let mut kept = Self::default();
        for (slot, pool) in kept.pools.iter_mut().zip(pools) {
            *slot = pool;
            kept.len += 1;
        }
        kept
    }

    /// `stream`'s pool; `None` where the reading lists no pool of it.
    pub fn get(&self, stream: u64) -> Option<StreamPool> {
        self.iter().find(|pool| pool.stream == stream)
    }

    /// Every pool the reading lists.
    pub fn iter(&self) -> impl Iterator<Item = StreamPool> + '_ {
        self.pools[..self.len].iter().copied()
    }

    /// Whether the reading lists no stream (a runtime without pools per stream).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The calling thread's stream (burn's `StreamId`, cubecl's): on a cubecl runtime its pool is where the thread's
/// allocations land.
pub fn current_stream() -> u64 {
    burn::tensor::StreamId::current().value
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

pub(super) struct PoolState {
    pub(super) device: Device,
    pub(super) name: DeviceName,
    /// The device's capacity, from the driver, the caller or the runtime.
    pub(super) total: u64,
    /// Where `total` came from.
    pub(super) total_source: TotalSource,
    /// Whether each allocation has a page of its own ([`PagePolicy::Exclusive`]).
    pub(super) exclusive_pages: bool,
    pub(super) driver: Driver,
    pub(super) peak: AtomicU64,
    pub(super) reserved_peak: AtomicU64,
    /// The open call windows: one per thread running a capped call ([`PoolReadings::begin_window`]) and one per
    /// token of [`DeviceMemory::open_call_window`], each with the highest readings since it opened.
    pub(super) windows: Mutex<HashMap<WindowKey, CallWindow>>,
    /// The next token [`DeviceMemory::open_call_window`] hands out.
    pub(super) next_token: AtomicU64,
    pub(super) stop: AtomicBool,
}

/// Who a call window belongs to: a thread (a capped device's call) or a token (a component measuring its call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum WindowKey {
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
    /// The pages of the opening thread's stream when the window opened and when it closed, for a window a thread
    /// opened and closed ([`PoolReadings::begin_window`], [`PoolReadings::end_window`]) on a runtime that keeps
    /// a pool per stream.
    pub stream: Option<(u64, u64)>,
}

impl CallWindow {
    /// The pages the window's own stream took from the device while it was open: what the call needed beyond the
    /// cache its stream already held, which the other streams' allocations meanwhile (a worker's uploads) do not
    /// reach. `None` where the runtime keeps no pool per stream. A stream's pages only grow until its cache is
    /// released, so the last reading is their high-water unless a cleanup of that stream came in between (then it
    /// reads less).
    pub fn stream_pages(&self) -> Option<u64> {
        self.stream.map(|(start, end)| end.saturating_sub(start))
    }
}

pub(super) enum Driver {
    None,
    #[cfg(feature = "cuda")]
    Cuda(Arc<cudarc::driver::CudaContext>),
}

impl Driver {
    /// The driver of the device `name`: CUDA's for a `cuda` device, whose context must open (a failure is the
    /// driver's, typed, never read as a device without a driver); none for the others.
    pub(super) fn for_device(name: &DeviceName) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if name.kind() == "cuda" {
            return Ok(Driver::Cuda(cuda_context(name)?));
        }
        let _ = name;
        Ok(Driver::None)
    }

    /// `(free, total)` from the driver: `Ok(None)` where there is no driver call, the driver's failure in its own
    /// words where the call failed (what other processes hold is then unknown, never taken as nothing).
    pub(super) fn memory(&self) -> std::result::Result<Option<(u64, u64)>, DriverFailure> {
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
pub(super) struct DriverFailure {
    pub(super) code: String,
    pub(super) words: Option<String>,
}

impl DriverFailure {
    /// What a reading says when the driver's free-memory call failed.
    pub(super) fn unread(&self, device: &DeviceName) -> ReadingUnavailable {
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
/// opens: [`open_device`](super::open_device)); Metal's recommended working set on Apple. `None` for a runtime or driver that reports
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
        match (cubecl, wgpu_runtime_of(device)) {
            (Some(total), _) => Ok(total),
            (None, Some(runtime)) => runtime.heap.clone(),
            (None, None) => Err("the runtime states no capacity for this device".into()),
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
        match wgpu_runtime_of(device) {
            Some(runtime) => runtime.budget.clone(),
            None => Err("the device is not a wgpu device this library opened".into()),
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
    pub(super) fn snapshot(&self) -> std::result::Result<PoolSnapshot, ReadingUnavailable> {
        let pools = self.pools().ok_or_else(|| ReadingUnavailable {
            device: self.name.clone(),
            message: "burn's memory_pool_usage gave no answer for the device's pool".into(),
        })?;
        let (driver_free, total) = match self.driver.memory().map_err(|failure| failure.unread(&self.name))? {
            Some((free, total)) => (Some(free), total),
            None => (None, self.total),
        };
        Ok(PoolSnapshot { total, driver_free, ..pools })
    }

    /// The device's pools (the snapshot's pool fields, the rest left at zero): on a cubecl device the runtime's
    /// memory report, every stream's pool summed (what burn's `memory_pool_usage` reads) beside each stream's
    /// pages, from one report; burn's reading, with no streams, otherwise.
    fn pools(&self) -> Option<PoolSnapshot> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        #[allow(irrefutable_let_patterns)]
        if let burn_dispatch::DispatchDevice::Cube(cube) = self.device.as_dispatch() {
            let report = cube.client().memory_report(burn::cubecl::MemoryScope::Device);
            let streams = StreamPools::new(report.streams.iter().map(|stream| {
                let usage = stream.usage();
                let (stream, reserved) = (stream.stream.value, usage.bytes_reserved);
                StreamPool { stream, reserved, in_use: usage.bytes_in_use + usage.bytes_padding }
            }));
            let usage = report.usage();
            return Some(PoolSnapshot {
                in_use: usage.bytes_in_use,
                padding: usage.bytes_padding,
                reserved: usage.bytes_reserved,
                streams,
                ..PoolSnapshot::default()
            });
        }
        let usage = self.device.memory_pool_usage()?;
        Some(PoolSnapshot {
            in_use: usage.bytes_in_use,
            padding: usage.bytes_padding,
            reserved: usage.bytes_reserved,
            ..PoolSnapshot::default()
        })
    }

    /// Reads the pool and counts the reading in the peaks and every open window. The reading is taken under the
    /// windows' lock, so a reading the sampler took before a window opened (or a peak was reset) can never be
    /// counted in it. A failed reading changes nothing.
    pub(super) fn observe(&self) -> std::result::Result<PoolSnapshot, ReadingUnavailable> {
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

/// The memory readings of a real burn device, from its pool and its driver; see the [module docs](crate::device).
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
        let own = start.streams.get(current_stream()).map(|pool| pool.reserved);
        let stream = own.map(|pages| (pages, pages));
        let window = CallWindow { start, high_in_use: start.in_use, high_reserved: start.reserved, stream };
        windows.insert(WindowKey::Thread(std::thread::current().id()), window);
        Ok(start)
    }

    /// Closes this thread's call window, with a last reading taken now (its stream's pages too). `Ok(None)` when no
    /// window was open; when the last reading fails the window is closed and the failure returned, since its
    /// high-water is not known.
    pub fn end_window(&self) -> std::result::Result<Option<CallWindow>, ReadingUnavailable> {
        let last = self.state.observe();
        let mut window = self.state.windows.lock().remove(&WindowKey::Thread(std::thread::current().id()));
        let last = last?;
        if let Some(window) = &mut window {
            let own = last.streams.get(current_stream()).map(|pool| pool.reserved);
            window.stream = window.stream.zip(own).map(|((start, _), end)| (start, end));
        }
        Ok(window)
    }
}

pub(super) fn sample(state: &Weak<PoolState>, interval: Duration) {
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
        let window = CallWindow { start, high_in_use: start.in_use, high_reserved: start.reserved, stream: None };
        windows.insert(WindowKey::Token(token), window);
        Ok(Some(token))
    }

    fn close_call_window(&self, token: u64) -> std::result::Result<Option<u64>, ReadingUnavailable> {
        let last = self.state.observe();
        let window = self.state.windows.lock().remove(&WindowKey::Token(token));
        last.map(|_| window.map(|w| w.high_reserved.saturating_sub(w.start.reserved)))
    }
}
