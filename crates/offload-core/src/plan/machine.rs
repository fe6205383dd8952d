//! The machine a plan is made for: device memory, host memory, and the time model its predictions use.

use std::sync::Arc;

use crate::device::DeviceMemory;
use crate::plan::error::PlanError;
use crate::plan::footprint::{CallFootprint, Footprint};
use crate::plan::host::HostMemory;
use crate::plan::link::{LinkSource, MeasuredDisk, MeasuredLink, MeasuredPeer};

/// What the plan predicts time from: plain numbers, passed in by the caller (`memory-sim`'s card timing, a
/// measured link, a datasheet).
///
/// A call's compute takes `flops / flops_per_second`; a copy of `b` bytes from pinned host memory takes
/// `b / link_bytes_per_second + link_latency_seconds`, from pageable memory `pageable_fraction` times slower,
/// and from the checkpoint file or the disk store `b / disk_bytes_per_second` more (the read, then a pageable
/// copy). With prefetch, transfers overlap compute (a call takes the longer of the two); without, they add up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeModel {
    /// Host-to-device bandwidth from pinned memory, bytes per second.
    pub link_bytes_per_second: f64,
    /// Fixed cost of one transfer, seconds.
    pub link_latency_seconds: f64,
    /// Device throughput, FLOP per second.
    pub flops_per_second: f64,
    /// The share of the pinned bandwidth a copy from pageable memory reaches (0 to 1).
    pub pageable_fraction: f64,
    /// Read bandwidth of the disk the host copies read from when they are not in RAM (the checkpoint file or the
    /// disk store), bytes per second.
    pub disk_bytes_per_second: f64,
    /// Where the link figures came from: [`generic`](Self::generic) is assumed, [`new`](Self::new) given, and
    /// [`MeasuredLink::apply`](crate::plan::MeasuredLink::apply) measured.
    pub link_source: LinkSource,
    /// Where the disk rate came from: assumed ([`DEFAULT_DISK_BYTES_PER_SECOND`](Self::DEFAULT_DISK_BYTES_PER_SECOND)),
    /// given ([`with_disk_rate`](Self::with_disk_rate)), or measured
    /// ([`MeasuredDisk::apply`](crate::plan::MeasuredDisk::apply)).
    pub disk_source: LinkSource,
}

impl TimeModel {
    /// Pageable copies go through the driver's pinned staging buffer, an extra host copy per transfer; half the
    /// pinned rate is an assumption, not a measurement. Override it with a measured ratio.
    pub const DEFAULT_PAGEABLE_FRACTION: f64 = 0.5;
    /// A PCIe 3.0 NVMe drive's sequential read, about 2 GB/s: an assumption, override it with a measurement.
    pub const DEFAULT_DISK_BYTES_PER_SECOND: f64 = 2e9;

    /// A time model from the link and compute figures, with the default pageable fraction and disk rate.
    pub fn new(link_bytes_per_second: f64, link_latency_seconds: f64, flops_per_second: f64) -> Self {
        Self {
            link_bytes_per_second,
            link_latency_seconds,
            flops_per_second,
            pageable_fraction: Self::DEFAULT_PAGEABLE_FRACTION,
            disk_bytes_per_second: Self::DEFAULT_DISK_BYTES_PER_SECOND,
            link_source: LinkSource::Given,
            disk_source: LinkSource::Assumed,
        }
    }

    /// The same model with the disk read rate given by the caller (a datasheet, a benchmark of the drive).
    pub fn with_disk_rate(mut self, bytes_per_second: f64) -> Self {
        self.disk_bytes_per_second = bytes_per_second;
        self.disk_source = LinkSource::Given;
        self
    }

    /// A PCIe 4.0 x16 link (31.5 GB/s, 10 µs) and 100 TFLOP/s: `memory-sim`'s figures for a card given by size,
    /// and the assumption for a real device nothing has measured yet ([`LinkSource::Assumed`]).
    pub fn generic() -> Self {
        Self { link_source: LinkSource::Assumed, ..Self::new(31.5e9, 10e-6, 100e12) }
    }

    /// Checks that every figure is a finite positive number (latency may be 0) and the pageable fraction is in
    /// (0, 1].
    pub fn validate(&self) -> Result<(), PlanError> {
        let checks: [(&'static str, f64, bool); 5] = [
            ("link_bytes_per_second", self.link_bytes_per_second, self.link_bytes_per_second > 0.0),
            ("link_latency_seconds", self.link_latency_seconds, self.link_latency_seconds >= 0.0),
            ("flops_per_second", self.flops_per_second, self.flops_per_second > 0.0),
            (
                "pageable_fraction",
                self.pageable_fraction,
                self.pageable_fraction > 0.0 && self.pageable_fraction <= 1.0,
            ),
            ("disk_bytes_per_second", self.disk_bytes_per_second, self.disk_bytes_per_second > 0.0),
        ];
        for (field, value, ok) in checks {
            if !(ok && value.is_finite()) {
                return Err(PlanError::InvalidTimeModel { field, value });
            }
        }
        Ok(())
    }

    /// Seconds to compute `flops`.
    pub fn compute_seconds(&self, flops: f64) -> f64 {
        if self.flops_per_second > 0.0 { flops / self.flops_per_second } else { 0.0 }
    }

    /// The rate of a copy from pageable memory: the link's, times the pageable fraction (at least 1% of it).
    pub fn pageable_bytes_per_second(&self) -> f64 {
        self.link_bytes_per_second * self.pageable_fraction.clamp(0.01, 1.0)
    }

    /// Seconds of the copies of `pinned` bytes from page-locked memory, `pageable` from pageable memory and `disk`
    /// read from a file then copied as pageable, with `transfers` copies' latency.
    pub fn transfer_seconds(&self, pinned: u64, pageable: u64, disk: u64, transfers: u64) -> f64 {
        let rate =
            |bytes: u64, per_second: f64| if bytes == 0 || per_second <= 0.0 { 0.0 } else { bytes as f64 / per_second };
        let pageable_rate = self.pageable_bytes_per_second();
        // A disk-backed group is read from the file, then copied like pageable memory.
        rate(pinned, self.link_bytes_per_second)
            + rate(pageable + disk, pageable_rate)
            + rate(disk, self.disk_bytes_per_second)
            + transfers as f64 * self.link_latency_seconds
    }
}

impl Default for TimeModel {
    fn default() -> Self {
        Self::generic()
    }
}

/// The facts a plan is decided from: the device's memory, the host's memory and the time model.
///
/// ```
/// use offload_core::plan::{HostMemory, Machine};
/// let machine = Machine::new(8_000_000_000, 7_350_000_000, HostMemory::new(32_000_000_000, 28_800_000_000));
/// assert_eq!(machine.device_available, 7_350_000_000);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    /// The device's capacity in bytes.
    pub device_total: u64,
    /// What the device can give the pipeline: capacity less the context and anything else already there.
    pub device_available: u64,
    /// Host RAM.
    pub host: HostMemory,
    /// Link and compute figures for predictions.
    pub time: TimeModel,
    /// Further devices whose free memory can hold streamed groups between their uploads (donors), each with the
    /// link its copies cross to the execution device. Empty by default: the plan places streamed groups over
    /// host RAM and the checkpoint file only.
    pub peers: Vec<PeerDevice>,
}

/// A further device that can hold streamed groups for the execution device: a second GPU's free memory, copied
/// over its link (NVLink, PCIe) at every upload instead of from the host.
///
/// ```
/// use offload_core::plan::{LinkSource, PeerDevice};
/// let peer = PeerDevice::new("cuda:1", 24_000_000_000, 50e9, 10e-6).with_source(LinkSource::Given);
/// assert_eq!(peer.seconds_per_gb(), 0.02);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct PeerDevice {
    /// Its name, as the run names it (`cuda:1`).
    pub name: String,
    /// The bytes it can give streamed groups: its free memory less what its own components need.
    pub bytes: u64,
    /// The rate of its copies to the execution device, bytes per second.
    pub bytes_per_second: f64,
    /// The fixed cost of one copy, seconds.
    pub latency_seconds: f64,
    /// Where the rate came from: measured by a link meter, given (a simulated card's link, a datasheet), assumed.
    pub source: LinkSource,
}

/// What a component's plan holds on one peer ([`ComponentPlan::peers`](crate::plan::ComponentPlan::peers)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerShare {
    /// The peer's name ([`PeerDevice::name`]).
    pub peer: String,
    /// How many of the component's streamed groups it holds.
    pub groups: usize,
    /// Their bytes: what the run's donor holds at most for this component.
    pub bytes: u64,
    /// Each of those groups' bytes, in call order, where the component's layout gives every group's size: a run's
    /// donor then takes exactly groups of these sizes (`GroupOptions::donor_groups`), as the search placed them.
    /// Empty where the sizes are estimates (leaves counted, not measured): the donor then holds up to `bytes`.
    pub group_bytes: Vec<u64>,
}

impl PeerDevice {
    /// A peer of `bytes` free, its copies at `bytes_per_second` with `latency_seconds` each; its rate given.
    pub fn new(name: &str, bytes: u64, bytes_per_second: f64, latency_seconds: f64) -> Self {
        Self { name: name.into(), bytes, bytes_per_second, latency_seconds, source: LinkSource::Given }
    }

    /// The same peer, its rate from `source`.
    pub fn with_source(mut self, source: LinkSource) -> Self {
        self.source = source;
        self
    }

    /// The same peer, its rate the one earlier runs measured for its copies onto the execution device
    /// ([`ProfileStore::measured_peer`](crate::plan::ProfileStore::measured_peer), feature `io`) and its source
    /// marked measured; `None` (nothing measured yet) leaves the declared rate. The latency is kept, as a measured
    /// host link keeps it.
    ///
    /// ```
    /// use offload_core::plan::{LinkSource, MeasuredPeer, PeerDevice};
    /// let declared = PeerDevice::new("cuda:1", 4_000_000_000, 50e9, 0.0);
    /// let measured = MeasuredPeer { median: 3.1e9, p10: 2.9e9, runs: 2, copies: 26 };
    /// let peer = declared.clone().with_measured(Some(measured));
    /// assert_eq!((peer.bytes_per_second, peer.source), (3.1e9, LinkSource::Measured { runs: 2, uploads: 26 }));
    /// assert_eq!(declared.clone().with_measured(None), declared);
    /// ```
    pub fn with_measured(mut self, measured: Option<MeasuredPeer>) -> Self {
        if let Some(measured) = measured.filter(|m| m.median.is_finite() && m.median > 0.0) {
            self.bytes_per_second = measured.median;
            self.source = LinkSource::Measured { runs: measured.runs, uploads: measured.copies };
        }
        self
    }

    /// Seconds per GB copied from it, latency left out.
    pub fn seconds_per_gb(&self) -> f64 {
        1e9 / self.bytes_per_second
    }

    /// Checks the rate and latency: finite, the rate positive.
    pub fn validate(&self) -> Result<(), PlanError> {
        if !(self.bytes_per_second.is_finite() && self.bytes_per_second > 0.0) {
            return Err(PlanError::InvalidDonors {
                problem: format!(
                    "peer {} has a link rate of {} bytes/s; give a finite positive rate (measured or from a datasheet)",
                    self.name, self.bytes_per_second
                ),
            });
        }
        if !(self.latency_seconds.is_finite() && self.latency_seconds >= 0.0) {
            return Err(PlanError::InvalidDonors {
                problem: format!(
                    "peer {} has a latency of {} s; give a finite, non-negative latency",
                    self.name, self.latency_seconds
                ),
            });
        }
        Ok(())
    }
}

impl Machine {
    /// A machine from explicit device numbers (`available` is capped at `total`) and a host reading, with the
    /// generic time model.
    pub fn new(device_total: u64, device_available: u64, host: HostMemory) -> Self {
        Self {
            device_total,
            device_available: device_available.min(device_total),
            host,
            time: TimeModel::generic(),
            peers: Vec::new(),
        }
    }

    /// The same machine with a further device that can hold streamed groups ([`PeerDevice`]).
    pub fn with_peer(mut self, peer: PeerDevice) -> Self {
        self.peers.push(peer);
        self
    }

    /// A machine from a device's current readings. Read it before the pipeline's weights load, or the plan sees
    /// a device already partly filled by them.
    pub fn from_device(device: &dyn DeviceMemory, host: HostMemory) -> Self {
        Self::new(device.total(), device.available(), host)
    }

    /// The same machine with another time model.
    pub fn with_time(mut self, time: TimeModel) -> Self {
        self.time = time;
        self
    }

    /// The same machine with host `available` replaced (the `host_available` setting).
    pub fn with_host_available(mut self, available: u64) -> Self {
        self.host = self.host.with_available(available);
        self
    }
}

/// The facts about the execution device a plan is made from: its memory readings, the host's RAM, the time
/// model of its link and compute, and a label that identifies it in capacity profiles.
#[derive(Clone)]
pub struct DeviceFacts {
    /// Readings of the execution device (a simulated card, or a real device's readings). The manager's auto
    /// offload reads it too.
    pub memory: Arc<dyn DeviceMemory>,
    /// Host RAM, from `HostMemory::read` (feature `io`) or given; the `host_available` setting replaces its `available`.
    pub host: HostMemory,
    /// Link and compute figures for the predictions.
    pub time: TimeModel,
    /// The device's label in capacity profiles (`"12MB"`, `"rtx4090"`, `"cuda:0"`).
    pub label: String,
    /// Components' footprints measured on this device ([`Footprint`]): the plan counts a matching component's
    /// weights on the device in these bytes. Empty where nothing was measured (a simulated card, a first run).
    pub footprints: Vec<Footprint>,
    /// Components' call footprints measured on this device ([`CallFootprint`]): the plan counts a matching call
    /// as the larger of its estimate and these pages. Empty where nothing was measured.
    pub call_footprints: Vec<CallFootprint>,
    /// Further devices that can hold streamed groups ([`Machine::peers`]); empty by default.
    pub peers: Vec<PeerDevice>,
}

impl std::fmt::Debug for DeviceFacts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFacts")
            .field("device", &self.memory.device().as_str().to_string())
            .field("host", &self.host)
            .field("label", &self.label)
            .field("footprints", &self.footprints)
            .field("call_footprints", &self.call_footprints)
            .field("peers", &self.peers)
            .finish()
    }
}

impl DeviceFacts {
    /// Facts from device readings and a host reading, with the generic time model (PCIe 4.0 x16, 100 TFLOP/s)
    /// and the device's name as label.
    pub fn new(memory: Arc<dyn DeviceMemory>, host: HostMemory) -> Self {
        let label = memory.device().as_str().to_string();
        Self {
            memory,
            host,
            time: TimeModel::generic(),
            label,
            footprints: Vec::new(),
            call_footprints: Vec::new(),
            peers: Vec::new(),
        }
    }

    /// The same facts with the footprints measured on this device (by this process's manager,
    /// [`ComponentsManager::device_footprints`](crate::ComponentsManager::device_footprints), or stored by earlier
    /// runs); later ones replace earlier ones of the same component and size.
    pub fn with_footprints(mut self, footprints: impl IntoIterator<Item = Footprint>) -> Self {
        self.footprints.extend(footprints);
        self
    }

    /// The same facts with the call footprints measured on this device (by this process's manager,
    /// [`ComponentsManager::call_footprints`](crate::ComponentsManager::call_footprints), or stored by earlier
    /// runs); later ones replace earlier ones of the same component and estimate.
    pub fn with_call_footprints(mut self, calls: impl IntoIterator<Item = CallFootprint>) -> Self {
        self.call_footprints.extend(calls);
        self
    }

    /// The same facts with another label.
    pub fn with_label(mut self, label: &str) -> Self {
        self.label = label.to_string();
        self
    }

    /// The same facts with another time model.
    pub fn with_time(mut self, time: TimeModel) -> Self {
        self.time = time;
        self
    }

    /// The same facts with the link figures earlier runs measured on this device
    /// ([`MeasuredLink::apply`]); `None` leaves them as they are. A simulated card's link is the card's own and
    /// should not be replaced by a host copy's rate: call this for real devices.
    pub fn with_measured_link(mut self, link: Option<MeasuredLink>) -> Self {
        if let Some(link) = link {
            self.time = link.apply(self.time);
        }
        self
    }

    /// The same facts with the disk read rate earlier runs measured reading host copies from the checkpoint file
    /// or the disk store ([`MeasuredDisk::apply`]); `None` leaves the time model's disk rate as it is.
    pub fn with_measured_disk(mut self, disk: Option<MeasuredDisk>) -> Self {
        if let Some(disk) = disk {
            self.time = disk.apply(self.time);
        }
        self
    }

    /// The same facts with a further device that can hold streamed groups ([`PeerDevice`]).
    pub fn with_peer(mut self, peer: PeerDevice) -> Self {
        self.peers.push(peer);
        self
    }

    /// The planner's machine, read now: the device's total and available bytes, the host, the time model, the
    /// peers.
    pub fn machine(&self) -> Machine {
        let mut machine = Machine::from_device(&*self.memory, self.host).with_time(self.time);
        machine.peers = self.peers.clone();
        machine
    }
}

// The measured figures apply to a time model here, beside it, so the link module needs nothing of this one.
impl MeasuredLink {
    /// `time` with its link figures replaced by these:
    /// - page-locked and pageable both measured: the page-locked rate, and their ratio as the pageable fraction;
    /// - page-locked only: that rate, the pageable fraction kept as it was;
    /// - pageable only: that rate for both, pageable fraction 1. Nothing was page-locked, so no faster copy was
    ///   seen; on wgpu, which has no page-locked memory, that is the device's truth, and on CUDA pinning is
    ///   predicted to gain nothing until a run that pins measures it.
    ///
    /// The link latency is kept: a copy's rate already includes its fixed cost.
    pub fn apply(&self, time: TimeModel) -> TimeModel {
        let valid = |rate: Option<f64>| rate.filter(|r| r.is_finite() && *r > 0.0);
        let (link, fraction) = match (valid(self.page_locked), valid(self.pageable)) {
            (Some(locked), Some(pageable)) => (locked, (pageable / locked).clamp(0.01, 1.0)),
            (Some(locked), None) => (locked, time.pageable_fraction),
            (None, Some(pageable)) => (pageable, 1.0),
            (None, None) => return time,
        };
        TimeModel {
            link_bytes_per_second: link,
            pageable_fraction: fraction,
            link_source: LinkSource::Measured { runs: self.runs, uploads: self.uploads },
            ..time
        }
    }
}

impl MeasuredDisk {
    /// `time` with its disk rate replaced by the measured median, and its source marked measured.
    pub fn apply(&self, time: TimeModel) -> TimeModel {
        TimeModel {
            disk_bytes_per_second: self.median,
            disk_source: LinkSource::Measured { runs: self.runs, uploads: self.reads },
            ..time
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pageable_and_disk_copies_are_slower_than_pinned() {
        let time = TimeModel::new(10e9, 0.0, 1e12);
        assert!((time.transfer_seconds(10_000_000_000, 0, 0, 0) - 1.0).abs() < 1e-9);
        assert!((time.transfer_seconds(0, 10_000_000_000, 0, 0) - 2.0).abs() < 1e-9);
        assert!((time.transfer_seconds(0, 0, 10_000_000_000, 0) - 7.0).abs() < 1e-9);
        assert!((time.compute_seconds(5e11) - 0.5).abs() < 1e-12);
        let with_latency = TimeModel::new(10e9, 1e-3, 1e12);
        assert!((with_latency.transfer_seconds(0, 0, 0, 10) - 0.01).abs() < 1e-12);
    }

    #[test]
    fn a_time_model_with_impossible_figures_is_refused() {
        assert!(TimeModel::generic().validate().is_ok());
        let err = TimeModel::new(0.0, 0.0, 1e12).validate().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.starts_with("invalid time model: link_bytes_per_second is 0"), "{err}");
        let nan = TimeModel { pageable_fraction: f64::NAN, ..TimeModel::generic() };
        assert!(nan.validate().is_err());
        let over = TimeModel { pageable_fraction: 1.5, ..TimeModel::generic() };
        assert!(over.validate().is_err());
    }
}
