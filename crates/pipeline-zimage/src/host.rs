//! The process's host memory, as Linux reports it: the peak resident set (`VmHWM`) and its reset, for the
//! capacity profiles and the real-size benchmark's per-phase peaks.

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
