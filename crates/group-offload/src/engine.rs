//! The engine under every part: the group table, the capture of the call order, the prefetch worker thread,
//! and the accounting (ledger, record, statistics) of every move.
//!
//! # Locking
//!
//! One mutex guards the table (residency, users, order, statistics); a condition variable wakes callers waiting
//! for an in-flight prefetch. The lock is never held across a ledger call or an upload: those can sleep (a slow
//! simulated link) or take milliseconds (a real copy), and the worker must be able to publish while the caller
//! computes.
//!
//! # Residency of a group
//!
//! `Offloaded` (only the host copy) → `Loading` (an upload in flight, on the worker or the caller) →
//! `OnDevice` (device tensors held by the engine; `users` counts the guards borrowing them). A release with no
//! users left offloads the group unless it is kept (resident part, or within the resident budget) or is among
//! the next groups to run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use burn::tensor::{Device, TensorData};
use offload_core::link::{DiskSample, LinkSample};
use offload_core::timeline::category;
use offload_core::{Action, ComponentError, DeviceName, Direction, FileRead, OffloadEvent, Reason, Refusals};
use parking_lot::{Condvar, Mutex};

use crate::config::{GroupOffloadConfig, PeerDonor};
use crate::device::{catch_device_panic, check_device, check_outputs};
use crate::error::{Error, Result};
use crate::store::{DonorCopy, GroupHost, HostReadError};
use crate::uploads::{DeviceTensor, Task, serve};

/// Counters of one offloader since it was built. Read them with [`GroupOffload::stats`](crate::parts::GroupOffload::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Uploads made on the calling thread, blocking it: every upload of the capture pass, every upload with
    /// prefetch off, and every miss.
    pub onloads: u64,
    /// Uploads handed to the prefetch worker.
    pub prefetches: u64,
    /// Groups found on the device, already prefetched, when they were taken.
    pub prefetch_hits: u64,
    /// Groups still in flight on the worker when they were taken; the caller waited for them.
    pub prefetch_waits: u64,
    /// Synchronous uploads after the capture with prefetch on: the order diverged or the group was new.
    pub misses: u64,
    /// Prefetches refused for lack of device memory or failed otherwise (an upload that panicked); each is a
    /// `prefetch_refused` or `prefetch_failed` row in the record, and the group was loaded when taken.
    pub failed_prefetches: u64,
    /// Prefetched groups dropped before anyone took them (the order diverged).
    pub unused_prefetches: u64,
    /// Groups dropped from the device.
    pub offloads: u64,
    /// Parameters loaded one by one because a model touched a parameter outside the groups it had taken.
    pub stray_loads: u64,
    /// Groups first seen after the capture and inserted into the order.
    pub order_inserts: u64,
    /// Bytes uploaded, synchronously or by prefetch.
    pub bytes_onloaded: u64,
    /// Bytes dropped from the device.
    pub bytes_offloaded: u64,
}

/// The link rate of a set of uploads: [`offload_core::link::LinkRate`], kept here under its old path.
pub use offload_core::link::LinkRate;

enum Residency {
    Offloaded,
    /// An upload in flight. `placed` turns true once the group's memory is taken on the device (a prefetch's,
    /// [`Shared::upload`]'s `placed` callback), though its copies may still be running: a release waits for the
    /// prefetches of the window to be placed before it lets its own group go ([`Engine::release`]).
    Loading {
        placed: bool,
    },
    OnDevice(Arc<[DeviceTensor]>),
}

struct GroupSlot {
    host: Arc<GroupHost>,
    residency: Residency,
    users: usize,
    /// Stays on the device when released (a resident part, or kept within the resident budget).
    kept: bool,
    /// On the device (or in flight) because of a prefetch, not yet taken.
    prefetched: bool,
    /// Belongs to a resident part: kept from registration, counted in the resident bytes.
    resident_part: bool,
    /// Chosen when it was added to stay on the device once released: a resident part, or a streamed group within
    /// the resident budget (the first registered that fit it: [`GroupOffloadConfig::resident_budget`]).
    stays: bool,
}

struct State {
    groups: Vec<GroupSlot>,
    /// The captured call sequence; a group called twice per forward appears twice.
    order: Vec<usize>,
    /// Index in `order` of the last call.
    cursor: Option<usize>,
    capturing: bool,
    stats: GroupStats,
    /// The first parameters loaded outside their groups (at most [`STRAYS_KEPT`]), for the streaming check.
    strays: Vec<String>,
    /// The first stray load that could not read its host copy since the last call ended (the disk file vanished,
    /// the checkpoint file was truncated), as the error the call returns.
    stray_failure: Option<Error>,
    /// Whether the warning of a capture past [`CAPTURE_LIMIT`] was given.
    capture_warned: bool,
    /// The prefetches refused or failed since the last forward reported them ([`Engine::take_refusals`]).
    refusals: Refusals,
}

/// How many stray parameters' names the engine keeps.
const STRAYS_KEPT: usize = 16;

/// Takes per group after which a capture that no `run` has ended is taken for a usage error: the engine warns once
/// and the order stops growing (a forward that takes each of its groups more often than this is not expected).
const CAPTURE_LIMIT: usize = 64;

impl State {
    /// Bookkeeping of one call. During the capture the call is appended; the capture ends when the first forward
    /// returns ([`GroupOffload::run`](crate::parts::GroupOffload::run)) or at `end_capture`. After it, a call that is not the expected next one is learnt: a group
    /// the capture never saw is inserted after the previous call; a known one moves the cursor to its next
    /// occurrence.
    fn note_call(&mut self, group: usize, model: &str) {
        if self.capturing {
            // Every take of the first forward is a step, repeats included: a part taken twice is two steps.
            if self.order.len() >= CAPTURE_LIMIT * self.groups.len().max(1) {
                // Parts driven without `GroupOffload::run` (or `end_capture`) never end the capture, so nothing
                // is prefetched; the order stops growing here rather than by one step a take for ever.
                if !self.capture_warned {
                    self.capture_warned = true;
                    tracing::warn!(
                        model,
                        takes = self.order.len(),
                        "group offload is still capturing its call order after {CAPTURE_LIMIT} takes per group: \
                         if its forwards are not wrapped in GroupOffload::run (ModelHandle::run does), nothing is \
                         prefetched; wrap each forward in it, or call GroupOffload::end_capture after the first. A \
                         forward that takes its groups this often is captured up to here"
                    );
                }
                return;
            }
            self.order.push(group);
            self.cursor = Some(self.order.len() - 1);
            return;
        }
        let len = self.order.len();
        let expected = self.cursor.map_or(0, |c| (c + 1) % len.max(1));
        if self.order.get(expected) == Some(&group) {
            self.cursor = Some(expected);
            return;
        }
        // The capture holds the whole first forward, repeats included, so a known group taken out of turn is a
        // jump in the order (a skipped branch), never a step to learn; only a group the capture never saw is.
        let known = self.order.contains(&group);
        if !known {
            let at = self.cursor.map_or(len, |c| c + 1);
            self.order.insert(at, group);
            self.cursor = Some(at);
            self.stats.order_inserts += 1;
            tracing::debug!(model, group = %self.groups[group].host.id, "call order learnt a new step");
        } else {
            let start = self.cursor.map_or(0, |c| c + 1);
            let next = (0..len).map(|i| (start + i) % len).find(|i| self.order[*i] == group);
            self.cursor = next;
        }
    }

    /// The next `depth` groups after the cursor in the captured sequence, wrapping into the next forward, leaving
    /// out kept groups already on the device (they need no prefetch).
    fn window(&self, depth: usize) -> Vec<usize> {
        let Some(cursor) = self.cursor else { return Vec::new() };
        let len = self.order.len();
        let mut out = Vec::with_capacity(depth);
        for i in 1..=len {
            if out.len() == depth {
                break;
            }
            let next = self.order[(cursor + i) % len];
            let slot = &self.groups[next];
            if slot.kept && matches!(slot.residency, Residency::OnDevice(_)) {
                continue;
            }
            if !out.contains(&next) {
                out.push(next);
            }
        }
        out
    }
}

pub(crate) struct Shared {
    pub config: GroupOffloadConfig,
    state: Mutex<State>,
    changed: Condvar,
    /// Set when the engine is dropped: a prefetch still queued on the device's shared upload thread is then
    /// skipped, not uploaded for a model that is gone.
    closed: AtomicBool,
    /// What is left of the configuration's RAM budget for reads kept in host memory
    /// ([`GroupOffloadConfig::ram_budget`], [`GroupOffloadConfig::ram_groups`]).
    ram_left: Room,
    /// What is left of each donor's budget ([`GroupOffloadConfig::donors`]), in their order.
    donor_left: Vec<Room>,
}

/// One place's room for groups (the pinned budget, the RAM budget, a donor's): the bytes left and, where a plan gave
/// them, the sizes of the groups it still takes, one each. Groups of one size cost the same anywhere, so a place
/// given the sizes the plan's search put there keeps that placement whichever groups of those sizes come first.
#[derive(Debug)]
pub(crate) struct Room {
    left: AtomicU64,
    slots: Option<Mutex<Vec<u64>>>,
}

impl Room {
    /// A room of `budget` bytes, taking only groups of `sizes` where given.
    pub(crate) fn new(budget: u64, sizes: Option<Vec<u64>>) -> Self {
        Self { left: AtomicU64::new(budget), slots: sizes.map(Mutex::new) }
    }

    /// Takes a group of `bytes` where the budget has room and, with sizes, one of its size is open.
    pub(crate) fn take(&self, bytes: u64) -> bool {
        let mut slots = self.slots.as_ref().map(|slots| slots.lock());
        let slot = match slots.as_deref() {
            Some(open) => match open.iter().position(|&size| size == bytes) {
                Some(at) => Some(at),
                None => return false,
            },
            None => None,
        };
        if self.left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| left.checked_sub(bytes)).is_err() {
            return false;
        }
        if let (Some(open), Some(at)) = (slots.as_mut(), slot) {
            open.swap_remove(at);
        }
        true
    }

    /// Gives back a group of `bytes` it took (nothing for 0).
    pub(crate) fn give(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.left.fetch_add(bytes, Ordering::AcqRel);
        if let Some(slots) = &self.slots {
            slots.lock().push(bytes);
        }
    }
}

/// One prefetch, from the moment its group is marked `Loading` until it is published. Whatever happens to it, its
/// group leaves `Loading`: [`run_job`] publishes it, and a job dropped unpublished (left in a channel whose thread
/// ended, refused by a closed channel, or unwound by a panic outside its upload, whose own panics are its failure)
/// puts the group back to offloaded, records a failed prefetch and wakes its waiters, so that no caller waits for
/// ever on a group that will not arrive. A job is never dropped under the state lock: [`Engine::schedule`] returns
/// the jobs, and they are sent after the lock is released.
struct Job {
    shared: Arc<Shared>,
    group: usize,
    host: Arc<GroupHost>,
    published: bool,
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.published {
            return;
        }
        self.shared.give_back(self.group, false, true);
    }
}

/// Where an engine's prefetches run.
enum Worker {
    /// A thread of the engine's own, ended with it: burn's CPU backend, which has no streams (the simulated
    /// card's link is paced per model on it).
    Own { jobs: mpsc::Sender<Job>, thread: JoinHandle<()> },
    /// The device's one upload thread, shared by every engine on that device for the life of the process: on a
    /// cubecl runtime a thread is a stream with pools of its own, and a new stream sizes its first pages far
    /// above small tensors (see [`UploadThread`](crate::uploads::UploadThread)), so a thread per model and per load paid that again each
    /// time.
    Device(mpsc::Sender<Task>),
}

/// The engine: shared state plus the worker thread that owns the prefetch stream.
pub(crate) struct Engine {
    pub shared: Arc<Shared>,
    worker: Mutex<Option<Worker>>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        match self.worker.lock().take() {
            // Closing the channel ends the worker's loop; joining waits for an upload in flight.
            Some(Worker::Own { jobs, thread }) => {
                drop(jobs);
                let _ = thread.join();
            }
            // The shared thread lives on: the prefetches still queued are skipped, and the one in flight is
            // waited for, so no upload of this model outlives it.
            Some(Worker::Device(_)) => {
                self.shared.closed.store(true, Ordering::Release);
                self.wait_idle();
            }
            None => {}
        }
    }
}

/// What an upload reserved on the ledger ([`Shared::upload_bytes`]): freed when dropped, unless the upload
/// succeeded and [`keep`](Self::keep)s it for the group now on the device.
struct Reservation<'a> {
    ledger: &'a dyn offload_core::DeviceLedger,
    sizes: &'a [u64],
    kept: bool,
}

impl Reservation<'_> {
    /// The group holds what was reserved; it is freed when the group leaves the device.
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.ledger.free_tensors(self.sizes);
        }
    }
}

impl Shared {
    /// Puts a `Loading` group whose upload will not publish back to offloaded and wakes its waiters: for a
    /// prefetch dropped unpublished ([`Job`], also counted as failed) and a synchronous upload that unwound
    /// ([`GivesBackOnUnwind`], which also lets go of its caller's use when `user`). Takes the lock.
    fn give_back(&self, group: usize, user: bool, prefetch: bool) {
        let mut state = self.state.lock();
        let slot = &mut state.groups[group];
        if matches!(slot.residency, Residency::Loading { .. }) {
            slot.residency = Residency::Offloaded;
        }
        if user {
            slot.users = slot.users.saturating_sub(1);
        }
        if prefetch {
            slot.prefetched = false;
            let host = slot.host.clone();
            state.stats.failed_prefetches += 1;
            // A prefetch that never ran (its worker gone) is a failed one, shown as those that ran and failed.
            let refusal = self.refusal(&host, Reason::PrefetchFailed, None);
            state.refusals.add(&refusal);
            self.record_event(refusal);
            tracing::error!(
                group = %host.id,
                "a prefetch was dropped before it ran (its worker is gone); the group will be loaded when it is taken"
            );
        }
        self.changed.notify_all();
    }

    /// A prefetch's group has its memory on the device ([`Residency::Loading`]'s `placed`): wakes a release that
    /// waits for it. Takes the lock.
    fn mark_placed(&self, group: usize) {
        let mut state = self.state.lock();
        if let Residency::Loading { placed } = &mut state.groups[group].residency {
            *placed = true;
        }
        self.changed.notify_all();
    }

    /// The record's event for a prefetch of `host` that was refused or failed (`why`), on `reading`.
    fn refusal(
        &self,
        host: &GroupHost,
        why: Reason,
        reading: Option<offload_core::offload_strategy::MemoryReading>,
    ) -> OffloadEvent {
        OffloadEvent {
            action: Action::Refused,
            id: host.id.clone(),
            bytes: host.bytes,
            reason: Some(why),
            available: reading.map(|r| r.available),
            peak: reading.map(|r| r.peak),
            read: None,
            from_peer: None,
        }
    }

    fn record_event(&self, event: OffloadEvent) {
        if let Some(record) = &self.config.record {
            record.add(event);
        }
    }

    fn record(&self, action: Action, id: &str, bytes: u64, reason: Reason) {
        let reading = self.config.device.memory().as_ref().map(|m| m.reading());
        self.record_with(action, id, bytes, reason, reading);
    }

    /// Records a move with a reading taken earlier (just before the move started).
    fn record_with(
        &self,
        action: Action,
        id: &str,
        bytes: u64,
        reason: Reason,
        reading: Option<offload_core::offload_strategy::MemoryReading>,
    ) {
        let Some(record) = &self.config.record else { return };
        record.add(OffloadEvent {
            action,
            id: id.to_string(),
            bytes,
            reason: Some(reason),
            available: reading.map(|r| r.available),
            peak: reading.map(|r| r.peak),
            read: None,
            from_peer: None,
        });
    }

    fn onload_error(&self, host: &GroupHost, source: ComponentError) -> Error {
        Error::Onload {
            group: host.id.clone(),
            bytes: host.bytes,
            device: self.config.device.name().to_string(),
            source,
        }
    }

    /// One upload: allocate on the ledger, pay the transfer, build the device tensors. Called without the lock.
    /// On any failure nothing stays allocated and the host copy is untouched. `placed` is called once the group's
    /// memory is taken on the device, before the copies are checked: on a runtime that pages (a cubecl device)
    /// once its tensors are built in the runtime's pool, elsewhere once the ledger holds them (the ledger is then
    /// the device's account, and a simulated link's transfer time comes after).
    fn upload(&self, host: &GroupHost, reason: Reason, placed: &dyn Fn()) -> Result<Arc<[DeviceTensor]>> {
        // The reading is taken before the move and the event recorded once it succeeded, as the manager does,
        // so a failed upload leaves no onload row for a group that never arrived.
        let reading = self.config.device.memory().as_ref().map(|m| m.reading());
        // The span is recorded on this thread: the caller's for a synchronous upload, the worker's for a prefetch.
        let mut span = self
            .config
            .timeline
            .span(category::UPLOAD, &host.id)
            .arg("bytes", host.bytes)
            .arg("reason", reason.to_string());
        let prefetch = reason == Reason::Prefetch;
        let result = if prefetch {
            // A prefetch runs on a worker thread that serves every engine on the device: a panic in it (past the
            // device's own guards: a ledger's, a host read's) is this prefetch's failure, typed, and the thread goes
            // on. What it reserved was given back as it unwound ([`Reservation`]).
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.upload_bytes(host, reason.clone(), reading, placed)
            }))
            .unwrap_or_else(|payload| {
                Err(Error::UploadPanicked {
                    what: format!("the prefetch of group {}", host.id),
                    device: self.config.device.name().to_string(),
                    message: crate::device::panic_text(payload.as_ref()),
                })
            })
        } else {
            self.upload_bytes(host, reason, reading, placed)
        };
        if let Err(error) = &result {
            span.set_arg("error", error.to_string());
            if prefetch {
                // A refused prefetch is a row of the record with the reading it was refused on, never only a
                // counter: the group will be loaded when its forward takes it, its copy no longer hidden.
                let why = if error.is_out_of_memory() { Reason::PrefetchRefused } else { Reason::PrefetchFailed };
                let refusal = self.refusal(host, why, reading);
                self.state.lock().refusals.add(&refusal);
                self.record_event(refusal);
            }
        }
        drop(span);
        if let Some(memory) = self.config.device.memory() {
            self.config.timeline.sample_memory(memory.as_ref());
        }
        result
    }

    /// Samples donor `donor`'s memory on the timeline (its own counter track, `device memory cuda:1`), where it has
    /// readings: the trace and the memory plot show what it holds beside the execution device.
    fn sample_donor(&self, donor: usize) {
        if let Some(memory) = self.config.donors.get(donor).and_then(|donor| donor.device.memory().as_ref()) {
            self.config.timeline.sample_memory(memory.as_ref());
        }
    }

    /// Copies a group just uploaded from the host onto the first donor whose budget has room for it and whose ledger
    /// takes it, in the donors' order: later uploads copy it from there. A resident group (uploaded once), a
    /// quantized one and a pinned one stay with the host (a pinned host copy is the host's fastest; the pinned
    /// budget and the donors' are places of their own, as a plan gives them); a group no donor takes (each full, or
    /// its card refusing the allocation) keeps streaming from the host.
    fn place_on_donor(&self, host: &GroupHost, tensors: &[DeviceTensor]) {
        let resident = self.stays(host);
        if resident || host.pinned || tensors.iter().any(DeviceTensor::is_quantized) {
            return;
        }
        for (index, donor) in self.config.donors.iter().enumerate() {
            if self.copy_to_donor(index, donor, host, tensors) {
                self.sample_donor(index);
                // Its uploads come from the donor now: a read kept in RAM for it goes back to the RAM budget.
                self.forget_read(host);
                tracing::debug!(group = %host.id, bytes = host.bytes, donor = %donor.device.name(), "group kept on a donor");
                return;
            }
        }
    }

    /// Copies `tensors` onto donor `index` where its budget has room and its ledger takes them, keeping the copy as
    /// the group's; whether it did.
    fn copy_to_donor(&self, index: usize, donor: &PeerDonor, host: &GroupHost, tensors: &[DeviceTensor]) -> bool {
        let bytes = host.bytes;
        let left = &self.donor_left[index];
        if !left.take(bytes) {
            return false;
        }
        let ledger = donor.device.ledger().clone();
        let sizes = host.tensor_sizes();
        let placed = ledger.allocate_tensors(&sizes).and_then(|()| {
            ledger.transfer_from_peer(bytes, donor.seconds(bytes)).inspect_err(|_| ledger.free_tensors(&sizes))
        });
        let copied = placed.ok().and_then(|()| {
            let on_donor = catch_device_panic(|| {
                tensors.iter().map(|t| t.to_device(donor.device.exec())).collect::<std::result::Result<Vec<_>, _>>()
            });
            match on_donor {
                Ok(Ok(tensors)) => Some(tensors),
                _ => {
                    ledger.free_tensors(&sizes);
                    None
                }
            }
        });
        match copied {
            Some(tensors) => {
                host.keep_on_donor(DonorCopy { donor: index, tensors, ledger, sizes });
                true
            }
            None => {
                left.give(bytes);
                false
            }
        }
    }

    /// Whether `host`'s group stays on the device once released (a resident part's, or one chosen within the
    /// resident budget): it is uploaded once, so it takes no room on a donor or in the RAM budget.
    fn stays(&self, host: &GroupHost) -> bool {
        self.state.lock().groups.iter().any(|g| std::ptr::eq(Arc::as_ptr(&g.host), host) && g.stays)
    }

    /// Keeps the read a group's upload just made from its files in host memory, where the RAM budget has room for
    /// it: later uploads copy it instead of reading the files.
    fn keep_read(&self, host: &GroupHost, data: &[TensorData]) {
        // A resident part, or a group chosen to stay resident, is uploaded once and never read again.
        if self.stays(host) {
            return;
        }
        // Counted in the group's bytes on the device, the unit of the plan's budget and sizes (a file tensor the
        // device holds in another dtype reads other bytes).
        if self.ram_left.take(host.bytes) {
            let bytes = host.keep_read(data);
            tracing::debug!(group = %host.id, bytes, "read kept in host memory within the RAM budget");
        }
    }

    /// Drops the read `host` kept in host memory, if any, and gives its room back to the RAM budget.
    fn forget_read(&self, host: &GroupHost) {
        if host.forget_read() > 0 {
            self.ram_left.give(host.bytes);
        }
    }

    /// The upload itself: allocate on the ledger, pay the transfer, build and check the device tensors.
    fn upload_bytes(
        &self,
        host: &GroupHost,
        reason: Reason,
        reading: Option<offload_core::offload_strategy::MemoryReading>,
        placed: &dyn Fn(),
    ) -> Result<Arc<[DeviceTensor]>> {
        let ledger = self.config.device.ledger().as_ref();
        let pages = crate::device::defers_failures(self.config.device.exec());
        // One allocation per tensor, as the runtime makes them: a paging ledger rounds each one, all or none.
        let sizes = host.tensor_sizes();
        ledger.allocate_tensors(&sizes).map_err(|e| self.onload_error(host, e))?;
        // From here every way out but success gives the reservation back: each failure below, and a panic past the
        // device's own guards (a ledger's, a host read's), which would otherwise leave the account inflated and
        // every later request refused for room nobody holds.
        let reservation = Reservation { ledger, sizes: &sizes, kept: false };
        if !pages {
            placed();
        }
        // A group with a copy on a donor comes from there, over that donor's link; any other from its host copy.
        let from_donor =
            host.donor_tensors().and_then(|(index, tensors)| Some((self.config.donors.get(index)?, tensors)));
        let copied = match &from_donor {
            Some((donor, _)) => ledger.transfer_from_peer(host.bytes, donor.seconds(host.bytes)),
            None if host.pinned => ledger.transfer_pinned(host.bytes),
            None => ledger.transfer(host.bytes, Direction::HostToDevice),
        };
        copied.map_err(|e| self.onload_error(host, e))?;
        let (data, read) = match &from_donor {
            Some(_) => (Vec::new(), None),
            None => {
                let loaded = host.load_upload(&self.config.timeline).map_err(|error| match error {
                    // A checkpoint file that cannot be read is its own error: freeing memory would not help.
                    HostReadError::File(error) => error,
                    HostReadError::Disk(message) => {
                        self.onload_error(host, ComponentError::Transfer { what: host.id.clone(), message })
                    }
                })?;
                if loaded.read.is_some() && self.config.ram_budget > 0 {
                    self.keep_read(host, &loaded.data);
                }
                let read = loaded.read.map(|(bytes, seconds)| {
                    self.config.disk.note(DiskSample { bytes, seconds });
                    FileRead { bytes, nanos: (seconds * 1e9) as u64 }
                });
                (loaded.data, read)
            }
        };
        let device = self.config.device.exec();
        let memory = self.config.device.memory().as_deref();
        if self.config.check_uploads {
            // Before it allocates, the upload waits for the work already submitted on the device: the groups
            // released before it (each release submits its stream's queued kernels) have then given their pages
            // back to the upload stream's pool, which reuses them. Without the wait, a group let go of just
            // before was still pinned now and then, and the window held one group more than the plan's
            // `1 + depth` (measured on wgpu: the tiny transformer's block phase at 0.911 to 0.993 of the plan,
            // and 0.950 to 1.010 with it; docs/devices.md). On the upload thread, off the compute thread.
            check_device(device, self.config.device.name(), "upload", memory)
                .map_err(|error| self.onload_error(host, error))?;
        }
        let copy_started = std::time::Instant::now();
        let peer = from_donor.as_ref().map(|(donor, _)| donor.device.name().clone());
        let donor_tensors = from_donor.map(|(_, tensors)| tensors);
        let built = catch_device_panic(|| match donor_tensors {
            Some(tensors) => {
                tensors.iter().map(|tensor| tensor.to_device(device)).collect::<std::result::Result<Vec<_>, String>>()
            }
            None => data
                .into_iter()
                .zip(&host.tensors)
                .map(|(d, meta)| DeviceTensor::upload(d, device, meta.dtype))
                .collect::<std::result::Result<Vec<_>, String>>(),
        });
        let built = match built {
            Ok(Ok(tensors)) => Ok(tensors),
            Ok(Err(message)) => {
                let source = ComponentError::Transfer { what: host.id.clone(), message };
                return Err(self.onload_error(host, source));
            }
            Err(panic) => Err(panic),
        };
        if pages && built.is_ok() {
            placed();
        }
        // The upload is complete, on this thread's stream, before the group is published as on the device: a
        // sync and a read-back of one value per tensor surface a refused allocation as this group's, and no later
        // reader races the copy.
        let checked = match built {
            Ok(tensors) if !self.config.check_uploads => Ok(tensors),
            Ok(tensors) => check_device(device, self.config.device.name(), "upload", memory)
                .and_then(|()| check_outputs(&tensors, device, self.config.device.name(), "upload", memory))
                .map(|()| tensors),
            Err(panic) => Err(panic.with_device(self.config.device.name(), "upload", memory)),
        };
        let tensors = checked.map_err(|error| self.onload_error(host, error))?;
        reservation.keep();
        if peer.is_none() && !self.config.donors.is_empty() {
            self.place_on_donor(host, &tensors);
        }
        if self.config.check_uploads {
            // Unchecked, the copies were only queued: their time is not the link's, and is not noted. A copy from
            // a donor is the peer link's, on that peer's clock; any other is the host link's.
            let seconds = copy_started.elapsed().as_secs_f64();
            match &peer {
                Some(peer) => {
                    let sample = LinkSample { bytes: host.bytes, seconds, page_locked: false };
                    self.config.device.peer_link(peer).note(sample);
                }
                None => {
                    let sample = LinkSample { bytes: host.bytes, seconds, page_locked: host.page_locked };
                    self.config.device.link().note(sample);
                }
            }
        }
        if let Some(record) = &self.config.record {
            record.add(OffloadEvent {
                action: Action::Onload,
                id: host.id.clone(),
                bytes: host.bytes,
                reason: Some(reason),
                available: reading.map(|r| r.available),
                peak: reading.map(|r| r.peak),
                read,
                from_peer: peer.as_ref().map(|peer| peer.to_string()),
            });
        }
        Ok(tensors.into())
    }

    /// The link rate of the uploads noted on this offloader's link meter (the placement's, shared with the
    /// device's other moves, for a registered model); `None` before the first.
    pub fn link_rate(&self) -> Option<LinkRate> {
        self.config.device.link().rate()
    }

    /// Drops every group that is on the device only because it was prefetched and that nobody borrows (they
    /// come back on their next take), each release recorded with `reason`; returns their bytes. Takes the lock.
    ///
    /// The prefetches in flight are waited for first, until each is published or put back: one the worker was
    /// still uploading would otherwise keep the room it took, and the caller, which gives back room because it ran
    /// out, would run out again with the worker's group placed. A group a caller uploads itself (`Loading` but not
    /// prefetched, as a refused take has marked its own) is not waited for.
    pub fn release_idle_prefetches(&self, reason: &Reason) -> u64 {
        let mut state = self.state.lock();
        while state.groups.iter().any(|g| g.prefetched && matches!(g.residency, Residency::Loading { .. })) {
            self.changed.wait(&mut state);
        }
        let idle: Vec<usize> = (0..state.groups.len())
            .filter(|&i| {
                let slot = &state.groups[i];
                slot.users == 0 && slot.prefetched && !slot.kept && matches!(slot.residency, Residency::OnDevice(_))
            })
            .collect();
        let bytes = idle.iter().map(|&i| state.groups[i].host.bytes).sum();
        for &i in &idle {
            self.drop_from_device(&mut state, i, reason);
        }
        drop(state);
        if bytes > 0 {
            // The groups were uploaded on the device's upload thread, so their pages go back to its stream's pool,
            // which keeps them: still the device's, under a cap still charged, and never the computing thread's.
            // The caller gives room back because it ran out: the pages go back to the device (outside the lock,
            // since the upload thread's queued prefetches take it).
            self.config.device.memory_cleanup();
        }
        bytes
    }

    /// Drops a group's device tensors and frees them on the ledger, the release recorded with `reason`. Called
    /// with the lock held (it is cheap).
    fn drop_from_device(&self, state: &mut State, group: usize, reason: &Reason) {
        let slot = &mut state.groups[group];
        if !matches!(slot.residency, Residency::OnDevice(_)) {
            return;
        }
        let (id, bytes) = (slot.host.id.clone(), slot.host.bytes);
        if slot.prefetched {
            state.stats.unused_prefetches += 1;
        }
        slot.prefetched = false;
        let span = self.config.timeline.span(category::RELEASE, &id).arg("bytes", bytes);
        self.record(Action::Offload, &id, bytes, reason.clone());
        slot.residency = Residency::Offloaded;
        self.config.device.ledger().free_tensors(&slot.host.tensor_sizes());
        if self.config.check_uploads && crate::device::defers_failures(self.config.device.exec()) {
            // The kernels that read this group may still be queued on this thread's stream, and they keep its
            // pages from the upload stream's pool until the work they were submitted in completes. Submitting
            // them now lets the next upload's sync ([`Shared::upload_bytes`]) wait them out; unchecked uploads
            // make no such wait, so they need no flush either. A failure to submit is the device's, and the next
            // sync or read-back reports it, typed.
            let _ = self.config.device.exec().flush();
        }
        drop(span);
        if let Some(memory) = self.config.device.memory() {
            self.config.timeline.sample_memory(memory.as_ref());
        }
        state.stats.offloads += 1;
        state.stats.bytes_offloaded += bytes;
    }
}

impl Engine {
    /// Starts an engine and its worker thread.
    pub fn start(config: GroupOffloadConfig) -> Result<Arc<Self>> {
        config.validate()?;
        let model = config.model.clone();
        let shared = Arc::new(Shared {
            ram_left: Room::new(config.ram_budget, config.ram_groups.clone()),
            donor_left: config.donors.iter().map(|donor| Room::new(donor.budget, donor.groups.clone())).collect(),
            config,
            state: Mutex::new(State {
                groups: Vec::new(),
                order: Vec::new(),
                cursor: None,
                capturing: true,
                stats: GroupStats::default(),
                strays: Vec::new(),
                stray_failure: None,
                capture_warned: false,
                refusals: Refusals::default(),
            }),
            changed: Condvar::new(),
            closed: AtomicBool::new(false),
        });
        let unstarted = |e: std::io::Error| Error::InvalidConfig {
            model: model.clone(),
            problem: format!("cannot start the prefetch worker: {e}"),
        };
        let worker = if *shared.config.device.exec() == Device::flex() {
            let (jobs, receiver) = mpsc::channel::<Job>();
            let name = format!("group-offload-{model}");
            let thread = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || {
                    while let Ok(job) = receiver.recv() {
                        serve(&name, || run_job(job));
                    }
                })
                .map_err(unstarted)?;
            Worker::Own { jobs, thread }
        } else {
            // On CUDA and wgpu, burn gives every OS thread its own stream, so the upload thread is the prefetch
            // stream: its uploads overlap the compute queued by the caller, and burn orders cross-stream use with
            // events.
            Worker::Device(shared.config.device.upload_queue().map_err(unstarted)?)
        };
        Ok(Arc::new(Self { shared, worker: Mutex::new(Some(worker)) }))
    }

    pub fn model(&self) -> &str {
        &self.shared.config.model
    }

    pub fn device(&self) -> &Device {
        self.shared.config.device.exec()
    }

    /// Registers a group: a kept group (a resident part's) is never offloaded by a release; one that `stays` (chosen
    /// within the resident budget as it was added) is kept from its first release on, whatever the order of the
    /// calls.
    pub fn add_group(&self, host: GroupHost, kept: bool, stays: bool) -> Result<usize> {
        let host = Arc::new(host);
        let index = {
            let mut state = self.shared.state.lock();
            state.groups.push(GroupSlot {
                host: host.clone(),
                residency: Residency::Offloaded,
                users: 0,
                kept,
                prefetched: false,
                resident_part: kept,
                stays: kept || stays,
            });
            state.groups.len() - 1
        };
        // A resident group is uploaded by `onload_resident` (the manager's onload of the model) or at its first
        // use, not here: building the offloader touches no device memory, so it cannot fail half-way with an
        // out-of-memory and lose a model that was taken apart.
        Ok(index)
    }

    fn onload_kept(&self, group: usize) -> Result<()> {
        let host = {
            let mut state = self.shared.state.lock();
            let slot = &mut state.groups[group];
            if !matches!(slot.residency, Residency::Offloaded) {
                return Ok(());
            }
            slot.residency = Residency::Loading { placed: false };
            slot.host.clone()
        };
        let unwinding = GivesBackOnUnwind { shared: &self.shared, group, user: false };
        let result = upload_now(&self.shared, &host, Reason::GroupOnload);
        std::mem::forget(unwinding);
        let mut state = self.shared.state.lock();
        let outcome = match result {
            Ok(tensors) => {
                state.groups[group].residency = Residency::OnDevice(tensors);
                state.stats.onloads += 1;
                state.stats.bytes_onloaded += host.bytes;
                Ok(())
            }
            Err(e) => {
                state.groups[group].residency = Residency::Offloaded;
                Err(e)
            }
        };
        self.shared.changed.notify_all();
        outcome
    }

    pub fn host(&self, group: usize) -> Option<Arc<GroupHost>> {
        self.shared.state.lock().groups.get(group).map(|g| g.host.clone())
    }

    /// Takes the groups for one guard, in order; on failure releases what it took.
    pub fn acquire(&self, groups: &[usize]) -> Result<Vec<(usize, Arc<[DeviceTensor]>)>> {
        let mut taken = Vec::with_capacity(groups.len());
        for &group in groups {
            match self.acquire_one(group) {
                Ok(tensors) => taken.push((group, tensors)),
                Err(e) => {
                    for (g, tensors) in taken {
                        drop(tensors);
                        self.release(g);
                    }
                    return Err(e);
                }
            }
        }
        Ok(taken)
    }

    fn acquire_one(&self, group: usize) -> Result<Arc<[DeviceTensor]>> {
        let shared = &self.shared;
        let mut state = shared.state.lock();
        let capturing = state.capturing;
        state.note_call(group, &shared.config.model);
        let mut waited = false;
        loop {
            let slot = &mut state.groups[group];
            match &slot.residency {
                Residency::OnDevice(tensors) => {
                    let tensors = tensors.clone();
                    slot.users += 1;
                    if slot.prefetched {
                        slot.prefetched = false;
                        if waited {
                            state.stats.prefetch_waits += 1;
                        } else {
                            state.stats.prefetch_hits += 1;
                        }
                    }
                    let jobs = self.schedule(&mut state, group);
                    drop(state);
                    self.dispatch(jobs);
                    return Ok(tensors);
                }
                Residency::Loading { .. } => {
                    waited = true;
                    shared.changed.wait(&mut state);
                }
                Residency::Offloaded => break,
            }
        }
        // A synchronous upload on this thread.
        let slot = &mut state.groups[group];
        slot.residency = Residency::Loading { placed: false };
        slot.users += 1;
        slot.prefetched = false;
        let host = slot.host.clone();
        let miss = !capturing && shared.config.prefetch;
        if miss {
            state.stats.misses += 1;
            tracing::debug!(group = %host.id, "prefetch miss: loading synchronously");
        }
        drop(state);
        let unwinding = GivesBackOnUnwind { shared, group, user: true };
        let mut result = upload_now(shared, &host, Reason::GroupOnload);
        if result.as_ref().is_err_and(Error::is_out_of_memory) {
            // Prefetched groups nobody borrows yet hold the bytes this one needs (a refused prefetch let the worker
            // run ahead into what the last group released): give them back and try once more, so the worker can
            // never starve the thread that computes. As for a refused call's activations, the record shows each
            // release as `oom_retry:<model>`: the out-of-memory is why they left (after the prefetches still in
            // flight have landed, so that none keeps the room this take needs).
            let dropped = shared.release_idle_prefetches(&Reason::OomRetry(self.model().to_string()));
            if dropped > 0 {
                tracing::debug!(group = %host.id, dropped_bytes = dropped, "upload refused: dropped idle prefetches and retried");
                result = upload_now(shared, &host, Reason::GroupOnload);
            }
        }
        std::mem::forget(unwinding);
        let mut state = shared.state.lock();
        let slot = &mut state.groups[group];
        let (outcome, jobs) = match result {
            Ok(tensors) => {
                slot.residency = Residency::OnDevice(tensors.clone());
                state.stats.onloads += 1;
                state.stats.bytes_onloaded += host.bytes;
                let jobs = self.schedule(&mut state, group);
                (Ok(tensors), jobs)
            }
            Err(e) => {
                slot.residency = Residency::Offloaded;
                slot.users -= 1;
                (Err(e), Vec::new())
            }
        };
        shared.changed.notify_all();
        drop(state);
        self.dispatch(jobs);
        outcome
    }

    /// After `group` was taken: drops prefetched groups that are no longer expected, then marks the next groups
    /// of the captured order `Loading` and returns their jobs, for [`dispatch`](Self::dispatch) once the lock is
    /// released.
    fn schedule(&self, state: &mut State, group: usize) -> Vec<Job> {
        let config = &self.shared.config;
        if state.capturing || !config.prefetch {
            return Vec::new();
        }
        let window = state.window(config.prefetch_depth);
        let stale: Vec<usize> = (0..state.groups.len())
            .filter(|i| {
                let slot = &state.groups[*i];
                *i != group
                    && slot.users == 0
                    && !slot.kept
                    && !window.contains(i)
                    && matches!(slot.residency, Residency::OnDevice(_))
            })
            .collect();
        for i in stale {
            self.shared.drop_from_device(state, i, &Reason::GroupOffload);
        }
        let mut jobs = Vec::new();
        for next in window {
            let slot = &mut state.groups[next];
            if !matches!(slot.residency, Residency::Offloaded) {
                continue;
            }
            slot.residency = Residency::Loading { placed: false };
            slot.prefetched = true;
            state.stats.prefetches += 1;
            jobs.push(Job { shared: self.shared.clone(), group: next, host: slot.host.clone(), published: false });
        }
        jobs
    }

    /// Hands the jobs of [`schedule`](Self::schedule) to the worker. Called without the state lock: a job the
    /// worker's channel refuses is dropped here, and its drop takes the lock to put its group back.
    fn dispatch(&self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let worker = self.worker.lock();
        for job in jobs {
            match worker.as_ref() {
                Some(Worker::Own { jobs, .. }) => drop(jobs.send(job)),
                Some(Worker::Device(tasks)) => drop(tasks.send(Box::new(move || run_job(job)))),
                None => drop(job),
            }
        }
    }

    /// A guard let go of `group`.
    ///
    /// With prefetch on, a group leaves the device only once the prefetches of the window are placed (their
    /// memory taken on the device, [`Residency::Loading`]): the next groups arrive before this one goes, so the
    /// window holds `1 + depth` groups at every release, as the plan counts it, whatever the threads' timing.
    /// Without the wait, a prefetch the worker reached only after this release took the pages this group gave
    /// back, and the device held one group fewer than planned now and then (measured on wgpu: the tiny text
    /// encoder's block phase at 1.170 of the plan in a third of the runs, docs/devices.md). At depth 1 the wait
    /// costs a forward nothing: its next take needs that group published, which comes later still; deeper, the
    /// release also waits for the window's last group to be allocated.
    pub fn release(&self, group: usize) {
        let shared = &self.shared;
        let mut state = shared.state.lock();
        let Some(slot) = state.groups.get_mut(group) else { return };
        slot.users = slot.users.saturating_sub(1);
        loop {
            let slot = &state.groups[group];
            if slot.users > 0 || slot.kept || !matches!(slot.residency, Residency::OnDevice(_)) {
                return;
            }
            if slot.stays {
                state.groups[group].kept = true;
                // A group that stays on the device is not read again: its kept read goes back to the RAM budget,
                // and its copy on the donor to the donor.
                shared.forget_read(&state.groups[group].host);
                if let Some((donor, given)) = state.groups[group].host.leave_donor() {
                    shared.donor_left[donor].give(given);
                    shared.sample_donor(donor);
                }
                return;
            }
            let prefetching = !state.capturing && shared.config.prefetch;
            let window = if prefetching { state.window(shared.config.prefetch_depth) } else { Vec::new() };
            if window.contains(&group) {
                // The group is among the next to run (a short order, or guards released out of order): keep it
                // rather than upload it again.
                state.groups[group].prefetched = true;
                return;
            }
            let unplaced = |state: &State| {
                window.iter().any(|&next| matches!(state.groups[next].residency, Residency::Loading { placed: false }))
            };
            if !unplaced(&state) {
                break;
            }
            // Every prefetch leaves `Loading { placed: false }`: placed, published, or put back on failure, each
            // with a wake-up; the group's state is read again after the wait, as another thread may have taken it.
            shared.changed.wait(&mut state);
        }
        shared.drop_from_device(&mut state, group, &Reason::GroupOffload);
    }

    /// Offloads every group, kept ones included (they come back on their next use). Waits for prefetches in
    /// flight; refuses while a guard still borrows a group.
    pub fn offload_all(&self) -> Result<()> {
        let shared = &self.shared;
        let mut state = shared.state.lock();
        while state.groups.iter().any(|g| matches!(g.residency, Residency::Loading { .. })) {
            shared.changed.wait(&mut state);
        }
        if let Some(busy) = state.groups.iter().find(|g| g.users > 0) {
            return Err(Error::InUse { group: busy.host.id.clone(), users: busy.users });
        }
        for i in 0..state.groups.len() {
            state.groups[i].prefetched = false;
            shared.drop_from_device(&mut state, i, &Reason::GroupOffload);
        }
        for slot in &mut state.groups {
            if !slot.kept_at_start() {
                slot.kept = false;
            }
        }
        Ok(())
    }

    /// Uploads the kept groups of resident parts again after [`offload_all`](Self::offload_all).
    pub fn onload_resident(&self) -> Result<()> {
        let kept: Vec<usize> = {
            let state = self.shared.state.lock();
            (0..state.groups.len()).filter(|i| state.groups[*i].kept).collect()
        };
        for group in kept {
            self.onload_kept(group)?;
        }
        Ok(())
    }

    pub fn stats(&self) -> GroupStats {
        self.shared.state.lock().stats
    }

    pub fn count_stray(&self, name: &str) {
        let mut state = self.shared.state.lock();
        state.stats.stray_loads += 1;
        if state.strays.len() < STRAYS_KEPT {
            state.strays.push(name.to_string());
        }
        drop(state);
        tracing::warn!(parameter = name, "a parameter outside the taken groups was used; loaded it synchronously");
    }

    /// Records a stray load that could not read its host copy; the call that made it fails with it
    /// ([`take_stray_failure`](Self::take_stray_failure)). The first failure of a call is kept.
    pub fn fail_stray(&self, error: Error) {
        tracing::error!("a stray load could not read its host copy: {error}");
        self.shared.state.lock().stray_failure.get_or_insert(error);
    }

    /// The stray-load failure recorded since the last call, if any, cleared.
    pub fn take_stray_failure(&self) -> Option<Error> {
        self.shared.state.lock().stray_failure.take()
    }

    /// The first parameters loaded outside their groups.
    pub fn strays(&self) -> Vec<String> {
        self.shared.state.lock().strays.clone()
    }

    /// The group ids in the captured order.
    pub fn order(&self) -> Vec<String> {
        let state = self.shared.state.lock();
        state.order.iter().map(|g| state.groups[*g].host.id.clone()).collect()
    }

    pub fn is_capturing(&self) -> bool {
        self.shared.state.lock().capturing
    }

    pub fn end_capture(&self) {
        let mut state = self.shared.state.lock();
        if state.capturing {
            state.capturing = false;
            // The last take of the forward; the next take is expected to be the order's first step, which is
            // prefetched now, as a steady forward's last take prefetches the next forward's first groups.
            state.cursor = state.order.len().checked_sub(1);
            tracing::info!(model = self.model(), calls = state.order.len(), "group offload captured the call order");
            if let Some(&last) = state.order.last() {
                let jobs = self.schedule(&mut state, last);
                drop(state);
                self.dispatch(jobs);
            }
        }
    }

    pub fn recapture(&self) {
        let mut state = self.shared.state.lock();
        state.capturing = true;
        state.capture_warned = false;
        state.order.clear();
        state.cursor = None;
    }

    /// The bytes of host copies held in host memory, the reads kept within the RAM budget included.
    pub fn host_memory_bytes(&self) -> u64 {
        self.shared.state.lock().groups.iter().map(|g| g.host.memory_bytes() + g.host.kept_read_bytes()).sum()
    }

    /// The bytes of host copies read from checkpoint files at each upload.
    pub fn file_bytes(&self) -> u64 {
        self.shared.state.lock().groups.iter().map(|g| g.host.file_bytes()).sum()
    }

    /// Sum of all groups' bytes.
    pub fn total_bytes(&self) -> u64 {
        self.shared.state.lock().groups.iter().map(|g| g.host.bytes).sum()
    }

    /// Bytes of resident parts plus the resident budget: what the model holds on the device between uses.
    pub fn resident_bytes(&self) -> u64 {
        let state = self.shared.state.lock();
        state.groups.iter().filter(|g| g.kept_at_start()).map(|g| g.host.bytes).sum::<u64>()
            + self.shared.config.resident_budget
    }

    /// What the next forward will still bring onto the device beyond [`resident_bytes`](Self::resident_bytes):
    /// its window, the `1 + depth` largest streamed groups (the one it computes with and the ones prefetched behind
    /// it; one without prefetch), less the streamed groups it holds now (the first groups of its next forward,
    /// prefetched as its last ended, or placed and still copying), which the device's reading counts already.
    /// Groups kept (resident parts, the resident budget's) are in the resident bytes and never in the window.
    pub fn window_bytes(&self) -> u64 {
        let config = &self.shared.config;
        let in_flight = if config.prefetch { 1 + config.prefetch_depth } else { 1 };
        let state = self.shared.state.lock();
        let mut streamed: Vec<u64> = state.groups.iter().filter(|g| !g.kept).map(|g| g.host.bytes).collect();
        streamed.sort_unstable_by(|a, b| b.cmp(a));
        let window: u64 = streamed.iter().take(in_flight).sum();
        let held: u64 = state
            .groups
            .iter()
            .filter(|g| !g.kept)
            .filter(|g| matches!(g.residency, Residency::OnDevice(_) | Residency::Loading { placed: true }))
            .map(|g| g.host.bytes)
            .sum();
        window.saturating_sub(held)
    }

    /// The prefetches refused or failed since the last call, cleared: what the forward that just returned reports
    /// in one warning ([`GroupOffload::run`](crate::parts::GroupOffload::run)).
    pub fn take_refusals(&self) -> Refusals {
        std::mem::take(&mut self.shared.state.lock().refusals)
    }

    /// Bytes of host copies pinned within the pinned budget, and of those the page-locked ones.
    pub fn pinned_bytes(&self) -> (u64, u64) {
        let state = self.shared.state.lock();
        let pinned = state.groups.iter().filter(|g| g.host.pinned).map(|g| g.host.bytes).sum();
        let locked = state.groups.iter().filter(|g| g.host.page_locked).map(|g| g.host.bytes).sum();
        (pinned, locked)
    }

    /// Bytes of groups held on the donors, and how many groups.
    pub fn donor_bytes(&self) -> (u64, usize) {
        let state = self.shared.state.lock();
        let held: Vec<u64> = state.groups.iter().filter(|g| g.host.is_on_donor()).map(|g| g.host.bytes).collect();
        (held.iter().sum(), held.len())
    }

    /// What each donor holds, in the donors' order: its device's name, the bytes of the groups it holds, and how
    /// many groups.
    pub fn donor_holdings(&self) -> Vec<(DeviceName, u64, usize)> {
        let state = self.shared.state.lock();
        let mut held: Vec<(DeviceName, u64, usize)> =
            self.shared.config.donors.iter().map(|donor| (donor.device.name().clone(), 0, 0)).collect();
        for group in &state.groups {
            if let Some(donor) = group.host.donor() {
                held[donor].1 += group.host.bytes;
                held[donor].2 += 1;
            }
        }
        held
    }

    /// Bytes of groups' reads from their files kept in host memory within the RAM budget, and how many groups.
    pub fn kept_read_bytes(&self) -> (u64, usize) {
        let state = self.shared.state.lock();
        let kept: Vec<u64> = state.groups.iter().map(|g| g.host.kept_read_bytes()).filter(|b| *b > 0).collect();
        (kept.iter().sum(), kept.len())
    }

    /// The largest group's bytes, resident parts included.
    pub fn largest_group(&self) -> u64 {
        self.shared.state.lock().groups.iter().map(|g| g.host.bytes).max().unwrap_or(0)
    }

    /// The largest streamed group's bytes: the resident parts left out.
    pub fn largest_streamed_group(&self) -> u64 {
        let state = self.shared.state.lock();
        state.groups.iter().filter(|g| !g.kept_at_start()).map(|g| g.host.bytes).max().unwrap_or(0)
    }

    /// Group ids and sizes, in registration order.
    pub fn groups(&self) -> Vec<(String, u64)> {
        self.shared.state.lock().groups.iter().map(|g| (g.host.id.clone(), g.host.bytes)).collect()
    }

    /// Checksums of every group's host copy.
    pub fn host_checksums(&self) -> Vec<(String, std::result::Result<u64, String>)> {
        let hosts: Vec<Arc<GroupHost>> = self.shared.state.lock().groups.iter().map(|g| g.host.clone()).collect();
        hosts.iter().map(|h| (h.id.clone(), h.checksum())).collect()
    }

    /// Ids of the groups on the device now.
    pub fn on_device(&self) -> Vec<String> {
        let state = self.shared.state.lock();
        state
            .groups
            .iter()
            .filter(|g| matches!(g.residency, Residency::OnDevice(_)))
            .map(|g| g.host.id.clone())
            .collect()
    }

    pub fn wait_idle(&self) {
        let mut state = self.shared.state.lock();
        while state.groups.iter().any(|g| matches!(g.residency, Residency::Loading { .. })) {
            self.shared.changed.wait(&mut state);
        }
    }
}

impl GroupSlot {
    /// Resident parts are kept from registration; groups kept within the resident budget are not (they are reset
    /// by `offload_all`).
    fn kept_at_start(&self) -> bool {
        self.resident_part
    }
}

/// An upload the calling thread waits for (a kept group, the capture's loads, a miss). On a cubecl device it runs on
/// the device's upload thread, as prefetches and whole onloads do, so that every group's pages come from the pools
/// of one stream and the footprints measured there hold for them; burn's CPU backend uploads on the caller.
fn upload_now(shared: &Arc<Shared>, host: &Arc<GroupHost>, reason: Reason) -> Result<Arc<[DeviceTensor]>> {
    if !crate::device::defers_failures(shared.config.device.exec()) {
        return shared.upload(host, reason, &|| {});
    }
    let (task_shared, task_host) = (shared.clone(), host.clone());
    let what = || format!("the upload of group {}", host.id);
    match shared.config.device.on_upload_thread(move || task_shared.upload(&task_host, reason, &|| {})) {
        Ok(uploaded) => uploaded,
        Err(Error::UploadPanicked { device, message, .. }) => {
            Err(Error::UploadPanicked { what: what(), device, message })
        }
        Err(Error::UploadThread { device, problem, .. }) => Err(Error::UploadThread { what: what(), device, problem }),
        Err(other) => Err(other),
    }
}

/// Armed around a synchronous upload that set its group `Loading` (and, for a take, counted its caller as a user):
/// if the upload panics on the calling thread (past the device's own guards: a ledger, a host read), the panic goes
/// on, and this puts the group back offloaded and wakes its waiters, so that no other caller waits for ever on it.
/// Forgotten once the upload returns; the caller then publishes the outcome itself.
struct GivesBackOnUnwind<'a> {
    shared: &'a Shared,
    group: usize,
    /// Whether the upload's caller was counted as a user of the group.
    user: bool,
}

impl Drop for GivesBackOnUnwind<'_> {
    fn drop(&mut self) {
        self.shared.give_back(self.group, self.user, false);
    }
}

/// One prefetch, on the worker: uploads the job's group and publishes it, or leaves it offloaded (to be loaded
/// when taken) when the upload fails or the engine is gone. A refused or failed upload is a `prefetch_refused` or
/// `prefetch_failed` row of the record ([`Shared::upload`]) and counts toward the forward's one warning
/// ([`Engine::take_refusals`]). A panic in the upload (past the device's own guards, in a ledger or a host read) is
/// the upload's failure, typed ([`Error::UploadPanicked`]): its reservation was given back as it unwound, and the
/// worker thread goes on with the next job, of this engine or another.
fn run_job(mut job: Job) {
    let shared = job.shared.clone();
    let placed = || shared.mark_placed(job.group);
    let result = if shared.closed.load(Ordering::Acquire) {
        None
    } else {
        Some(shared.upload(&job.host, Reason::Prefetch, &placed))
    };
    let mut state = shared.state.lock();
    let slot = &mut state.groups[job.group];
    match result {
        Some(Ok(tensors)) => {
            slot.residency = Residency::OnDevice(tensors);
            state.stats.bytes_onloaded += job.host.bytes;
        }
        Some(Err(e)) => {
            slot.residency = Residency::Offloaded;
            slot.prefetched = false;
            state.stats.failed_prefetches += 1;
            // One line per forward says it ([`GroupOffload::run`](crate::parts::GroupOffload::run)); each
            // refusal is a row of the record.
            tracing::debug!(error = %e, "prefetch refused; the group will be loaded when it is taken");
            if !e.is_out_of_memory() {
                tracing::error!(error = %e, "prefetch failed for another reason than memory");
            }
        }
        None => {
            slot.residency = Residency::Offloaded;
            slot.prefetched = false;
        }
    }
    job.published = true;
    shared.changed.notify_all();
}
