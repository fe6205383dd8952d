//! What a component's weights take on a device, measured: the runtime's pages, not the weight bytes.
//!
//! A runtime that allocates in pages of its own gives a tensor more than its bytes (on lavapipe a norm weight of
//! a few values takes a page of 11 to 17 KB; `docs/devices.md`), so a plan that counts weight bytes predicts
//! low. A component measures its footprint at its first whole onload onto such a device
//! ([`Offloadable::device_footprint`](crate::Offloadable::device_footprint): the pages the device's allocator
//! held after the onload less those it held before, its cache released first); the manager keeps it
//! ([`ComponentsManager::device_footprints`](crate::ComponentsManager::device_footprints)); the caller stores it
//! beside the capacity profiles (`ProfileStore::record_footprints`, feature `io`) and hands the device's stored
//! footprints to the next plan ([`DeviceFacts::with_footprints`](crate::plan::DeviceFacts::with_footprints)),
//! which sets each matching component's [`ComponentSpec::device_bytes`]. The planner then counts what stays on
//! the device in device bytes and what crosses the link in weight bytes.
//!
//! A footprint belongs to one component of one size: it applies to a spec of the same name and the same weight
//! bytes only (another checkpoint, dtype or quantization has other pages).

use std::fmt;

#[cfg(feature = "io")]
use serde::{Deserialize, Serialize};

use crate::plan::component::ComponentSpec;

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

/// Sets [`ComponentSpec::device_bytes`] on each spec that `footprints` has a footprint for (same name, same weight
/// bytes); the others keep theirs. Returns how many were set.
///
/// ```
/// use offload_core::plan::{ComponentSpec, Footprint, apply_footprints};
/// let mut specs = [ComponentSpec::new("vae", 1_000), ComponentSpec::new("text_encoder", 2_000)];
/// let measured = [Footprint { component: "vae".into(), weight_bytes: 1_000, device_bytes: 1_500 },
///                 Footprint { component: "text_encoder".into(), weight_bytes: 9_999, device_bytes: 12_000 }];
/// assert_eq!(apply_footprints(&mut specs, &measured), 1, "the text encoder's was measured at another size");
/// assert_eq!((specs[0].device_bytes, specs[1].device_bytes), (Some(1_500), None));
/// ```
pub fn apply_footprints(specs: &mut [ComponentSpec], footprints: &[Footprint]) -> usize {
    let mut set = 0;
    for spec in specs.iter_mut() {
        let measured =
            footprints.iter().rev().find(|f| f.component == spec.name && f.weight_bytes == spec.weight_bytes);
        if let Some(footprint) = measured.filter(|f| f.device_bytes > 0) {
            spec.device_bytes = Some(footprint.device_bytes);
            set += 1;
        }
    }
    set
}

/// One device's stored footprints (feature `io`): `<profile dir>/footprint-<key>.toml`, beside the capacity
/// profiles.
#[cfg(feature = "io")]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct FootprintProfile {
    /// [`crate::plan::SCHEMA_VERSION`].
    schema_version: u32,
    /// The device's label.
    device: String,
    /// The latest footprint of each component and size.
    #[serde(default)]
    footprints: Vec<Footprint>,
}

#[cfg(feature = "io")]
mod store {
    use std::path::PathBuf;

    use super::{Footprint, FootprintProfile};
    use crate::plan::capacity::{ProfileStore, SCHEMA_VERSION, Workload};
    use crate::plan::error::PlanError;

    fn footprint_file(device: &str) -> String {
        format!("footprint-{}.toml", Workload::named("footprint").with("device", device).key())
    }

    impl ProfileStore {
        /// The file of a device's measured footprints.
        pub fn footprint_path(&self, device: &str) -> PathBuf {
            self.dir().join(footprint_file(device))
        }

        /// The footprints earlier runs measured on `device` (empty before the first).
        pub fn footprints(&self, device: &str) -> Result<Vec<Footprint>, PlanError> {
            let path = self.footprint_path(device);
            let Some(profile) = Self::read_toml::<FootprintProfile>(&path)? else { return Ok(Vec::new()) };
            if profile.schema_version != SCHEMA_VERSION || profile.device != device {
                tracing::warn!(path = %path.display(), "ignoring footprints of another schema or device");
                return Ok(Vec::new());
            }
            Ok(profile.footprints)
        }

        /// Stores `measured` for `device` (written atomically): each replaces the stored footprint of the same
        /// component and weight bytes, the others are kept. Returns the device's footprints now stored.
        pub fn record_footprints(&self, device: &str, measured: &[Footprint]) -> Result<Vec<Footprint>, PlanError> {
            let mut footprints = self.footprints(device)?;
            for footprint in measured {
                footprints
                    .retain(|f| !(f.component == footprint.component && f.weight_bytes == footprint.weight_bytes));
                footprints.push(footprint.clone());
            }
            let profile = FootprintProfile { schema_version: SCHEMA_VERSION, device: device.to_string(), footprints };
            let text = toml::to_string(&profile)
                .map_err(|e| PlanError::ProfileFormat { path: self.footprint_path(device), message: e.to_string() })?;
            self.write_atomically(&footprint_file(device), &text)?;
            Ok(profile.footprints)
        }
    }
}
