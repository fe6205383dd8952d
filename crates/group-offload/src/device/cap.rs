//! A smaller card over a real device ([`CappedDevice`]): the cap, and its account of pages and reservations.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::ThreadId;

use offload_core::device::ReadingUnavailable;
use offload_core::offload_strategy::MemoryReading;
use offload_core::{ComponentError, DeviceLedger, DeviceMemory, DeviceName, format_size};
use parking_lot::Mutex;

use super::pool::{PoolReadings, PoolSnapshot};

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
    /// began): measured, every stream's (a worker's uploads meanwhile included).
    pub measured_pages: u64,
    /// The pages the call's own stream took from the device
    /// ([`CallWindow::stream_pages`](crate::device::CallWindow::stream_pages)): measured, where the runtime keeps
    /// a pool per stream.
    pub stream_pages: Option<u64>,
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
/// seen at each reading under the lock goes to the pending uploads first, then to the calls' estimates, the oldest
/// first in each: [`settle`](Self::settle)), or until the thread that made it goes on (each thread makes one
/// upload at a time, so its next call on the ledger means its last upload is on the device or failed; a call's
/// estimate is pending until its call ends). Growth is device-wide, so it can be credited to the wrong
/// reservation; the floor (never less than the reservations themselves) keeps a misattribution from charging less
/// than the account holds. (Credited to its own stream's reservations only, growth misses the allocations that
/// reuse a stream's cache, and the account held far more than the device: measured in `docs/devices.md`.)
#[derive(Debug, Default)]
pub(super) struct Account {
    /// Pages of what the library placed on the device (component onloads, group uploads), in the page rule.
    pub(super) placed: u64,
    /// Per thread running a call: the pages of its activation estimate, reserved until the call ends.
    pub(super) calls: HashMap<ThreadId, u64>,
    /// The reservations the pool does not show yet, oldest first.
    pub(super) pending: Vec<Pending>,
    /// The pool's pages at the last reading taken under the account's lock.
    pub(super) seen: Option<u64>,
    /// The last call's reconciliation.
    pub(super) last_call: Option<CallCharge>,
    /// The most the account held at once: its own high-water, never over the cap in hard mode.
    pub(super) high_water: u64,
}

/// A reservation the pool does not show yet: who made it and what of it is still to come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pending {
    pub(super) thread: ThreadId,
    /// A call's estimate (`true`) or an upload's tensors.
    pub(super) call: bool,
    pub(super) pages: u64,
}

impl Account {
    /// Everything reserved: the placements and the estimates of the calls in flight.
    pub(super) fn reserved(&self) -> u64 {
        self.calls.values().fold(self.placed, |sum, &bytes| sum.saturating_add(bytes))
    }

    /// The reservations not yet allocated.
    pub(super) fn pending(&self) -> u64 {
        self.pending.iter().fold(0u64, |sum, p| sum.saturating_add(p.pages))
    }

    /// Takes a reading of the pool: what its pages grew by since the last one is allocated, and goes to the pending
    /// uploads first, then to the calls' estimates, the oldest first in each. A pool that shrank (its cache
    /// released) allocated nothing.
    ///
    /// Uploads first: an upload is made at once and whole (its thread waits for it before it goes on), where a
    /// call allocates over its whole run, and often less than its estimate. Credited to an older call's estimate,
    /// an upload's pages were then dropped as made when its thread went on, and the call's estimate was gone from
    /// the account while the call ran: the worker was granted that room, and the call's end found the cap passed.
    pub(super) fn settle(&mut self, now: &PoolSnapshot) {
        let mut grown = self.seen.map_or(0, |seen| now.reserved.saturating_sub(seen));
        self.seen = Some(now.reserved);
        for calls in [false, true] {
            for pending in self.pending.iter_mut().filter(|p| p.call == calls) {
                let made = pending.pages.min(grown);
                pending.pages -= made;
                grown -= made;
            }
        }
        self.pending.retain(|p| p.pages > 0);
    }

    /// What counts against the cap with the pool reading `now` (see the type's docs).
    pub(super) fn charged(&self, now: &PoolSnapshot) -> u64 {
        let in_pool = now.reserved.saturating_add(self.pending()).max(self.reserved());
        now.outside_pool().saturating_add(in_pool)
    }

    /// `thread` goes on: its last upload is on the device, or failed and was given back.
    pub(super) fn goes_on(&mut self, thread: ThreadId) {
        self.pending.retain(|p| p.thread != thread || p.call);
    }

    /// Reserves an upload of `pages` on `thread`, pending until the pool shows it.
    pub(super) fn place(&mut self, thread: ThreadId, pages: u64) {
        self.goes_on(thread);
        self.placed = self.placed.saturating_add(pages);
        self.pending.push(Pending { thread, call: false, pages });
    }

    /// Gives back `pages` of placements, on `thread`.
    pub(super) fn unplace(&mut self, thread: ThreadId, pages: u64) {
        self.goes_on(thread);
        self.placed = self.placed.saturating_sub(pages);
    }

    /// Reserves a call's estimate of `pages` on `thread`, pending until the pool shows it or the call ends.
    pub(super) fn begin_call(&mut self, thread: ThreadId, pages: u64) {
        // Its last upload is made, and a thread runs one call at a time.
        self.pending.retain(|p| p.thread != thread);
        self.calls.insert(thread, pages);
        self.pending.push(Pending { thread, call: true, pages });
    }

    /// Ends `thread`'s call: its estimate is given back, whatever of it was not allocated too. Returns the estimate.
    pub(super) fn end_call(&mut self, thread: ThreadId) -> u64 {
        self.pending.retain(|p| p.thread != thread);
        self.calls.remove(&thread).unwrap_or(0)
    }
}

/// A card of `capacity` bytes imposed over a real device's readings; see the [module docs](crate::device).
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

    pub(super) fn out_of_memory(&self, requested: u64, available: u64) -> ComponentError {
        tracing::debug!(
            card = %self.label,
            requested = %format_size(requested),
            available = %format_size(available),
            "the cap over the real device refused an allocation"
        );
        ComponentError::OutOfMemory { device: self.readings.device(), requested, available }
    }

    pub(super) fn unreadable(&self, unknown: ReadingUnavailable) -> ComponentError {
        ComponentError::Device { device: unknown.device.clone(), message: format!("during a reservation: {unknown}") }
    }

    /// Checks `pages` against the cap and reserves them with `take`, in one critical section.
    pub(super) fn reserve(
        &self,
        pages: u64,
        take: impl FnOnce(&mut Account),
    ) -> std::result::Result<(), ComponentError> {
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
pub(super) enum Refusal {
    /// The cap cannot hold it.
    Full { requested: u64, free: u64 },
    /// The pool could not be read, so nothing is known of what the device holds.
    Unreadable(ReadingUnavailable),
}

/// What a cap of `capacity` can still give with `account` and the pool reading `now`: the cap less what counts
/// against it ([`Account::charged`]: what is outside the pool, the pool's pages and the reservations not yet
/// allocated), and never more than the device itself can give.
pub(super) fn free_under(capacity: u64, now: &PoolSnapshot, account: &Account) -> u64 {
    capacity.saturating_sub(account.charged(now)).min(now.available())
}

/// The check and the reservation in one critical section: the account's lock is held from the reading to the
/// reservation, so two threads can never both pass on the same free bytes. When the pool's pages leave too little
/// and some of them are its cache, the cache is released (`release`) and the pool read again before the request
/// is refused, as torch's caching allocator empties its cache before it raises under a per-process memory
/// fraction.
pub(super) fn reserve_in(
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
    pub(super) fn try_available(&self) -> std::result::Result<u64, ReadingUnavailable> {
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
        let stream_pages = window.stream_pages();
        self.account.lock().last_call = Some(CallCharge { reserved, measured_pages, stream_pages });
        if !self.hard || start.outside_pool() + window.high_reserved <= self.capacity {
            return Ok(());
        }
        let requested = measured_pages + start.cache();
        Err(self.out_of_memory(requested, start.available_under(self.capacity)))
    }
}
