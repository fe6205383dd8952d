//! The host-to-device link as the clock saw it: each copy's bytes and wall time, and the rates they give.
//!
//! One [`LinkMeter`] belongs to one device. Whatever moves weights onto it notes each copy: a group offloader's
//! upload (from its first host-to-device copy to the synced read-back that publishes the group) and a whole
//! component's onload (from its `to_device` to the synced read-back of its parameters). [`LinkMeter::rate`]
//! gives their median and 10th-percentile rates, and the planner takes the median in place of an assumed
//! constant once a run has stored it ([`crate::plan::MeasuredLink`]).
//!
//! On the CPU backend under a simulated card a "copy" is a host memory copy: the card's link is simulated and
//! charged separately, and a meter there measures the host, not the card.
//!
//! A [`DiskMeter`] is the same clock on the other side of the host: each read of a host copy from a file (a group
//! read from its checkpoint file, the file tier) notes its bytes and wall time, and [`DiskMeter::rate`] gives the
//! same order statistics, while [`DiskMeter::totals`] counts every read since the meter was made (the ring keeps
//! only the latest). A read served by the page cache is a memory copy: its rate says where the bytes were.

use parking_lot::Mutex;

/// How many copies a meter keeps (the latest).
pub const LINK_SAMPLES: usize = 4096;

/// One copy across the link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSample {
    /// Bytes copied.
    pub bytes: u64,
    /// Wall time of the copy, seconds.
    pub seconds: f64,
    /// Whether the source was page-locked host memory (CUDA's pinned staging); false for pageable memory and
    /// on runtimes that have none.
    pub page_locked: bool,
}

/// The rates of a set of copies, measured by the clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkRate {
    /// Copies measured (the last [`LINK_SAMPLES`] at most).
    pub uploads: usize,
    /// Their bytes.
    pub bytes: u64,
    /// The median copy's rate, bytes per second.
    pub median: f64,
    /// The 10th percentile's rate (nine copies in ten were at least this fast), bytes per second.
    pub p10: f64,
}

impl LinkRate {
    /// The rates of `samples`; `None` when there are none.
    pub fn of<'a>(samples: impl IntoIterator<Item = &'a LinkSample>) -> Option<Self> {
        let mut bytes = 0;
        let mut rates = Vec::new();
        for sample in samples {
            bytes += sample.bytes;
            rates.push(sample.bytes as f64 / sample.seconds.max(f64::MIN_POSITIVE));
        }
        if rates.is_empty() {
            return None;
        }
        rates.sort_by(f64::total_cmp);
        let at = |fraction: f64| rates[((rates.len() - 1) as f64 * fraction).round() as usize];
        Some(Self { uploads: rates.len(), bytes, median: at(0.5), p10: at(0.1) })
    }
}

impl std::fmt::Display for LinkRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} uploads ({}) measured by the clock: median {}, 10th percentile {}",
            self.uploads,
            crate::format_size(self.bytes),
            crate::format_rate(self.median),
            crate::format_rate(self.p10)
        )
    }
}

/// The latest [`LINK_SAMPLES`] samples, the oldest overwritten first.
#[derive(Debug)]
struct Ring<T> {
    samples: Vec<T>,
    next: usize,
}

impl<T> Default for Ring<T> {
    fn default() -> Self {
        Self { samples: Vec::new(), next: 0 }
    }
}

impl<T> Ring<T> {
    /// Keeps `sample`, in place of the oldest once the ring is full.
    fn push(&mut self, sample: T) {
        if self.samples.len() < LINK_SAMPLES {
            self.samples.push(sample);
        } else {
            self.samples[self.next] = sample;
        }
        self.next = (self.next + 1) % LINK_SAMPLES;
    }
}

/// The latest copies onto one device (a ring of [`LINK_SAMPLES`]), shared by everything that moves weights
/// there, on any thread.
///
/// ```
/// use offload_core::link::{LinkMeter, LinkSample};
/// let meter = LinkMeter::default();
/// assert!(meter.rate().is_none());
/// meter.note(LinkSample { bytes: 2_000_000_000, seconds: 1.0, page_locked: false });
/// meter.note(LinkSample { bytes: 1_000_000_000, seconds: 1.0, page_locked: true });
/// assert_eq!(meter.rate().unwrap().uploads, 2);
/// assert_eq!(meter.rate_of(true).unwrap().median, 1e9);
/// ```
#[derive(Debug, Default)]
pub struct LinkMeter {
    ring: Mutex<Ring<LinkSample>>,
}

impl LinkMeter {
    /// Notes one copy.
    pub fn note(&self, sample: LinkSample) {
        self.ring.lock().push(sample);
    }

    /// The latest copies, in no particular order.
    pub fn samples(&self) -> Vec<LinkSample> {
        self.ring.lock().samples.clone()
    }

    /// The rate of every copy kept; `None` before the first.
    pub fn rate(&self) -> Option<LinkRate> {
        LinkRate::of(&self.samples())
    }

    /// The rate of the copies from page-locked memory (`true`) or from pageable memory (`false`).
    pub fn rate_of(&self, page_locked: bool) -> Option<LinkRate> {
        LinkRate::of(self.samples().iter().filter(|s| s.page_locked == page_locked))
    }
}

/// One read of a host copy from a file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskSample {
    /// Bytes read.
    pub bytes: u64,
    /// Wall time of the read, seconds.
    pub seconds: f64,
}

/// The rates of a set of file reads, measured by the clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskRate {
    /// Reads measured (the last [`LINK_SAMPLES`] at most).
    pub reads: usize,
    /// Their bytes.
    pub bytes: u64,
    /// The median read's rate, bytes per second.
    pub median: f64,
    /// The 10th percentile's rate (nine reads in ten were at least this fast), bytes per second.
    pub p10: f64,
}

impl std::fmt::Display for DiskRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} file reads ({}) measured by the clock: median {}, 10th percentile {}",
            self.reads,
            crate::format_size(self.bytes),
            crate::format_rate(self.median),
            crate::format_rate(self.p10)
        )
    }
}

/// Every read a [`DiskMeter`] noted since it was made: counts, not a ring.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DiskTotals {
    /// Reads noted.
    pub reads: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Their wall time, seconds.
    pub seconds: f64,
}

#[derive(Debug, Default)]
struct DiskRing {
    ring: Ring<DiskSample>,
    totals: DiskTotals,
}

/// The latest reads of host copies from files (a ring of [`LINK_SAMPLES`]) and the totals of every read, shared
/// by everything that reads them, on any thread.
///
/// ```
/// use offload_core::link::{DiskMeter, DiskSample};
/// let meter = DiskMeter::default();
/// assert!(meter.rate().is_none());
/// meter.note(DiskSample { bytes: 500_000_000, seconds: 0.25 });
/// meter.note(DiskSample { bytes: 100_000_000, seconds: 0.1 });
/// let rate = meter.rate().unwrap();
/// assert_eq!((rate.reads, rate.median), (2, 2e9));
/// assert_eq!((meter.totals().reads, meter.totals().bytes), (2, 600_000_000));
/// ```
#[derive(Debug, Default)]
pub struct DiskMeter {
    ring: Mutex<DiskRing>,
}

impl DiskMeter {
    /// Notes one read.
    pub fn note(&self, sample: DiskSample) {
        let mut ring = self.ring.lock();
        ring.ring.push(sample);
        ring.totals.reads += 1;
        ring.totals.bytes += sample.bytes;
        ring.totals.seconds += sample.seconds;
    }

    /// The latest reads, in no particular order.
    pub fn samples(&self) -> Vec<DiskSample> {
        self.ring.lock().ring.samples.clone()
    }

    /// Every read noted since the meter was made.
    pub fn totals(&self) -> DiskTotals {
        self.ring.lock().totals
    }

    /// The rate of every read kept; `None` before the first.
    pub fn rate(&self) -> Option<DiskRate> {
        let samples = self.samples();
        let links: Vec<LinkSample> =
            samples.iter().map(|s| LinkSample { bytes: s.bytes, seconds: s.seconds, page_locked: false }).collect();
        LinkRate::of(&links).map(|rate| DiskRate {
            reads: rate.uploads,
            bytes: rate.bytes,
            median: rate.median,
            p10: rate.p10,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_order_statistics_of_the_copies() {
        let meter = LinkMeter::default();
        // Rates 1..=10 GB/s: the median (index 4.5 rounds to 5) is 6 GB/s, the 10th percentile (0.9 → 1) 2 GB/s.
        for gb in 1..=10u64 {
            meter.note(LinkSample { bytes: gb * 1_000_000_000, seconds: 1.0, page_locked: false });
        }
        let rate = meter.rate().expect("ten copies");
        assert_eq!((rate.uploads, rate.bytes), (10, 55_000_000_000));
        assert_eq!((rate.median, rate.p10), (6e9, 2e9));
        assert!(meter.rate_of(true).is_none());
    }

    #[test]
    fn the_disk_meter_keeps_order_statistics_and_counts_every_read() {
        let meter = DiskMeter::default();
        for _ in 0..LINK_SAMPLES + 10 {
            meter.note(DiskSample { bytes: 2, seconds: 1.0 });
        }
        let rate = meter.rate().expect("reads");
        assert_eq!((rate.reads, rate.median, rate.p10), (LINK_SAMPLES, 2.0, 2.0));
        let totals = meter.totals();
        assert_eq!((totals.reads, totals.bytes), (LINK_SAMPLES as u64 + 10, 2 * (LINK_SAMPLES as u64 + 10)));
    }

    #[test]
    fn the_ring_keeps_the_latest_copies() {
        let meter = LinkMeter::default();
        for _ in 0..LINK_SAMPLES {
            meter.note(LinkSample { bytes: 1, seconds: 1.0, page_locked: false });
        }
        for _ in 0..LINK_SAMPLES {
            meter.note(LinkSample { bytes: 3, seconds: 1.0, page_locked: false });
        }
        let rate = meter.rate().expect("full");
        assert_eq!((rate.uploads, rate.median), (LINK_SAMPLES, 3.0));
    }
}
