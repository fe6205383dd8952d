//! The process's host memory, as Linux reports it: the peak resident set (`VmHWM`) and its reset, for the
//! capacity profiles and the real-size benchmark's per-phase peaks, and a sampled peak of the anonymous memory
//! alone (`RssAnon`): the resident set also counts the pages of memory-mapped files (the checkpoint shard being
//! read), which are page cache the kernel can take back, not a copy of the weights.

/// The process's peak resident set since it started or since [`reset_peak_resident`] (`VmHWM` in
/// `/proc/self/status`), 0 where it cannot be read.
pub fn peak_resident_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// The process's resident set now (`VmRSS`), 0 where it cannot be read.
pub fn resident_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// Starts a new peak: the next [`peak_resident_bytes`] counts from the resident set now (writes `5` to
/// `/proc/self/clear_refs`). Fails where the kernel does not offer it.
pub fn reset_peak_resident() -> std::io::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")
}

fn status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with(key))?;
            let kib: u64 = line.trim_start_matches(key).trim().trim_end_matches("kB").trim().parse().ok()?;
            kib.checked_mul(1024)
        })
        .unwrap_or(0)
}

/// The process's anonymous resident memory now (`RssAnon`: heap and other private memory, not mapped files), 0
/// where it cannot be read.
pub fn anonymous_bytes() -> u64 {
    status_bytes("RssAnon:")
}

/// A thread that reads [`anonymous_bytes`] every `interval` and keeps the highest reading since the last
/// [`reset`](AnonymousPeak::reset): Linux keeps no peak of the anonymous memory alone. Sampled, so a spike
/// shorter than the interval can pass unseen. Stops when dropped.
#[derive(Debug)]
pub struct AnonymousPeak {
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl AnonymousPeak {
    /// Starts sampling every `interval`.
    pub fn start(interval: std::time::Duration) -> Self {
        use std::sync::atomic::Ordering;
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(anonymous_bytes()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        // A sampler that cannot start leaves the peak at its first reading; the report says what it read.
        let _ = std::thread::Builder::new().name("anonymous-peak".into()).spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(anonymous_bytes(), Ordering::Relaxed);
                std::thread::sleep(interval);
            }
        });
        Self { peak, stop }
    }

    /// The highest reading since the start or the last reset, the reading now included.
    pub fn peak(&self) -> u64 {
        self.peak.fetch_max(anonymous_bytes(), std::sync::atomic::Ordering::Relaxed).max(anonymous_bytes())
    }

    /// Starts a new peak from the reading now.
    pub fn reset(&self) {
        self.peak.store(anonymous_bytes(), std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for AnonymousPeak {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
