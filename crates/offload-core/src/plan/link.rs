//! The link speed a plan predicts with, and where it came from: assumed, given, or measured on this device by
//! earlier runs and kept beside the capacity profiles.
//!
//! A run measures its copies with a [`LinkMeter`](crate::link::LinkMeter); at its end the caller stores the run's
//! [`LinkRun`] under the device's label (`ProfileStore::record_link`, feature `io`). The next plan for that device
//! reads the [`MeasuredLink`] back (`ProfileStore::measured_link`) and hands it to
//! [`DeviceFacts::with_measured_link`](crate::plan::DeviceFacts::with_measured_link), which replaces the time
//! model's link figures. The planner itself does no I/O: what it predicts from is what its caller passed in.
//!
//! The disk rate is kept the same way: a run that reads host copies from the checkpoint file or the disk store
//! times each group's read, stores the run's [`DiskRun`] under the disk's label (`ProfileStore::record_disk`), and
//! the next plan reads the [`MeasuredDisk`] back (`ProfileStore::measured_disk`) and hands it to
//! [`DeviceFacts::with_measured_disk`](crate::plan::DeviceFacts::with_measured_disk).

use std::fmt;

#[cfg(feature = "io")]
use serde::{Deserialize, Serialize};

use crate::link::LinkRate;

/// Where a [`TimeModel`](crate::plan::TimeModel)'s link figures came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkSource {
    /// A generic figure (PCIe 4.0 x16) that nothing on this machine confirmed.
    #[default]
    Assumed,
    /// Passed in by the caller: a simulated card's link, a datasheet.
    Given,
    /// Measured by the clock on this device: the median over `runs` stored runs of `uploads` copies in all.
    Measured {
        /// Runs the figure is the median of.
        runs: usize,
        /// Copies those runs timed.
        uploads: u64,
    },
}

impl fmt::Display for LinkSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Assumed => write!(f, "assumed, not measured: a run on this device measures it"),
            Self::Given => write!(f, "given"),
            Self::Measured { runs: 1, uploads } => write!(f, "measured: one run's median, {uploads} copies"),
            Self::Measured { runs, uploads } => {
                write!(f, "measured: the median of {runs} runs' medians, {uploads} copies")
            }
        }
    }
}

/// How many runs' link figures a device keeps, newest last.
pub const MAX_LINK_RUNS: usize = 16;

/// One run's link figures, as stored.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct LinkRun {
    /// Median rate of its copies from pageable memory, bytes per second (`None`: it made none).
    #[cfg_attr(feature = "io", serde(default, skip_serializing_if = "Option::is_none"))]
    pub pageable: Option<f64>,
    /// Median rate of its copies from page-locked memory, bytes per second (`None`: it made none).
    #[cfg_attr(feature = "io", serde(default, skip_serializing_if = "Option::is_none"))]
    pub page_locked: Option<f64>,
    /// The 10th percentile of all its copies' rates, bytes per second.
    pub p10: f64,
    /// Copies it timed.
    pub uploads: u64,
    /// Their bytes.
    pub bytes: u64,
    /// When it ran, seconds since the Unix epoch.
    pub at: u64,
}

impl LinkRun {
    /// A run's figures from its copies' rates: all of them, those from pageable memory and those from
    /// page-locked memory (as [`LinkMeter::rate`](crate::link::LinkMeter::rate) and
    /// [`rate_of`](crate::link::LinkMeter::rate_of) give them); `None` when it made no copy.
    pub fn from_rates(
        all: Option<LinkRate>,
        pageable: Option<LinkRate>,
        page_locked: Option<LinkRate>,
    ) -> Option<Self> {
        let all = all?;
        Some(Self {
            pageable: pageable.map(|r| r.median),
            page_locked: page_locked.map(|r| r.median),
            p10: all.p10,
            uploads: all.uploads as u64,
            bytes: all.bytes,
            at: 0,
        })
    }
}

/// The link speed measured on one device: per kind of source memory, the median of the stored runs' medians.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredLink {
    /// From pageable memory, bytes per second.
    pub pageable: Option<f64>,
    /// From page-locked memory, bytes per second.
    pub page_locked: Option<f64>,
    /// The median of the runs' 10th percentiles, bytes per second.
    pub p10: f64,
    /// Runs it is made from.
    pub runs: usize,
    /// Copies those runs timed.
    pub uploads: u64,
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    Some(if values.len() % 2 == 1 { values[middle] } else { (values[middle - 1] + values[middle]) / 2.0 })
}

impl MeasuredLink {
    /// The figures of `runs`; `None` when no run made a copy.
    ///
    /// ```
    /// use offload_core::plan::{LinkRun, MeasuredLink};
    /// let run = |gb: f64| LinkRun { pageable: Some(gb * 1e9), page_locked: None, p10: gb * 0.5e9, uploads: 10, bytes: 1, at: 0 };
    /// let link = MeasuredLink::from_runs(&[run(1.0), run(9.0), run(2.0)]).unwrap();
    /// assert_eq!((link.pageable, link.page_locked, link.runs, link.uploads), (Some(2e9), None, 3, 30));
    /// ```
    pub fn from_runs(runs: &[LinkRun]) -> Option<Self> {
        let timed: Vec<&LinkRun> = runs.iter().filter(|r| r.uploads > 0).collect();
        let p10 = median(timed.iter().map(|r| r.p10).collect())?;
        Some(Self {
            pageable: median(timed.iter().filter_map(|r| r.pageable).collect()),
            page_locked: median(timed.iter().filter_map(|r| r.page_locked).collect()),
            p10,
            runs: timed.len(),
            uploads: timed.iter().map(|r| r.uploads).sum(),
        })
    }
}

impl fmt::Display for MeasuredLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gb = |rate: Option<f64>| rate.map_or("none timed".to_string(), crate::format_rate);
        let runs = if self.runs == 1 { "one run".to_string() } else { format!("median of {} runs", self.runs) };
        write!(
            f,
            "pageable {}, page-locked {}, 10th percentile {} ({runs}, {} copies)",
            gb(self.pageable),
            gb(self.page_locked),
            crate::format_rate(self.p10),
            self.uploads
        )
    }
}

/// How many runs' disk figures a disk keeps, newest last.
pub const MAX_DISK_RUNS: usize = 16;

/// One run's disk figures, as stored: the rates of the reads it timed of host copies from the checkpoint file or
/// the disk store (one per group upload that read the disk).
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct DiskRun {
    /// The median read's rate, bytes per second.
    pub median: f64,
    /// The 10th percentile of its reads' rates (nine reads in ten were at least this fast), bytes per second.
    pub p10: f64,
    /// Reads it timed.
    pub reads: u64,
    /// Their bytes.
    pub bytes: u64,
    /// When it ran, seconds since the Unix epoch.
    pub at: u64,
}

impl DiskRun {
    /// A run's figures from the rates of its timed reads (a disk meter's,
    /// [`DiskMeter::rate`](crate::link::DiskMeter::rate)); `None` when it timed no read.
    pub fn from_rate(reads: Option<crate::link::DiskRate>) -> Option<Self> {
        let rate = reads?;
        Some(Self { median: rate.median, p10: rate.p10, reads: rate.reads as u64, bytes: rate.bytes, at: 0 })
    }
}

/// The disk read rate measured on one disk: the median of the stored runs' medians.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredDisk {
    /// The median of the runs' median read rates, bytes per second.
    pub median: f64,
    /// The median of the runs' 10th percentiles, bytes per second.
    pub p10: f64,
    /// Runs it is made from.
    pub runs: usize,
    /// Reads those runs timed.
    pub reads: u64,
}

impl MeasuredDisk {
    /// The figures of `runs`; `None` when no run timed a read at a positive rate.
    ///
    /// ```
    /// use offload_core::plan::{DiskRun, MeasuredDisk};
    /// let run = |gb: f64| DiskRun { median: gb * 1e9, p10: gb * 0.5e9, reads: 34, bytes: 1, at: 0 };
    /// let disk = MeasuredDisk::from_runs(&[run(3.0), run(0.5), run(2.5)]).unwrap();
    /// assert_eq!((disk.median, disk.runs, disk.reads), (2.5e9, 3, 102));
    /// ```
    pub fn from_runs(runs: &[DiskRun]) -> Option<Self> {
        let figures = RunFigures::of(runs.iter().map(|r| (r.median, r.p10, r.reads)))?;
        Some(Self { median: figures.median, p10: figures.p10, runs: figures.runs, reads: figures.count })
    }
}

/// The medians of stored runs' figures: what a disk's or a peer link's runs measure together.
struct RunFigures {
    median: f64,
    p10: f64,
    runs: usize,
    count: u64,
}

impl RunFigures {
    /// The figures of the runs given as (median rate, 10th percentile, timed count) that timed something at a
    /// finite positive rate; `None` when none did.
    fn of(runs: impl Iterator<Item = (f64, f64, u64)>) -> Option<Self> {
        let timed: Vec<(f64, f64, u64)> =
            runs.filter(|(rate, _, count)| *count > 0 && rate.is_finite() && *rate > 0.0).collect();
        Some(Self {
            median: median(timed.iter().map(|r| r.0).collect())?,
            p10: median(timed.iter().map(|r| r.1).collect())?,
            runs: timed.len(),
            count: timed.iter().map(|r| r.2).sum(),
        })
    }
}

impl fmt::Display for MeasuredDisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_rates(f, "reads", self.median, self.p10, self.runs, self.reads)
    }
}

/// `reads at 0.50 GB/s, 10th percentile 0.25 GB/s (median of 3 runs, 102 reads)`: the measured figures of a disk's
/// reads or a peer's copies (`what`), from `runs` stored runs of `count` of them.
fn write_rates(f: &mut fmt::Formatter<'_>, what: &str, median: f64, p10: f64, runs: usize, count: u64) -> fmt::Result {
    let runs = if runs == 1 { "one run".to_string() } else { format!("median of {runs} runs") };
    let (median, p10) = (crate::format_rate(median), crate::format_rate(p10));
    write!(f, "{what} at {median}, 10th percentile {p10} ({runs}, {count} {what})")
}

/// How many runs' figures a peer link keeps, newest last.
pub const MAX_PEER_RUNS: usize = 16;

/// One run's figures for the copies from a peer's memory onto the execution device (a donor card's groups), as
/// stored: the rates of the copies it timed, one per group upload that came from the peer.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct PeerRun {
    /// The median copy's rate, bytes per second.
    pub median: f64,
    /// The 10th percentile of its copies' rates (nine copies in ten were at least this fast), bytes per second.
    pub p10: f64,
    /// Copies it timed.
    pub copies: u64,
    /// Their bytes.
    pub bytes: u64,
    /// When it ran, seconds since the Unix epoch.
    pub at: u64,
}

impl PeerRun {
    /// A run's figures from the rates of the copies a device's peer meter timed
    /// (`OffloadDevice::peer_link(peer).rate()` in group offload); `None` when it timed none.
    pub fn from_rate(copies: Option<LinkRate>) -> Option<Self> {
        let rate = copies?;
        Some(Self { median: rate.median, p10: rate.p10, copies: rate.uploads as u64, bytes: rate.bytes, at: 0 })
    }
}

/// The rate of a peer's copies onto one execution device, measured: the median of the stored runs' medians. A plan
/// prices that peer's bytes at it in place of the declared rate
/// ([`PeerDevice::with_measured`](crate::plan::PeerDevice::with_measured)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredPeer {
    /// The median of the runs' median copy rates, bytes per second.
    pub median: f64,
    /// The median of the runs' 10th percentiles, bytes per second.
    pub p10: f64,
    /// Runs it is made from.
    pub runs: usize,
    /// Copies those runs timed.
    pub copies: u64,
}

impl MeasuredPeer {
    /// The figures of `runs`; `None` when no run timed a copy at a positive rate.
    ///
    /// ```
    /// use offload_core::plan::{MeasuredPeer, PeerRun};
    /// let run = |gb: f64| PeerRun { median: gb * 1e9, p10: gb * 0.5e9, copies: 9, bytes: 1, at: 0 };
    /// let peer = MeasuredPeer::from_runs(&[run(40.0), run(3.0), run(45.0)]).unwrap();
    /// assert_eq!((peer.median, peer.runs, peer.copies), (40e9, 3, 27));
    /// ```
    pub fn from_runs(runs: &[PeerRun]) -> Option<Self> {
        let figures = RunFigures::of(runs.iter().map(|r| (r.median, r.p10, r.copies)))?;
        Some(Self { median: figures.median, p10: figures.p10, runs: figures.runs, copies: figures.count })
    }
}

impl fmt::Display for MeasuredPeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_rates(f, "copies", self.median, self.p10, self.runs, self.copies)
    }
}

/// One peer link's stored runs (feature `io`): `<profile dir>/peer-<key>.toml`, beside the capacity profiles.
#[cfg(feature = "io")]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PeerProfile {
    /// [`crate::plan::SCHEMA_VERSION`].
    schema_version: u32,
    /// The execution device's label: where the copies went.
    device: String,
    /// The peer's name: where they came from.
    peer: String,
    /// The last [`MAX_PEER_RUNS`] runs, oldest first.
    #[serde(default)]
    runs: Vec<PeerRun>,
}

/// One disk's stored runs (feature `io`): `<profile dir>/disk-<key>.toml`, beside the capacity profiles.
#[cfg(feature = "io")]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct DiskProfile {
    /// [`crate::plan::SCHEMA_VERSION`].
    schema_version: u32,
    /// The disk's label.
    disk: String,
    /// The last [`MAX_DISK_RUNS`] runs, oldest first.
    #[serde(default)]
    runs: Vec<DiskRun>,
}

/// One device's stored runs (feature `io`): `<profile dir>/link-<key>.toml`, beside the capacity profiles.
#[cfg(feature = "io")]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct LinkProfile {
    /// [`crate::plan::SCHEMA_VERSION`].
    schema_version: u32,
    /// The device's label.
    device: String,
    /// The last [`MAX_LINK_RUNS`] runs, oldest first.
    #[serde(default)]
    runs: Vec<LinkRun>,
}

#[cfg(feature = "io")]
mod store {
    use std::path::PathBuf;

    use super::{
        DiskProfile, DiskRun, LinkProfile, LinkRun, MAX_DISK_RUNS, MAX_LINK_RUNS, MAX_PEER_RUNS, MeasuredDisk,
        MeasuredLink, MeasuredPeer, PeerProfile, PeerRun,
    };
    use crate::plan::capacity::{ProfileStore, SCHEMA_VERSION, Workload};
    use crate::plan::error::PlanError;

    /// The name of a device's link file in the store.
    fn link_file(device: &str) -> String {
        format!("link-{}.toml", Workload::named("link").with("device", device).key())
    }

    /// The name of a peer link's file in the store: the copies from `peer` onto `device`.
    fn peer_file(device: &str, peer: &str) -> String {
        format!("peer-{}.toml", Workload::named("peer").with("device", device).with("peer", peer).key())
    }

    /// The name of a disk's read-rate file in the store.
    fn disk_file(disk: &str) -> String {
        format!("disk-{}.toml", Workload::named("disk").with("disk", disk).key())
    }

    /// Adds `run` to `runs`, keeping the last `max`.
    fn keep_latest<T>(runs: &mut Vec<T>, run: T, max: usize) {
        runs.push(run);
        let excess = runs.len().saturating_sub(max);
        runs.drain(..excess);
    }

    impl ProfileStore {
        /// The file of a device's link figures.
        pub fn link_path(&self, device: &str) -> PathBuf {
            self.dir().join(link_file(device))
        }

        fn load_link(&self, device: &str) -> Result<Option<LinkProfile>, PlanError> {
            let path = self.link_path(device);
            let Some(profile) = Self::read_toml::<LinkProfile>(&path)? else { return Ok(None) };
            if profile.schema_version != SCHEMA_VERSION || profile.device != device {
                tracing::warn!(path = %path.display(), "ignoring link figures of another schema or device");
                return Ok(None);
            }
            Ok(Some(profile))
        }

        /// The link speed earlier runs measured on `device`; `None` before the first.
        pub fn measured_link(&self, device: &str) -> Result<Option<MeasuredLink>, PlanError> {
            Ok(self.load_link(device)?.and_then(|p| MeasuredLink::from_runs(&p.runs)))
        }

        /// Stores a run's link figures for `device` (the last [`MAX_LINK_RUNS`] are kept, written atomically),
        /// stamped now, and returns what the device's runs now measure.
        pub fn record_link(&self, device: &str, mut run: LinkRun) -> Result<MeasuredLink, PlanError> {
            let mut profile = self.load_link(device)?.unwrap_or_else(|| LinkProfile {
                schema_version: SCHEMA_VERSION,
                device: device.to_string(),
                runs: Vec::new(),
            });
            run.at = crate::plan::capacity::now();
            keep_latest(&mut profile.runs, run, MAX_LINK_RUNS);
            let path = self.link_path(device);
            self.write_toml(&link_file(device), &profile)?;
            MeasuredLink::from_runs(&profile.runs).ok_or_else(|| PlanError::ProfileFormat {
                path,
                message: "a run with no timed copy was stored; store only runs that made copies".into(),
            })
        }

        /// The file of a disk's read figures. `disk` labels the disk the host copies are read from, as the caller
        /// names it (the checkpoint's directory, or the disk store's).
        pub fn disk_path(&self, disk: &str) -> PathBuf {
            self.dir().join(disk_file(disk))
        }

        fn load_disk(&self, disk: &str) -> Result<Option<DiskProfile>, PlanError> {
            let path = self.disk_path(disk);
            let Some(profile) = Self::read_toml::<DiskProfile>(&path)? else { return Ok(None) };
            if profile.schema_version != SCHEMA_VERSION || profile.disk != disk {
                tracing::warn!(path = %path.display(), "ignoring disk figures of another schema or disk");
                return Ok(None);
            }
            Ok(Some(profile))
        }

        /// The read rate earlier runs measured on `disk`; `None` before the first.
        pub fn measured_disk(&self, disk: &str) -> Result<Option<MeasuredDisk>, PlanError> {
            Ok(self.load_disk(disk)?.and_then(|p| MeasuredDisk::from_runs(&p.runs)))
        }

        /// Stores a run's read figures for `disk` (the last [`MAX_DISK_RUNS`] are kept, written atomically),
        /// stamped now, and returns what the disk's runs now measure. A run that timed no read is refused before
        /// anything is written.
        pub fn record_disk(&self, disk: &str, mut run: DiskRun) -> Result<MeasuredDisk, PlanError> {
            if MeasuredDisk::from_runs(&[run]).is_none() {
                return Err(PlanError::InvalidDiskRun { disk: disk.to_string(), reads: run.reads, median: run.median });
            }
            let path = self.disk_path(disk);
            let mut profile = self.load_disk(disk)?.unwrap_or_else(|| DiskProfile {
                schema_version: SCHEMA_VERSION,
                disk: disk.to_string(),
                runs: Vec::new(),
            });
            run.at = crate::plan::capacity::now();
            keep_latest(&mut profile.runs, run, MAX_DISK_RUNS);
            self.write_toml(&disk_file(disk), &profile)?;
            MeasuredDisk::from_runs(&profile.runs).ok_or_else(|| PlanError::ProfileFormat {
                path,
                message: "no stored run timed a read; delete the file to start over".into(),
            })
        }

        /// The file of a peer link's figures: the copies from `peer`'s memory onto `device`.
        pub fn peer_path(&self, device: &str, peer: &str) -> PathBuf {
            self.dir().join(peer_file(device, peer))
        }

        fn load_peer(&self, device: &str, peer: &str) -> Result<Option<PeerProfile>, PlanError> {
            let path = self.peer_path(device, peer);
            let Some(profile) = Self::read_toml::<PeerProfile>(&path)? else { return Ok(None) };
            if profile.schema_version != SCHEMA_VERSION || profile.device != device || profile.peer != peer {
                tracing::warn!(path = %path.display(), "ignoring peer link figures of another schema or pair");
                return Ok(None);
            }
            Ok(Some(profile))
        }

        /// The rate earlier runs measured for the copies from `peer`'s memory onto `device`; `None` before the
        /// first.
        pub fn measured_peer(&self, device: &str, peer: &str) -> Result<Option<MeasuredPeer>, PlanError> {
            Ok(self.load_peer(device, peer)?.and_then(|p| MeasuredPeer::from_runs(&p.runs)))
        }

        /// Stores a run's figures for the copies from `peer` onto `device` (the last [`MAX_PEER_RUNS`] are kept,
        /// written atomically), stamped now, and returns what the pair's runs now measure. A run that timed no
        /// copy is refused before anything is written.
        pub fn record_peer(&self, device: &str, peer: &str, mut run: PeerRun) -> Result<MeasuredPeer, PlanError> {
            if MeasuredPeer::from_runs(&[run]).is_none() {
                return Err(PlanError::InvalidPeerRun {
                    device: device.to_string(),
                    peer: peer.to_string(),
                    copies: run.copies,
                    median: run.median,
                });
            }
            let path = self.peer_path(device, peer);
            let mut profile = self.load_peer(device, peer)?.unwrap_or_else(|| PeerProfile {
                schema_version: SCHEMA_VERSION,
                device: device.to_string(),
                peer: peer.to_string(),
                runs: Vec::new(),
            });
            run.at = crate::plan::capacity::now();
            keep_latest(&mut profile.runs, run, MAX_PEER_RUNS);
            self.write_toml(&peer_file(device, peer), &profile)?;
            MeasuredPeer::from_runs(&profile.runs).ok_or_else(|| PlanError::ProfileFormat {
                path,
                message: "no stored run timed a copy; delete the file to start over".into(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::machine::TimeModel;

    fn run(pageable: Option<f64>, page_locked: Option<f64>) -> LinkRun {
        LinkRun { pageable, page_locked, p10: 1e8, uploads: 4, bytes: 4_000, at: 0 }
    }

    #[test]
    fn pageable_only_sets_one_rate_for_both() {
        let link = MeasuredLink::from_runs(&[run(Some(2e9), None)]).expect("timed");
        let time = link.apply(TimeModel::generic());
        assert_eq!((time.link_bytes_per_second, time.pageable_fraction), (2e9, 1.0));
        assert_eq!(time.link_source, LinkSource::Measured { runs: 1, uploads: 4 });
        // The rest of the model is kept.
        assert_eq!(time.flops_per_second, TimeModel::generic().flops_per_second);
    }

    #[test]
    fn both_kinds_give_the_rate_and_the_ratio() {
        let link = MeasuredLink::from_runs(&[run(Some(6e9), Some(24e9)), run(None, Some(20e9))]).expect("timed");
        assert_eq!(link.page_locked, Some(22e9));
        let time = link.apply(TimeModel::generic());
        assert_eq!(time.link_bytes_per_second, 22e9);
        assert!((time.pageable_fraction - 6.0 / 22.0).abs() < 1e-12);
    }

    #[test]
    fn page_locked_only_keeps_the_pageable_fraction() {
        let link = MeasuredLink::from_runs(&[run(None, Some(24e9))]).expect("timed");
        let time = link.apply(TimeModel::generic());
        assert_eq!((time.link_bytes_per_second, time.pageable_fraction), (24e9, TimeModel::DEFAULT_PAGEABLE_FRACTION));
    }

    #[test]
    fn runs_without_copies_measure_nothing() {
        let empty = LinkRun { uploads: 0, ..run(None, None) };
        assert_eq!(MeasuredLink::from_runs(&[empty]), None);
        assert_eq!(MeasuredLink::from_runs(&[]), None);
        assert_eq!(LinkRun::from_rates(None, None, None), None);
    }
}
