//! Host memory: total and available RAM, read from the OS (`/proc/meminfo` on Linux) or given explicitly.

use crate::plan::error::PlanError;
use crate::size::format_size;

/// A reading of host RAM.
///
/// `available` is what the OS can give a new allocation without swapping: Linux's `MemAvailable` (free memory
/// plus reclaimable page cache), the number the pinned budget is bounded by.
///
/// ```
/// use offload_core::plan::HostMemory;
/// let host = HostMemory::parse_meminfo("MemTotal: 32000000 kB\nMemFree: 1000 kB\nMemAvailable: 30000000 kB\n")?;
/// assert_eq!(host.total, 32_000_000 * 1024);
/// assert_eq!(host.available, 30_000_000 * 1024);
/// # Ok::<(), offload_core::plan::PlanError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostMemory {
    /// Installed RAM in bytes.
    pub total: u64,
    /// Bytes a new allocation can get without swapping.
    pub available: u64,
}

impl HostMemory {
    /// A reading given by the caller (tests, a simulated machine, an override); `available` is capped at `total`.
    pub fn new(total: u64, available: u64) -> Self {
        Self { total, available: available.min(total) }
    }

    /// Reads the OS: `/proc/meminfo` on Linux (feature `io`). Elsewhere this is an error that says how to
    /// pass the numbers.
    #[cfg(feature = "io")]
    pub fn read() -> Result<Self, PlanError> {
        #[cfg(target_os = "linux")]
        {
            let text = std::fs::read_to_string("/proc/meminfo").map_err(|error| PlanError::HostMemory {
                platform: std::env::consts::OS,
                problem: format!("/proc/meminfo is unreadable ({error})"),
            })?;
            Self::parse_meminfo(&text)
        }
        #[cfg(not(target_os = "linux"))]
        {
            Err(PlanError::HostMemory {
                platform: std::env::consts::OS,
                problem: "only Linux's /proc/meminfo is read so far".into(),
            })
        }
    }

    /// Reads the text of `/proc/meminfo`: `MemTotal` and `MemAvailable`, in kB (which the kernel means as KiB).
    pub fn parse_meminfo(text: &str) -> Result<Self, PlanError> {
        let field = |name: &str| -> Result<u64, PlanError> {
            let problem = |what: &str| PlanError::HostMemory {
                platform: std::env::consts::OS,
                problem: format!("{name} {what} in /proc/meminfo"),
            };
            let line =
                text.lines().find(|line| line.split(':').next() == Some(name)).ok_or_else(|| problem("is missing"))?;
            let value = line.split(':').nth(1).unwrap_or_default().trim();
            let number = value.strip_suffix("kB").unwrap_or(value).trim();
            let kib: u64 = number.parse().map_err(|_| problem("is not a number of kB"))?;
            kib.checked_mul(1024).ok_or_else(|| problem("does not fit in 64 bits"))
        };
        Ok(Self::new(field("MemTotal")?, field("MemAvailable")?))
    }

    /// The same reading with `available` replaced (the `host_available` setting).
    pub fn with_available(self, available: u64) -> Self {
        Self::new(self.total, available)
    }
}

impl std::fmt::Display for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} available of {}", format_size(self.available), format_size(self.total))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_meminfo_and_refuses_missing_fields() {
        let text = "MemTotal:       65536000 kB\nMemFree:        1 kB\nMemAvailable:   60000000 kB\n";
        assert_eq!(HostMemory::parse_meminfo(text).ok(), Some(HostMemory::new(65_536_000 * 1024, 60_000_000 * 1024)));
        let err = HostMemory::parse_meminfo("MemTotal: 1 kB\n").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("MemAvailable is missing"), "{err}");
        assert!(err.contains("OFFLOAD_HOST_AVAILABLE"), "{err}");
        let err = HostMemory::parse_meminfo("MemTotal: lots\nMemAvailable: 1 kB").err().map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("MemTotal is not a number"));
    }

    #[cfg(all(target_os = "linux", feature = "io"))]
    #[test]
    fn reads_this_machine() {
        let host = HostMemory::read();
        assert!(matches!(host, Ok(HostMemory { total, available }) if total > 0 && available <= total), "{host:?}");
    }
}
