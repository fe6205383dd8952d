//! Capacity profiles: what a workload needed, persisted as TOML, and warnings when a run goes past what was
//! validated; named calibration on top of them.
//!
//! A [`Workload`] is the identity of what is run (model, card, dtype, resolution family, preset): whatever must
//! match for two runs to be comparable. Its stable hash ([`fnv1a_64`] of a canonical encoding) names the file,
//! `<profile dir>/<16 hex digits>.toml`; the profile dir is `dirs::data_dir()/offload/profiles` unless the
//! `profile_dir` setting says otherwise. The capacity *metrics* that vary between runs of one workload (pixels,
//! frames, tokens, batch) stay out of the identity: each run records them with its outcome and peaks, and the
//! profile keeps, per metric, the largest success and the smallest failure.
//!
//! Profiles are kept on disk by `ProfileStore`, behind the `io` feature; the profiles, their checks and
//! the calibration are pure and always built.

use std::collections::BTreeMap;
use std::fmt;
#[cfg(feature = "io")]
use std::path::{Path, PathBuf};

#[cfg(feature = "io")]
use serde::{Deserialize, Serialize};

use crate::plan::budget::recommend_resident_budget;
#[cfg(feature = "io")]
use crate::plan::error::PlanError;
#[cfg(feature = "io")]
use crate::size::format_size;

/// The profile format's version; files of another version are ignored.
pub const SCHEMA_VERSION: u32 = 1;

/// How many observations a profile keeps, newest last.
pub const MAX_OBSERVATIONS: usize = 20;

/// FNV-1a, 64 bits: a small, stable, dependency-free hash. Not cryptographic; it only has to give the same
/// file name for the same workload on every machine and release.
///
/// ```
/// use offload_core::plan::fnv1a_64;
/// assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
/// assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
/// assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
/// ```
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(PRIME))
}

/// The identity of a workload: sorted key-value pairs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Workload {
    entries: BTreeMap<String, String>,
}

impl Workload {
    /// An empty identity.
    pub fn new() -> Self {
        Self::default()
    }

    /// The identity of a named calibration profile.
    pub fn named(profile_name: &str) -> Self {
        Self::new().with("profile_name", profile_name)
    }

    /// Adds a key; a later value for the same key replaces the earlier one.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.entries.insert(key.into(), value.into());
        self
    }

    /// The pairs, sorted by key.
    pub fn entries(&self) -> &BTreeMap<String, String> {
        &self.entries
    }

    /// The canonical encoding that is hashed: a version line, then for each pair in key order
    /// `<len>:<key><len>:<value>\n` (lengths in bytes), which no choice of keys or values can make ambiguous.
    pub fn canonical(&self) -> String {
        let mut out = format!("offload-capacity-v{SCHEMA_VERSION}\n");
        for (key, value) in &self.entries {
            out.push_str(&format!("{}:{key}{}:{value}\n", key.len(), value.len()));
        }
        out
    }

    /// The profile key: [`fnv1a_64`] of [`canonical`](Self::canonical), as 16 lowercase hex digits.
    pub fn key(&self) -> String {
        format!("{:016x}", fnv1a_64(self.canonical().as_bytes()))
    }
}

/// Whether a run completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
#[cfg_attr(feature = "io", serde(rename_all = "lowercase"))]
pub enum Outcome {
    /// The run completed.
    Success,
    /// The run failed (out of memory, typically).
    Failure,
}

/// One run: its outcome, its capacity metrics and the peaks it reached.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct Observation {
    /// When it ran, seconds since the Unix epoch.
    pub at: u64,
    /// Whether it completed.
    pub outcome: Outcome,
    /// Peak device bytes.
    pub peak_device: u64,
    /// Peak host bytes.
    pub peak_host: u64,
    /// The varying capacity metrics (`pixels`, `frames`, `tokens`).
    #[cfg_attr(feature = "io", serde(default))]
    pub metrics: BTreeMap<String, f64>,
}

impl Observation {
    /// A completed run with these peaks, timestamped now.
    pub fn success(peak_device: u64, peak_host: u64) -> Self {
        Self { at: now(), outcome: Outcome::Success, peak_device, peak_host, metrics: BTreeMap::new() }
    }

    /// A failed run with the peaks it reached, timestamped now.
    pub fn failure(peak_device: u64, peak_host: u64) -> Self {
        Self { outcome: Outcome::Failure, ..Self::success(peak_device, peak_host) }
    }

    /// Adds a capacity metric.
    pub fn with_metric(mut self, name: impl Into<String>, value: f64) -> Self {
        self.metrics.insert(name.into(), value);
        self
    }

    /// Sets the timestamp (seconds since the Unix epoch).
    pub fn at(mut self, seconds: u64) -> Self {
        self.at = seconds;
        self
    }
}

pub(crate) fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The validated range of one metric.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct Limit {
    /// The largest value a run completed with.
    #[cfg_attr(feature = "io", serde(default, skip_serializing_if = "Option::is_none"))]
    pub max_success: Option<f64>,
    /// The smallest value a run failed with.
    #[cfg_attr(feature = "io", serde(default, skip_serializing_if = "Option::is_none"))]
    pub min_failure: Option<f64>,
}

/// The largest peaks among completed runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct Peaks {
    /// Peak device bytes.
    pub device: u64,
    /// Peak host bytes.
    pub host: u64,
}

/// What a calibration run recommends for later runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct Recommendation {
    /// The resident budget later runs use.
    pub resident_budget: u64,
    /// The peak device bytes the calibration run measured.
    pub measured_peak: u64,
    /// Device bytes available when it ran.
    pub device_available: u64,
    /// The resident budget it ran with.
    pub resident_used: u64,
}

impl Recommendation {
    /// The recommendation of a run that ran with `resident_used` resident bytes on a device with
    /// `device_available` bytes and peaked at `measured_peak`
    /// ([`recommend_resident_budget`]).
    pub fn from_run(device_available: u64, measured_peak: u64, resident_used: u64) -> Self {
        Self {
            resident_budget: recommend_resident_budget(device_available, measured_peak, resident_used),
            measured_peak,
            device_available,
            resident_used,
        }
    }
}

/// Everything a workload's runs have shown, as stored.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "io", derive(Serialize, Deserialize))]
pub struct CapacityProfile {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The workload's key (the file name).
    pub key: String,
    /// When the last observation ran, seconds since the Unix epoch.
    pub updated_at: u64,
    /// The workload's identity, readable.
    pub workload: BTreeMap<String, String>,
    /// The largest peaks among completed runs.
    pub peaks: Peaks,
    /// Per metric, the validated range.
    #[cfg_attr(feature = "io", serde(default))]
    pub limits: BTreeMap<String, Limit>,
    /// A calibration's recommendation, when calibrated.
    #[cfg_attr(feature = "io", serde(default, skip_serializing_if = "Option::is_none"))]
    pub recommendation: Option<Recommendation>,
    /// The last [`MAX_OBSERVATIONS`] runs, oldest first.
    #[cfg_attr(feature = "io", serde(default))]
    pub observations: Vec<Observation>,
}

impl CapacityProfile {
    /// An empty profile for `workload`.
    pub fn new(workload: &Workload) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            key: workload.key(),
            updated_at: 0,
            workload: workload.entries().clone(),
            peaks: Peaks::default(),
            limits: BTreeMap::new(),
            recommendation: None,
            observations: Vec::new(),
        }
    }

    /// Adds a run: extends the limits and peaks, keeps the last [`MAX_OBSERVATIONS`].
    pub fn observe(&mut self, observation: Observation) {
        for (metric, value) in &observation.metrics {
            let limit = self.limits.entry(metric.clone()).or_default();
            match observation.outcome {
                Outcome::Success => limit.max_success = Some(limit.max_success.map_or(*value, |m| m.max(*value))),
                Outcome::Failure => limit.min_failure = Some(limit.min_failure.map_or(*value, |m| m.min(*value))),
            }
        }
        if observation.outcome == Outcome::Success {
            self.peaks.device = self.peaks.device.max(observation.peak_device);
            self.peaks.host = self.peaks.host.max(observation.peak_host);
        }
        self.updated_at = self.updated_at.max(observation.at);
        self.observations.push(observation);
        let excess = self.observations.len().saturating_sub(MAX_OBSERVATIONS);
        self.observations.drain(..excess);
    }

    /// The warnings a run with these metrics deserves: a metric past the largest success, at or past the
    /// smallest failure, or never validated by a success.
    pub fn check(&self, metrics: &[(&str, f64)]) -> Vec<CapacityWarning> {
        let mut warnings = Vec::new();
        for (metric, value) in metrics {
            let limit = self.limits.get(*metric).copied().unwrap_or_default();
            let kind = if let Some(failure) = limit.min_failure.filter(|f| value >= f) {
                Some(WarningKind::AtFailure { min_failure: failure })
            } else if let Some(success) = limit.max_success.filter(|s| value > s) {
                Some(WarningKind::BeyondValidated { max_success: success })
            } else if limit.max_success.is_none() {
                Some(WarningKind::Unvalidated)
            } else {
                None
            };
            if let Some(kind) = kind {
                warnings.push(CapacityWarning {
                    key: self.key.clone(),
                    metric: metric.to_string(),
                    value: *value,
                    kind,
                });
            }
        }
        warnings
    }
}

/// Why a run is outside the validated range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WarningKind {
    /// Larger than every completed run.
    BeyondValidated {
        /// The largest completed value.
        max_success: f64,
    },
    /// At or above a value that failed.
    AtFailure {
        /// The smallest failed value.
        min_failure: f64,
    },
    /// No completed run recorded this metric.
    Unvalidated,
}

/// A run outside what its profile validated.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityWarning {
    /// The profile's key.
    pub key: String,
    /// The metric.
    pub metric: String,
    /// The run's value.
    pub value: f64,
    /// How it is outside.
    pub kind: WarningKind,
}

impl fmt::Display for CapacityWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self { key, metric, value, kind } = self;
        match kind {
            WarningKind::BeyondValidated { max_success } => write!(
                f,
                "{metric} = {value} exceeds the largest validated {metric} ({max_success}) of capacity profile {key}; \
                 it may run out of memory: lower it or use a preset with less resident memory"
            ),
            WarningKind::AtFailure { min_failure } => write!(
                f,
                "{metric} = {value} is at or above {min_failure}, which failed before in capacity profile {key}; \
                 expect out of memory: lower it or use low_ram_safe"
            ),
            WarningKind::Unvalidated => write!(
                f,
                "{metric} = {value} has no completed run in capacity profile {key}; this run will validate it"
            ),
        }
    }
}

/// What `ProfileStore::record` (feature `io`) returns: the updated profile, and the warnings the run deserved against the
/// profile as it was before.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// The profile as saved.
    pub profile: CapacityProfile,
    /// The run's warnings (already logged).
    pub warnings: Vec<CapacityWarning>,
}

/// A directory of capacity profiles (feature `io`).
///
/// ```
/// use offload_core::plan::{Observation, ProfileStore, Workload};
/// let dir = std::env::temp_dir().join(format!("offload-doc-profiles-{}", std::process::id()));
/// let store = ProfileStore::at(&dir);
/// let workload = Workload::new().with("model", "z-image-turbo").with("card", "8GB");
/// store.record(&workload, Observation::success(6 << 30, 20 << 30).with_metric("pixels", 1048576.0).at(1))?;
/// let warnings = store.check(&workload, &[("pixels", 4194304.0)])?;
/// assert!(warnings[0].to_string().contains("exceeds the largest validated"));
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), offload_core::plan::PlanError>(())
/// ```
#[cfg(feature = "io")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileStore {
    dir: PathBuf,
}

#[cfg(feature = "io")]
impl ProfileStore {
    /// A store in `dir` (created on the first save).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// `dirs::data_dir()/offload/profiles`: `~/.local/share/offload/profiles` on Linux,
    /// `~/Library/Application Support/offload/profiles` on macOS, `%APPDATA%\offload\profiles` on Windows.
    pub fn default_dir() -> Result<PathBuf, PlanError> {
        dirs::data_dir().map(|d| d.join("offload").join("profiles")).ok_or(PlanError::NoDataDir)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of a workload's profile.
    pub fn path(&self, workload: &Workload) -> PathBuf {
        self.dir.join(format!("{}.toml", workload.key()))
    }

    /// Loads a workload's profile; `None` when there is none, or when the file is of another schema version or
    /// another workload (both logged and ignored, as a stale file should not stop a run).
    pub fn load(&self, workload: &Workload) -> Result<Option<CapacityProfile>, PlanError> {
        let path = self.path(workload);
        let Some(profile) = Self::read_toml::<CapacityProfile>(&path)? else { return Ok(None) };
        if profile.schema_version != SCHEMA_VERSION
            || profile.key != workload.key()
            || &profile.workload != workload.entries()
        {
            tracing::warn!(
                path = %path.display(),
                "ignoring capacity profile {}: it is of schema {} or another workload; it will be replaced",
                profile.key,
                profile.schema_version
            );
            return Ok(None);
        }
        Ok(Some(profile))
    }

    /// Saves a profile atomically (a temporary file renamed over the old one).
    pub fn save(&self, profile: &CapacityProfile) -> Result<(), PlanError> {
        self.write_toml(&format!("{}.toml", profile.key), profile)
    }

    /// Writes `value` as TOML to the store's file `name`, atomically; a typed error naming the file when it cannot
    /// be serialized or written.
    pub(crate) fn write_toml(&self, name: &str, value: &impl serde::Serialize) -> Result<(), PlanError> {
        let text = toml::to_string(value)
            .map_err(|e| PlanError::ProfileFormat { path: self.dir.join(name), message: e.to_string() })?;
        self.write_atomically(name, &text)
    }

    /// Reads and parses a TOML file of the store; `None` when there is none, a typed error naming the file when
    /// it cannot be read or parsed.
    pub(crate) fn read_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, PlanError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(PlanError::ProfileIo { operation: "read", path: path.to_path_buf(), source }),
        };
        toml::from_str(&text)
            .map(Some)
            .map_err(|e| PlanError::ProfileFormat { path: path.to_path_buf(), message: e.message().to_string() })
    }

    /// Writes `text` to the file `name` in the store's directory (created if missing) through a temporary file
    /// renamed over it, so a reader never sees half a file.
    pub(crate) fn write_atomically(&self, name: &str, text: &str) -> Result<(), PlanError> {
        let path = &self.dir.join(name);
        std::fs::create_dir_all(&self.dir).map_err(|source| PlanError::ProfileIo {
            operation: "create the directory of",
            path: self.dir.clone(),
            source,
        })?;
        let temporary = self.dir.join(format!(".{name}.{}.tmp", std::process::id()));
        std::fs::write(&temporary, text)
            .and_then(|()| std::fs::rename(&temporary, path))
            .map_err(|source| PlanError::ProfileIo { operation: "write", path: path.to_path_buf(), source })
    }

    /// The warnings a run with these metrics deserves against the stored profile, each logged with
    /// `tracing::warn`. No profile, no warnings: there is nothing to compare with yet.
    pub fn check(&self, workload: &Workload, metrics: &[(&str, f64)]) -> Result<Vec<CapacityWarning>, PlanError> {
        let warnings = self.load(workload)?.map(|p| p.check(metrics)).unwrap_or_default();
        for warning in &warnings {
            tracing::warn!("{warning}");
        }
        Ok(warnings)
    }

    /// Records a run and saves the profile. The result carries the warnings the run deserved against the
    /// profile before it (a run past the validated range), each also logged with `tracing::warn`.
    pub fn record(&self, workload: &Workload, observation: Observation) -> Result<Recorded, PlanError> {
        let previous = self.load(workload)?;
        let metrics: Vec<(&str, f64)> = observation.metrics.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let warnings = previous.as_ref().map(|p| p.check(&metrics)).unwrap_or_default();
        for warning in &warnings {
            tracing::warn!("{warning}");
        }
        let mut profile = previous.unwrap_or_else(|| CapacityProfile::new(workload));
        profile.observe(observation);
        self.save(&profile)?;
        Ok(Recorded { profile, warnings })
    }

    /// The stored recommendation of the named calibration profile, if it was calibrated.
    pub fn calibration(&self, profile_name: &str) -> Result<Option<Recommendation>, PlanError> {
        Ok(self.load(&Workload::named(profile_name))?.and_then(|p| p.recommendation))
    }

    /// Records a calibration run of the named profile: it ran with `resident_used` resident bytes on a device
    /// with `device_available` bytes and peaked at `measured_peak`. Saves and returns the recommendation.
    pub fn record_calibration(
        &self,
        profile_name: &str,
        device_available: u64,
        measured_peak: u64,
        resident_used: u64,
    ) -> Result<Recommendation, PlanError> {
        let workload = Workload::named(profile_name);
        let recommendation = Recommendation::from_run(device_available, measured_peak, resident_used);
        let mut profile = self.load(&workload)?.unwrap_or_else(|| CapacityProfile::new(&workload));
        profile.observe(Observation::success(measured_peak, 0));
        profile.recommendation = Some(recommendation);
        self.save(&profile)?;
        tracing::info!(
            "calibrated profile {profile_name}: peak {} of {} available, recommended resident budget {}",
            format_size(measured_peak),
            format_size(device_available),
            format_size(recommendation.resident_budget)
        );
        Ok(recommendation)
    }
}
