//! What a component measured of itself on a device: the pages its weights took ([`Footprint`]) and the pages a
//! call at an activation estimate took ([`CallPages`], handed out by the manager as [`CallFootprint`]s). Plain
//! measurements, kept by the manager; the planner reads them (`plan::footprint` says how), the manager does not
//! plan.

use std::fmt;

#[cfg(feature = "io")]
use serde::{Deserialize, Serialize};

/// One component's measured footprint on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct Footprint {
    /// The component's name, as the manager and the plan know it (`transformer`).
    pub component: String,
    /// Its weight bytes when it was measured.
    pub weight_bytes: u64,
    /// The bytes its weights took on the device: the allocator's pages after its whole onload less before.
    pub device_bytes: u64,
}

impl Footprint {
    /// The footprint over the weights: the runtime's pages per weight byte (1.0 where it allocates bytes as asked).
    pub fn ratio(&self) -> f64 {
        self.device_bytes as f64 / self.weight_bytes.max(1) as f64
    }
}

impl fmt::Display for Footprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} of weights took {} on the device ({:.3}x)",
            self.component,
            crate::format_size(self.weight_bytes),
            crate::format_size(self.device_bytes),
            self.ratio()
        )
    }
}

/// What one call of a component took on the device, as a component measures it
/// ([`Offloadable::call_footprint`](crate::Offloadable::call_footprint)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallPages {
    /// The activation estimate the call was made with.
    pub estimate_bytes: u64,
    /// The pages the device's allocator took during the call at its highest, over those it held when the call
    /// began, its cache released first.
    pub device_bytes: u64,
}

/// One component's measured call footprint on a device: the pages a call at `estimate_bytes` took.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct CallFootprint {
    /// The component's name, as the manager and the plan know it (`text_encoder`).
    pub component: String,
    /// The activation estimate of the call measured: the workload it belongs to.
    pub estimate_bytes: u64,
    /// The pages the call took on the device.
    pub device_bytes: u64,
}

impl fmt::Display for CallFootprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: a call estimated at {} took {} on the device",
            self.component,
            crate::format_size(self.estimate_bytes),
            crate::format_size(self.device_bytes)
        )
    }
}
