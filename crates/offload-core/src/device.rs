//! Devices: the `DeviceMemory` readings every decision is made from and the `DeviceLedger` every move is charged
//! to (device names live in `name`, re-exported here).

use offload_strategy::MemoryReading;

pub use crate::name::{DeviceName, DeviceNameError};

/// Memory readings of one execution device.
///
/// # Contract
///
/// - `available` is what the device can still give to a new allocation: free memory plus the allocator's
///   reusable cache (the anchor's `mem_get_info()[0] + reserved - allocated`).
/// - `peak` is monotone between explicit resets: it never decreases, except where an implementation offers a
///   reset of its own (`SimCard::reset_peak`, `PoolReadings::reset_peak`), called by its owner on purpose, which
///   starts it again from what is allocated at that moment. A reading never lowers it.
/// - A reading that cannot be taken is never reported as an empty device: [`try_reading`](Self::try_reading)
///   returns [`ReadingUnavailable`], and the plain `u64` readings of an implementation that can fail say what
///   they report instead (the real-device readings in `group-offload` read as a full device: nothing available).
/// - Readings are taken by the manager just before every move, with its registry lock held, so an
///   implementation must be cheap and must not call back into the manager.
/// - Implementations are shared between threads: the simulated card in `memory-sim`, a burn device's pool
///   usage, or a fake in tests.
///
/// ```
/// use offload_core::{DeviceMemory, DeviceName};
///
/// /// A card that always reports the same numbers, as a test double.
/// struct Fixed(DeviceName);
/// impl DeviceMemory for Fixed {
///     fn device(&self) -> DeviceName { self.0.clone() }
///     fn total(&self) -> u64 { 24 << 30 }
///     fn available(&self) -> u64 { 20 << 30 }
///     fn allocated(&self) -> u64 { 4 << 30 }
///     fn peak(&self) -> u64 { 4 << 30 }
/// }
/// let card = Fixed(DeviceName::parse("cuda").unwrap());
/// assert_eq!(card.reading().available, 20 << 30);
/// ```
pub trait DeviceMemory: Send + Sync {
    /// The device these readings are for.
    fn device(&self) -> DeviceName;
    /// Capacity in bytes.
    fn total(&self) -> u64;
    /// Bytes a new allocation can still get.
    fn available(&self) -> u64;
    /// Bytes currently allocated.
    fn allocated(&self) -> u64;
    /// The most bytes allocated at once so far.
    fn peak(&self) -> u64;

    /// The bytes the device's allocator holds for this process in pages of its own (in use, padding and the
    /// cache it can reuse), where the runtime allocates in pages; `Ok(None)` where it does not (a simulated card
    /// holds the bytes asked: [`allocated`](Self::allocated)). What a component's footprint is measured in
    /// ([`Offloadable::device_footprint`](crate::Offloadable::device_footprint)).
    fn held(&self) -> Result<Option<u64>, ReadingUnavailable> {
        Ok(None)
    }

    /// Opens a window over one call where the device allocates in pages of its own ([`held`](Self::held)
    /// answers): from now until [`close_call_window`](Self::close_call_window) with the token returned, the
    /// highest pages the allocator holds are kept. `Ok(None)` where nothing is measured (the default). Windows are
    /// independent of each other: several can be open on one thread.
    fn open_call_window(&self) -> Result<Option<u64>, ReadingUnavailable> {
        Ok(None)
    }

    /// Closes the window `token` opened: the pages the allocator held at the highest while it was open, over
    /// those it held when it opened (`Ok(None)` for a token that is not open). A failed last reading closes the
    /// window and is returned, since its high-water is not known.
    fn close_call_window(&self, token: u64) -> Result<Option<u64>, ReadingUnavailable> {
        let _ = token;
        Ok(None)
    }

    /// All three numbers a strategy sees, read together.
    fn reading(&self) -> MemoryReading {
        MemoryReading { available: self.available(), total: self.total(), peak: self.peak() }
    }

    /// [`reading`](Self::reading), or why the device could not be read. The manager decides on this one, so a
    /// reading that failed stops the decision with a typed error instead of passing for a number. Always `Ok` by
    /// default (a simulated card, a fake); a real device's readings override it.
    fn try_reading(&self) -> Result<MemoryReading, ReadingUnavailable> {
        Ok(self.reading())
    }
}

/// A device's memory could not be read: the runtime gave no answer, so nothing is known of it (not zero).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot read the memory of {device}: {message}; nothing is known of what it holds, so no move is decided on \
     it: check the device and its runtime, and run again"
)]
pub struct ReadingUnavailable {
    /// The device.
    pub device: DeviceName,
    /// What the runtime said, or why there was no answer.
    pub message: String,
}

/// Which way bytes cross the host link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host to device (an onload or a prefetch).
    HostToDevice,
    /// Device to host (an offload that copies back).
    DeviceToHost,
}

/// The accounting side of a device: what a mechanism that places bytes on it reports.
///
/// Real devices allocate for themselves, so for them this is [`NoLedger`]. A simulated card implements it to
/// track allocations, fail past its capacity in hard mode, and charge link time for transfers. Group offload
/// and the simulation's virtual components call it for every move, so the card's readings (and so the
/// strategy's decisions and the record) see every byte.
///
/// # Contract
///
/// - `allocate` either takes all `bytes` or fails with [`ComponentError::OutOfMemory`](crate::ComponentError::OutOfMemory) and takes none.
/// - `free` returns bytes a previous `allocate` took; it never fails.
/// - `transfer` is called once per copy across the link, after the destination is allocated; an error there
///   (a failed transfer) leaves the source intact, and the caller frees what it allocated. A host-to-device
///   copy from page-locked (pinned) host memory calls `transfer_pinned` instead, with the same contract.
/// - A component's call (a forward, an encode, a decode) is bracketed by `begin_call` and `end_call` on the
///   thread that runs it, `end_call` only once the call's device work has completed (after a sync). A simulated
///   card charges the call's activation estimate between the two; a capped real device reserves the estimate
///   (in its pages) in `begin_call`, refusing the call before it runs when the cap cannot hold it, and in
///   `end_call` gives the reservation back and reconciles it with the pages the call really took, failing with
///   [`ComponentError::OutOfMemory`](crate::ComponentError::OutOfMemory) when they passed the cap. Every
///   `begin_call` that succeeded is matched by one `end_call`, whether the call succeeded, failed or panicked.
/// - A check and the reservation it allows are one step: an implementation shared between threads (the main
///   thread and a prefetch worker) must check and take under one lock, so two threads can never both pass on
///   the same free bytes.
pub trait DeviceLedger: Send + Sync {
    /// Takes `bytes` on the device.
    fn allocate(&self, bytes: u64) -> Result<(), crate::ComponentError>;
    /// Gives back `bytes` taken earlier.
    fn free(&self, bytes: u64);
    /// Pays for a copy of `bytes` across the host link.
    fn transfer(&self, bytes: u64, direction: Direction) -> Result<(), crate::ComponentError> {
        let _ = (bytes, direction);
        Ok(())
    }
    /// Pays for a host-to-device copy of `bytes` from page-locked (pinned) host memory, which a device can read
    /// directly, without the driver's bounce through its own staging buffer. Priced as any host-to-device
    /// [`transfer`](Self::transfer) unless the ledger models the difference.
    fn transfer_pinned(&self, bytes: u64) -> Result<(), crate::ComponentError> {
        self.transfer(bytes, Direction::HostToDevice)
    }
    /// Pays for a copy of `bytes` onto this device from another device's memory (a second card holding a streamed
    /// group, a donor), over a link of the donor's that takes `seconds` for it (NVLink, PCIe between the cards).
    /// Priced as a host-to-device [`transfer`](Self::transfer) unless the ledger models the difference.
    fn transfer_from_peer(&self, bytes: u64, seconds: f64) -> Result<(), crate::ComponentError> {
        let _ = seconds;
        self.transfer(bytes, Direction::HostToDevice)
    }
    /// Takes one allocation per size in `sizes` (a component's parameters, a group's tensors), all or none: a
    /// ledger that counts in a runtime's pages rounds each one up. By default, one [`allocate`](Self::allocate)
    /// of their sum.
    fn allocate_tensors(&self, sizes: &[u64]) -> Result<(), crate::ComponentError> {
        self.allocate(sizes.iter().sum())
    }
    /// Gives back what [`allocate_tensors`](Self::allocate_tensors) took for the same `sizes`.
    fn free_tensors(&self, sizes: &[u64]) {
        self.free(sizes.iter().sum());
    }
    /// Opens the account of one call whose activations are estimated at `estimate` bytes: by default the
    /// estimate is [`allocate`](Self::allocate)d, which fails with out-of-memory on a full hard card.
    fn begin_call(&self, estimate: u64) -> Result<(), crate::ComponentError> {
        self.allocate(estimate)
    }
    /// Closes the account [`begin_call`](Self::begin_call) opened, after the call's device work completed: by
    /// default the estimate is freed and nothing fails. A ledger over a real device checks what the call really
    /// held here.
    fn end_call(&self, estimate: u64) -> Result<(), crate::ComponentError> {
        self.free(estimate);
        Ok(())
    }
}

/// The ledger of a real device: allocations are the device's own business, so nothing is tracked here.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoLedger;

impl DeviceLedger for NoLedger {
    fn allocate(&self, _bytes: u64) -> Result<(), crate::ComponentError> {
        Ok(())
    }

    fn free(&self, _bytes: u64) {}
}
