//! Real devices: opening a burn device by name, its memory readings from burn's pool (and the driver's where it
//! has a call), a smaller card imposed over those readings, and the one boundary where a device's failures
//! become typed errors.
//!
//! # Readings
//!
//! [`PoolReadings`] is the [`DeviceMemory`](offload_core::DeviceMemory) of a cubecl device (CUDA, wgpu). burn exposes what its memory pool
//! holds ([`Device::memory_pool_usage`](burn::tensor::Device::memory_pool_usage): bytes in use, padding, reserved pages) but no free-memory call, so:
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
//! activation estimate it cannot hold is refused before it runs ([`DeviceLedger::begin_call`](offload_core::DeviceLedger::begin_call)), and a call during
//! which the pool's pages passed the cap fails as an out-of-memory once it has run ([`DeviceLedger::end_call`](offload_core::DeviceLedger::end_call)):
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
//! [`ComponentError::OutOfMemory`](offload_core::ComponentError::OutOfMemory) with the bytes asked for and the bytes available. The runtime's words are
//! read by their first line only ([`RuntimeFailure::of`]), never searched for in the cause chain or the
//! backtrace. A poisoned device is [`Error::DevicePoisoned`](crate::error::Error::DevicePoisoned) (as [`ComponentError::Other`](offload_core::ComponentError::Other)), never retried;
//! memory never allocated ([`RuntimeFailure::Unallocated`]) is an out-of-memory only where the wgpu runtime's
//! runner recorded one; anything else (a buffer larger than the device can ever give) is
//! [`ComponentError::Device`](offload_core::ComponentError::Device), never labelled out-of-memory. [`catch_device_panic`] catches a runtime that panics
//! instead of returning an error, around the library's own device operations only: a model's forward is never
//! caught.

mod call;
pub(crate) mod cap;
mod failure;
mod open;
pub(crate) mod pool;
mod probe;
#[cfg(test)]
mod tests;

pub use call::*;
pub use cap::*;
pub use failure::*;
pub use offload_core::device::ReadingUnavailable;
pub use open::*;
pub use pool::*;
pub use probe::*;
