//! The simulated card: capacity, context overhead, allocations and peak, soft and hard modes, a link and a
//! compute model with a simulated clock, and fault injection.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use offload_core::{ComponentError, DeviceLedger, DeviceMemory, DeviceName, Direction, format_size, parse_size};
use parking_lot::Mutex;

use crate::error::SimError;

/// Whether allocations past capacity fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Only the readings change: allocations always succeed, `available` saturates at zero. This is the
    /// anchor's `simulate_accelerator_memory(hard=False)`, used for its Z-Image card expectations.
    Soft,
    /// An allocation past capacity fails with [`ComponentError::OutOfMemory`], which the manager's OOM retry
    /// handles, as PyTorch's caching allocator does under a per-process memory fraction.
    Hard,
}

/// The context overhead a CUDA context takes before anything loads, as measured by the anchor's records: a
/// 20e9-byte card reads 18.02 GiB available before the first load, 18.626 - 18.02 = 0.606 GiB.
pub const CUDA_CONTEXT_OVERHEAD: u64 = 650_692_591; // 0.606 GiB

/// Link and compute figures of a card.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Host link bandwidth in bytes per second, each way.
    pub link_bytes_per_second: f64,
    /// Fixed cost of one transfer.
    pub link_latency: Duration,
    /// Dense bf16 throughput in FLOP per second.
    pub flops_per_second: f64,
    /// The share of the link rate a host-to-device copy from pageable host memory reaches (0 to 1]; a copy
    /// from pinned memory ([`DeviceLedger::transfer_pinned`]) always reaches the full rate. 1 by default:
    /// every copy at the link rate, as the anchor's records were calibrated; set it (for example to 0.5, the
    /// planner's default) with [`CardSpec::with_pageable_fraction`] to see what pinning buys.
    pub pageable_fraction: f64,
}

impl Timing {
    /// A PCIe 4.0 x16 link (31.5 GB/s each way, 10 µs per transfer) and 100 TFLOP/s, for cards given by size.
    pub const GENERIC: Timing = Timing {
        link_bytes_per_second: 31.5e9,
        link_latency: Duration::from_micros(10),
        flops_per_second: 100e12,
        pageable_fraction: 1.0,
    };

    /// Simulated seconds to move `bytes` across the link once at the full rate (pinned host memory, or a copy
    /// back to the host).
    pub fn transfer_seconds(&self, bytes: u64) -> f64 {
        bytes as f64 / self.link_bytes_per_second + self.link_latency.as_secs_f64()
    }

    /// Simulated seconds to move `bytes` from pageable host memory to the device once.
    pub fn pageable_transfer_seconds(&self, bytes: u64) -> f64 {
        bytes as f64 / self.pageable_bytes_per_second() + self.link_latency.as_secs_f64()
    }

    /// The rate of a copy from pageable host memory: the link's, times the pageable fraction.
    pub fn pageable_bytes_per_second(&self) -> f64 {
        self.link_bytes_per_second * self.pageable_fraction
    }

    /// Simulated seconds to compute `flops`.
    pub fn compute_seconds(&self, flops: f64) -> f64 {
        flops / self.flops_per_second
    }
}

/// A real card from the catalogue: its memory as the driver reports it, its host link and its throughput.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CatalogueCard {
    /// The name to ask for, e.g. `rtx4090`.
    pub name: &'static str,
    /// A human description with the source of the figures.
    pub description: &'static str,
    /// Memory in bytes, as the driver reports it.
    pub bytes: u64,
    /// Link and compute figures.
    pub timing: Timing,
}

const MIB: u64 = 1 << 20;

const fn timing(link_gb_per_s: f64, tflops: f64) -> Timing {
    Timing {
        link_bytes_per_second: link_gb_per_s * 1e9,
        link_latency: Duration::from_micros(10),
        flops_per_second: tflops * 1e12,
        pageable_fraction: 1.0,
    }
}

/// Real cards. Memory is the driver's total (`nvidia-smi`), the link is the PCIe generation and width of the
/// board's datasheet at its theoretical rate each way (gen4 x16 31.5 GB/s, gen4 x8 15.75 GB/s, gen5 x16 63
/// GB/s), throughput is the datasheet's dense bf16 tensor rate (FP32 accumulate where GeForce boards halve it).
pub const CATALOGUE: &[CatalogueCard] = &[
    CatalogueCard {
        name: "rtx4060",
        description: "GeForce RTX 4060 8 GB, PCIe 4.0 x8, 30 TFLOP/s bf16",
        bytes: 8188 * MIB,
        timing: timing(15.75, 30.2),
    },
    CatalogueCard {
        name: "rtx3060",
        description: "GeForce RTX 3060 12 GB, PCIe 4.0 x16, 25.6 TFLOP/s bf16",
        bytes: 12288 * MIB,
        timing: timing(31.5, 25.6),
    },
    CatalogueCard {
        name: "rtx4080",
        description: "GeForce RTX 4080 16 GB, PCIe 4.0 x16, 97.5 TFLOP/s bf16",
        bytes: 16376 * MIB,
        timing: timing(31.5, 97.5),
    },
    CatalogueCard {
        name: "rtx4090",
        description: "GeForce RTX 4090 24 GB, PCIe 4.0 x16, 165 TFLOP/s bf16",
        bytes: 24564 * MIB,
        timing: timing(31.5, 165.2),
    },
    CatalogueCard {
        name: "a100-40gb",
        description: "A100 40 GB, PCIe 4.0 x16 host link, 312 TFLOP/s bf16",
        bytes: 40960 * MIB,
        timing: timing(31.5, 312.0),
    },
    CatalogueCard {
        name: "a100-80gb",
        description: "A100 80 GB, PCIe 4.0 x16 host link, 312 TFLOP/s bf16",
        bytes: 81920 * MIB,
        timing: timing(31.5, 312.0),
    },
    CatalogueCard {
        name: "h100-80gb",
        description: "H100 SXM 80 GB, PCIe 5.0 x16 host link, 989 TFLOP/s bf16",
        bytes: 81559 * MIB,
        timing: timing(63.0, 989.0),
    },
    CatalogueCard {
        name: "h200",
        description: "H200 141 GB, PCIe 5.0 x16 host link, 989 TFLOP/s bf16",
        bytes: 143771 * MIB,
        timing: timing(63.0, 989.0),
    },
];

/// How to build a card: a size or a catalogue name, a mode, the context overhead and the device name.
#[derive(Debug, Clone, PartialEq)]
pub struct CardSpec {
    /// The label the card was asked for by (`"16GB"`, `"rtx4090"`).
    pub label: String,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Bytes taken before anything loads.
    pub context_overhead: u64,
    /// Soft or hard.
    pub mode: Mode,
    /// Link and compute figures.
    pub timing: Timing,
    /// The device the card stands for, `cuda:0` unless told otherwise.
    pub device: DeviceName,
}

/// The catalogue's names, comma-separated, for an error that lists them.
fn catalogue_names() -> String {
    CATALOGUE.iter().map(|c| c.name).collect::<Vec<_>>().join(", ")
}

impl CardSpec {
    /// A card from a size (`"16GB"`, `"13.5GiB"`, any form [`parse_size`] reads) or a catalogue name
    /// (case-insensitive). Soft mode, a CUDA context's overhead, generic timing for sized cards.
    pub fn parse(label: &str) -> Result<Self, SimError> {
        let trimmed = label.trim();
        let lower = trimmed.to_ascii_lowercase();
        let (capacity, timing) = match CATALOGUE.iter().find(|c| c.name == lower) {
            Some(card) => (card.bytes, card.timing),
            None => match parse_size(trimmed) {
                Ok(bytes) => (bytes, Timing::GENERIC),
                Err(size) if trimmed.starts_with(|c: char| c.is_ascii_digit() || c == '.') => {
                    return Err(SimError::Size(size));
                }
                Err(_) => return Err(SimError::UnknownCard { name: trimmed.to_string(), known: catalogue_names() }),
            },
        };
        if capacity == 0 {
            return Err(SimError::ImpossibleCard {
                label: trimmed.to_string(),
                problem: "its capacity is zero".into(),
            });
        }
        Ok(Self {
            label: trimmed.to_string(),
            capacity,
            context_overhead: CUDA_CONTEXT_OVERHEAD.min(capacity),
            mode: Mode::Soft,
            timing,
            device: DeviceName::parse("cuda:0")
                .map_err(|_| SimError::UnknownCard { name: "cuda:0".into(), known: catalogue_names() })?,
        })
    }

    /// The same card known by another device name (`cuda:1` for a second card; `cuda:0` by default).
    pub fn with_device(mut self, device: DeviceName) -> Self {
        self.device = device;
        self
    }

    /// The same card in another mode.
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// The same card with another context overhead.
    pub fn with_context_overhead(mut self, bytes: u64) -> Self {
        self.context_overhead = bytes.min(self.capacity);
        self
    }

    /// The same card with other link and compute figures.
    pub fn with_timing(mut self, timing: Timing) -> Self {
        self.timing = timing;
        self
    }

    /// The same card with copies from pageable host memory reaching `fraction` of the link rate (pinned copies
    /// reach all of it). Fails unless `fraction` is a number in (0, 1].
    pub fn with_pageable_fraction(mut self, fraction: f64) -> Result<Self, SimError> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(SimError::ImpossibleCard {
                label: self.label,
                problem: format!("pageable fraction {fraction} is not in (0, 1]; use 0.5 for half the link rate"),
            });
        }
        self.timing.pageable_fraction = fraction;
        Ok(self)
    }

    /// The memory left after the context: what the card's components and calls can use.
    pub fn usable(&self) -> u64 {
        self.capacity - self.context_overhead
    }

    /// Checks that a reserve leaves room on this card; a reserve as large as the usable memory is an error.
    pub fn check_reserve(&self, reserve: u64) -> Result<(), SimError> {
        let usable = self.usable();
        if reserve >= usable {
            return Err(SimError::ImpossibleCard {
                label: self.label.clone(),
                problem: format!(
                    "the reserve ({}) is not smaller than the memory left after the context ({})",
                    format_size(reserve),
                    format_size(usable)
                ),
            });
        }
        Ok(())
    }
}

/// Faults a test can inject.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// Fail the allocation with this 1-based ordinal (counted from the card's creation), once.
    pub fail_allocation: Option<u64>,
    /// Fail the transfer with this 1-based ordinal, once.
    pub fail_transfer: Option<u64>,
    /// Multiply every transfer's time by this factor (a slow link); 1.0 when unset.
    pub link_slowdown: Option<f64>,
    /// Sleep for real for each transfer's simulated time times this factor, so transfers take wall time and
    /// overlap with compute can be measured; off when unset.
    pub real_time_scale: Option<f64>,
}

/// What the card has seen: bytes, time and failures.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CardStats {
    /// Bytes copied host to device.
    pub bytes_to_device: u64,
    /// Bytes copied device to host.
    pub bytes_to_host: u64,
    /// Of `bytes_to_device`, those copied from pinned host memory.
    pub bytes_pinned_to_device: u64,
    /// Of `bytes_to_device`, those copied from another card's memory ([`DeviceLedger::transfer_from_peer`]), priced
    /// at the donor's link rather than this card's.
    pub bytes_from_peers: u64,
    /// Simulated seconds spent on the link.
    pub transfer_seconds: f64,
    /// Simulated seconds spent computing.
    pub compute_seconds: f64,
    /// Allocations made (successful or not).
    pub allocations: u64,
    /// Transfers made (successful or not).
    pub transfers: u64,
    /// Allocations refused for lack of memory or by injection.
    pub failed_allocations: u64,
}

impl CardStats {
    /// Simulated wall time when nothing overlaps: link time plus compute time.
    pub fn serial_seconds(&self) -> f64 {
        self.transfer_seconds + self.compute_seconds
    }
}

/// One call the card's ledger received, in order ([`SimCard::log`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerCall {
    /// An allocation of these bytes, and whether it succeeded.
    Allocate {
        /// Bytes asked for.
        bytes: u64,
        /// Whether the card granted them.
        granted: bool,
    },
    /// Bytes freed.
    Free {
        /// Bytes given back.
        bytes: u64,
    },
    /// A copy across the link, and whether it succeeded.
    Transfer {
        /// Bytes copied.
        bytes: u64,
        /// Which way.
        direction: Direction,
        /// Whether it was copied from pinned host memory.
        pinned: bool,
        /// Whether it succeeded (an injected fault fails it).
        done: bool,
    },
}

impl fmt::Display for LedgerCall {
    /// `allocate 4416`, `allocate 4416 failed`, `free 4416`, `transfer 4416`, `transfer 4416 failed`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LedgerCall::Allocate { bytes, granted } => {
                write!(f, "allocate {bytes}{}", if granted { "" } else { " failed" })
            }
            LedgerCall::Free { bytes } => write!(f, "free {bytes}"),
            LedgerCall::Transfer { bytes, done, .. } => {
                write!(f, "transfer {bytes}{}", if done { "" } else { " failed" })
            }
        }
    }
}

/// How many ledger calls the card keeps ([`SimCard::log`]): the first ones, enough for a test's sequence.
pub const LOG_LIMIT: usize = 4096;

#[derive(Debug, Default)]
struct CardState {
    allocated: u64,
    peak: u64,
    stats: CardStats,
    faults: Faults,
    /// What `available` reads regardless of allocations, when a test patched it.
    patched_available: Option<u64>,
    log: Vec<LedgerCall>,
}

impl CardState {
    fn note(&mut self, call: LedgerCall) {
        if self.log.len() < LOG_LIMIT {
            self.log.push(call);
        }
    }
}

/// A simulated accelerator. It never touches a real device: it is the mock device every crate tests against.
///
/// It implements [`DeviceMemory`] (readings) and [`DeviceLedger`] (allocations, transfers). Share it as an
/// `Arc<SimCard>`; all methods take `&self`.
pub struct SimCard {
    spec: CardSpec,
    state: Mutex<CardState>,
}

impl fmt::Debug for SimCard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock();
        f.debug_struct("SimCard")
            .field("label", &self.spec.label)
            .field("capacity", &format_size(self.spec.capacity))
            .field("allocated", &format_size(state.allocated))
            .finish()
    }
}

impl SimCard {
    /// A card built from a spec.
    pub fn new(spec: CardSpec) -> Arc<Self> {
        Arc::new(Self { spec, state: Mutex::new(CardState::default()) })
    }

    /// A soft card from a size or catalogue name; see [`CardSpec::parse`].
    pub fn parse(label: &str) -> Result<Arc<Self>, SimError> {
        CardSpec::parse(label).map(Self::new)
    }

    /// A hard card from a size or catalogue name, with no context overhead: every byte of it is for the
    /// library, and an allocation past it fails as a real device's would. What a model's tests stream on.
    pub fn hard(label: &str) -> Result<Arc<Self>, SimError> {
        CardSpec::parse(label).map(|spec| Self::new(spec.with_mode(Mode::Hard).with_context_overhead(0)))
    }

    /// The card's spec.
    pub fn spec(&self) -> &CardSpec {
        &self.spec
    }

    /// The card's link and compute figures as the planner's time model (its pageable fraction too, so the
    /// predictions price pinned and pageable copies as the card does).
    pub fn time_model(&self) -> offload_core::plan::TimeModel {
        let timing = self.spec.timing;
        let mut time = offload_core::plan::TimeModel::new(
            timing.link_bytes_per_second,
            timing.link_latency.as_secs_f64(),
            timing.flops_per_second,
        );
        time.pageable_fraction = timing.pageable_fraction;
        time
    }

    /// The facts a plan for this card is made from: its readings, its time model, its label, and `host`.
    pub fn device_facts(self: &Arc<Self>, host: offload_core::plan::HostMemory) -> offload_core::plan::DeviceFacts {
        offload_core::plan::DeviceFacts::new(self.clone(), host)
            .with_time(self.time_model())
            .with_label(&self.spec.label)
    }

    /// Replaces the injected faults.
    pub fn set_faults(&self, faults: Faults) {
        self.state.lock().faults = faults;
    }

    /// What the card has seen so far.
    pub fn stats(&self) -> CardStats {
        self.state.lock().stats
    }

    /// Makes `available` read `bytes` whatever is allocated (`None` goes back to the real reading): the anchor's
    /// `_patch_memory_stats`, for tests of decisions made on a reading. Allocations are unaffected (in hard mode
    /// they still fail past the capacity).
    pub fn patch_available(&self, bytes: Option<u64>) {
        self.state.lock().patched_available = bytes;
    }

    /// Starts the peak again from what is allocated now: the one explicit reset, the only call that lowers the peak
    /// (between resets it only rises, the [`DeviceMemory`] contract).
    pub fn reset_peak(&self) {
        let mut state = self.state.lock();
        state.peak = state.allocated;
    }

    /// The ledger calls the card received, in order (the first [`LOG_LIMIT`]).
    pub fn log(&self) -> Vec<LedgerCall> {
        self.state.lock().log.clone()
    }

    /// Charges compute time for `flops`.
    pub fn compute(&self, flops: f64) {
        self.state.lock().stats.compute_seconds += self.spec.timing.compute_seconds(flops);
    }

    fn usable(&self) -> u64 {
        self.spec.usable()
    }
}

impl DeviceMemory for SimCard {
    fn device(&self) -> DeviceName {
        self.spec.device.clone()
    }

    fn total(&self) -> u64 {
        self.spec.capacity
    }

    fn available(&self) -> u64 {
        let state = self.state.lock();
        state.patched_available.unwrap_or_else(|| self.usable().saturating_sub(state.allocated))
    }

    fn allocated(&self) -> u64 {
        self.state.lock().allocated
    }

    fn peak(&self) -> u64 {
        self.state.lock().peak
    }
}

impl DeviceLedger for SimCard {
    fn allocate(&self, bytes: u64) -> Result<(), ComponentError> {
        let mut state = self.state.lock();
        state.stats.allocations += 1;
        let ordinal = state.stats.allocations;
        let available = self.usable().saturating_sub(state.allocated);
        let injected = state.faults.fail_allocation == Some(ordinal);
        if injected || (self.spec.mode == Mode::Hard && bytes > available) {
            state.stats.failed_allocations += 1;
            state.note(LedgerCall::Allocate { bytes, granted: false });
            return Err(ComponentError::OutOfMemory { device: self.spec.device.clone(), requested: bytes, available });
        }
        state.note(LedgerCall::Allocate { bytes, granted: true });
        state.allocated += bytes;
        state.peak = state.peak.max(state.allocated);
        Ok(())
    }

    fn free(&self, bytes: u64) {
        let mut state = self.state.lock();
        state.note(LedgerCall::Free { bytes });
        state.allocated = state.allocated.saturating_sub(bytes);
    }

    fn transfer(&self, bytes: u64, direction: Direction) -> Result<(), ComponentError> {
        self.copy(bytes, direction, false)
    }

    fn transfer_pinned(&self, bytes: u64) -> Result<(), ComponentError> {
        self.copy(bytes, Direction::HostToDevice, true)
    }

    fn transfer_from_peer(&self, bytes: u64, seconds: f64) -> Result<(), ComponentError> {
        self.copy_priced(bytes, Direction::HostToDevice, false, Some(seconds))
    }
}

impl SimCard {
    /// One copy across the simulated link: counted, failed when injected, priced at the link rate (pinned, or
    /// back to the host) or at the pageable rate, and slept for when real time is asked for.
    fn copy(&self, bytes: u64, direction: Direction, pinned: bool) -> Result<(), ComponentError> {
        self.copy_priced(bytes, direction, pinned, None)
    }

    /// [`copy`](Self::copy), at `peer_seconds` when the copy comes from another card's memory over the donor's
    /// link (counted in [`CardStats::bytes_from_peers`]).
    fn copy_priced(
        &self,
        bytes: u64,
        direction: Direction,
        pinned: bool,
        peer_seconds: Option<f64>,
    ) -> Result<(), ComponentError> {
        let sleep = {
            let mut state = self.state.lock();
            state.stats.transfers += 1;
            let done = state.faults.fail_transfer != Some(state.stats.transfers);
            state.note(LedgerCall::Transfer { bytes, direction, pinned, done });
            if !done {
                return Err(ComponentError::Transfer {
                    what: format!("{} across the simulated link", format_size(bytes)),
                    message: format!("injected fault on transfer #{}", state.stats.transfers),
                });
            }
            let timing = &self.spec.timing;
            let seconds = match (peer_seconds, direction) {
                (Some(seconds), _) => seconds,
                (None, Direction::HostToDevice) if !pinned => timing.pageable_transfer_seconds(bytes),
                (None, _) => timing.transfer_seconds(bytes),
            } * state.faults.link_slowdown.unwrap_or(1.0);
            state.stats.transfer_seconds += seconds;
            match direction {
                Direction::HostToDevice => state.stats.bytes_to_device += bytes,
                Direction::DeviceToHost => state.stats.bytes_to_host += bytes,
            }
            if pinned {
                state.stats.bytes_pinned_to_device += bytes;
            }
            if peer_seconds.is_some() {
                state.stats.bytes_from_peers += bytes;
            }
            state.faults.real_time_scale.map(|scale| Duration::from_secs_f64(seconds * scale))
        };
        // Sleep without the lock, so a prefetch thread's transfer overlaps another thread's compute.
        if let Some(duration) = sleep {
            std::thread::sleep(duration);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_log_patched_readings_and_a_reset_peak_are_what_a_test_asks_for() {
        let card = SimCard::new(CardSpec::parse("1000").unwrap().with_mode(Mode::Hard).with_context_overhead(0));
        card.allocate(600).unwrap();
        card.transfer(600, Direction::HostToDevice).unwrap();
        assert!(card.allocate(500).is_err());
        card.free(600);
        let calls: Vec<String> = card.log().iter().map(ToString::to_string).collect();
        assert_eq!(calls, ["allocate 600", "transfer 600", "allocate 500 failed", "free 600"]);
        assert_eq!(card.peak(), 600);
        card.reset_peak();
        assert_eq!(card.peak(), 0);
        card.patch_available(Some(42));
        assert_eq!(card.available(), 42, "a patched reading ignores the allocations");
        assert!(card.allocate(1001).is_err(), "a patched reading does not lift the hard cap");
        card.patch_available(None);
        assert_eq!(card.available(), 1000);
    }

    #[test]
    fn cards_come_from_sizes_or_the_catalogue() {
        let card = CardSpec::parse("16GB").unwrap();
        assert_eq!(card.capacity, 16_000_000_000);
        assert_eq!(card.timing, Timing::GENERIC);
        assert_eq!(CardSpec::parse("13.5GiB").unwrap().capacity, 14_495_514_624);
        let h200 = CardSpec::parse("H200").unwrap();
        assert_eq!(h200.capacity, 143771 * MIB);
        assert_eq!(h200.timing.link_bytes_per_second, 63e9);
    }

    #[test]
    fn unknown_names_list_the_catalogue_and_bad_sizes_say_why() {
        let err = CardSpec::parse("rtx9090").unwrap_err();
        assert!(matches!(err, SimError::UnknownCard { .. }));
        let message = err.to_string();
        assert!(message.contains("rtx4090") && message.contains("h200") && message.contains("16GB"), "{message}");
        assert!(matches!(CardSpec::parse("16 bananas"), Err(SimError::Size(_))));
        assert!(matches!(CardSpec::parse("0GB"), Err(SimError::ImpossibleCard { .. })));
    }

    #[test]
    fn pageable_copies_cost_more_than_pinned_ones_when_the_card_says_so() {
        let spec = CardSpec::parse("1GiB").unwrap().with_context_overhead(0);
        let same = SimCard::new(spec.clone());
        same.transfer(1_000_000, Direction::HostToDevice).unwrap();
        same.transfer_pinned(1_000_000).unwrap();
        let stats = same.stats();
        assert_eq!(stats.bytes_to_device, 2_000_000);
        assert_eq!(stats.bytes_pinned_to_device, 1_000_000);
        let each = Timing::GENERIC.transfer_seconds(1_000_000);
        assert!((stats.transfer_seconds - 2.0 * each).abs() < 1e-15, "the default prices both at the link rate");

        let half = SimCard::new(spec.clone().with_pageable_fraction(0.5).unwrap());
        half.transfer(1_000_000, Direction::HostToDevice).unwrap();
        let pageable = half.stats().transfer_seconds;
        half.transfer_pinned(1_000_000).unwrap();
        let pinned = half.stats().transfer_seconds - pageable;
        let latency = Timing::GENERIC.link_latency.as_secs_f64();
        assert!(((pageable - latency) / (pinned - latency) - 2.0).abs() < 1e-9, "{pageable} vs {pinned}");
        // Copies back to the host are not staged: the link rate.
        half.transfer(1_000_000, Direction::DeviceToHost).unwrap();
        assert!((half.stats().transfer_seconds - pageable - 2.0 * pinned).abs() < 1e-15);

        for bad in [0.0, -1.0, 1.5, f64::NAN] {
            assert!(matches!(spec.clone().with_pageable_fraction(bad), Err(SimError::ImpossibleCard { .. })), "{bad}");
        }
    }

    #[test]
    fn a_reserve_larger_than_the_card_is_an_error() {
        let card = CardSpec::parse("4GB").unwrap();
        assert!(card.check_reserve(3_000_000_000).is_ok());
        assert!(matches!(card.check_reserve(4_000_000_000), Err(SimError::ImpossibleCard { .. })));
    }

    #[test]
    fn soft_mode_only_changes_readings_and_hard_mode_fails() {
        let soft = SimCard::new(CardSpec::parse("1GiB").unwrap().with_context_overhead(0));
        soft.allocate(2 << 30).unwrap();
        assert_eq!(soft.available(), 0);
        assert_eq!(soft.peak(), 2 << 30);
        let hard = SimCard::new(CardSpec::parse("1GiB").unwrap().with_mode(Mode::Hard).with_context_overhead(1 << 20));
        let err = hard.allocate(1 << 30).unwrap_err();
        assert!(err.is_out_of_memory());
        assert_eq!(hard.allocated(), 0);
        hard.allocate((1 << 30) - (1 << 20)).unwrap();
        assert_eq!(hard.available(), 0);
        hard.free(1 << 20);
        assert_eq!(hard.available(), 1 << 20);
    }

    #[test]
    fn faults_fail_the_nth_allocation_and_transfer_and_slow_the_link() {
        let card = SimCard::new(CardSpec::parse("1GiB").unwrap());
        card.set_faults(Faults {
            fail_allocation: Some(2),
            fail_transfer: Some(1),
            link_slowdown: Some(2.0),
            ..Faults::default()
        });
        card.allocate(10).unwrap();
        assert!(card.allocate(10).unwrap_err().is_out_of_memory());
        card.allocate(10).unwrap();
        assert!(matches!(card.transfer(1000, Direction::HostToDevice), Err(ComponentError::Transfer { .. })));
        card.transfer(31_500_000, Direction::HostToDevice).unwrap();
        let stats = card.stats();
        assert_eq!(stats.bytes_to_device, 31_500_000);
        assert!((stats.transfer_seconds - 2.0 * (0.001 + 10e-6)).abs() < 1e-12, "{}", stats.transfer_seconds);
    }

    #[test]
    fn the_peak_only_rises_between_explicit_resets() {
        let card = SimCard::new(CardSpec::parse("1000").unwrap().with_mode(Mode::Hard).with_context_overhead(0));
        let mut last = card.peak();
        for (step, bytes) in [300u64, 200, 400, 100, 250, 50].into_iter().enumerate() {
            if step % 2 == 0 {
                let _ = card.allocate(bytes);
            } else {
                card.free(bytes);
            }
            let _ = card.available();
            assert!(card.peak() >= last, "step {step}: the peak fell from {last} to {}", card.peak());
            last = card.peak();
        }
        card.reset_peak();
        assert_eq!(card.peak(), card.allocated(), "a reset starts again from what is allocated");
    }
}
