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
//!
//! A call's activations are paged the same way: a call made of many small tensors takes more pages than its
//! activation estimate counts (on lavapipe the tiny text encoder's call took about 87 KB of pages for a 32.7 KB
//! estimate). A component measures the pages of its first call at an estimate
//! ([`Offloadable::call_footprint`](crate::Offloadable::call_footprint), a [`CallPages`]); the manager hands them
//! out as [`CallFootprint`]s ([`ComponentsManager::call_footprints`](crate::ComponentsManager::call_footprints)),
//! stored beside the weights' footprints, and a plan counts a matching call as the larger of its estimate and its
//! measured pages ([`ComponentSpec::call_device_bytes`]).

#[cfg(feature = "io")]
use serde::{Deserialize, Serialize};

pub use crate::measured::{CallFootprint, CallPages, Footprint};
use crate::plan::component::ComponentSpec;

/// Sets [`ComponentSpec::call_device_bytes`] on each spec that `calls` has a call footprint for (same name, same
/// activation estimate; the latest one when several match), and returns how many were set.
///
/// ```
/// use offload_core::plan::{CallFootprint, ComponentSpec, apply_call_footprints};
///
/// let mut specs = [ComponentSpec::new("text_encoder", 1_000).with_activation(32_768)];
/// let measured = [CallFootprint { component: "text_encoder".into(), estimate_bytes: 32_768, device_bytes: 89_000 }];
/// assert_eq!(apply_call_footprints(&mut specs, &measured), 1);
/// assert_eq!(specs[0].call_on_device(), 89_000, "the call counts as the pages it took");
/// ```
pub fn apply_call_footprints(specs: &mut [ComponentSpec], calls: &[CallFootprint]) -> usize {
    let mut set = 0;
    for spec in specs.iter_mut() {
        let measured =
            calls.iter().rev().find(|c| c.component == spec.name && c.estimate_bytes == spec.activation_bytes);
        if let Some(call) = measured.filter(|c| c.device_bytes > 0) {
            spec.call_device_bytes = Some(call.device_bytes);
            set += 1;
        }
    }
    set
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
    /// The latest call footprint of each component and activation estimate.
    #[serde(default)]
    calls: Vec<CallFootprint>,
}

#[cfg(feature = "io")]
mod store {
    use std::path::PathBuf;

    use super::{CallFootprint, Footprint, FootprintProfile};
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

        /// The device's stored profile, or an empty one (before the first, or of another schema or device).
        fn footprint_profile(&self, device: &str) -> Result<FootprintProfile, PlanError> {
            let path = self.footprint_path(device);
            let empty = FootprintProfile {
                schema_version: SCHEMA_VERSION,
                device: device.to_string(),
                footprints: Vec::new(),
                calls: Vec::new(),
            };
            let Some(profile) = Self::read_toml::<FootprintProfile>(&path)? else { return Ok(empty) };
            if profile.schema_version != SCHEMA_VERSION || profile.device != device {
                tracing::warn!(path = %path.display(), "ignoring footprints of another schema or device");
                return Ok(empty);
            }
            Ok(profile)
        }

        fn write_footprint_profile(&self, profile: &FootprintProfile) -> Result<(), PlanError> {
            self.write_toml(&footprint_file(&profile.device), profile)
        }

        /// The footprints earlier runs measured on `device` (empty before the first).
        pub fn footprints(&self, device: &str) -> Result<Vec<Footprint>, PlanError> {
            Ok(self.footprint_profile(device)?.footprints)
        }

        /// Stores `measured` for `device` (written atomically): each replaces the stored footprint of the same
        /// component and weight bytes, the others are kept. Returns the device's footprints now stored.
        pub fn record_footprints(&self, device: &str, measured: &[Footprint]) -> Result<Vec<Footprint>, PlanError> {
            let mut profile = self.footprint_profile(device)?;
            for footprint in measured {
                profile
                    .footprints
                    .retain(|f| !(f.component == footprint.component && f.weight_bytes == footprint.weight_bytes));
                profile.footprints.push(footprint.clone());
            }
            self.write_footprint_profile(&profile)?;
            Ok(profile.footprints)
        }

        /// The call footprints earlier runs measured on `device` (empty before the first).
        pub fn call_footprints(&self, device: &str) -> Result<Vec<CallFootprint>, PlanError> {
            Ok(self.footprint_profile(device)?.calls)
        }

        /// Stores `measured` for `device` in the same file (written atomically): each replaces the stored call
        /// footprint of the same component and estimate, the others are kept. Returns those now stored.
        pub fn record_call_footprints(
            &self,
            device: &str,
            measured: &[CallFootprint],
        ) -> Result<Vec<CallFootprint>, PlanError> {
            let mut profile = self.footprint_profile(device)?;
            for call in measured {
                profile.calls.retain(|c| !(c.component == call.component && c.estimate_bytes == call.estimate_bytes));
                profile.calls.push(call.clone());
            }
            self.write_footprint_profile(&profile)?;
            Ok(profile.calls)
        }
    }
}
