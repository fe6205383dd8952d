//! Settings: explicit arguments, then `OFFLOAD_*` environment variables, then a TOML file, then preset
//! defaults.
//!
//! This is the layer that validates user input for planning. [`Settings::resolve`] takes the three layers as
//! plain values (an explicit [`SettingsLayer`], an iterator of environment pairs, the TOML text), so it is
//! tested without touching the process environment; `Settings::from_process` (feature `io`) feeds it the real ones. Every
//! bad key or value is a [`PlanError`] naming the key, where it came from and what is accepted; the planner
//! trusts what comes out.
//!
//! ```
//! use offload_core::plan::{Origin, Preset, Settings, SettingsLayer};
//! let explicit = SettingsLayer { prefetch_depth: Some(2), ..SettingsLayer::default() };
//! let env = [("OFFLOAD_PRESET".to_string(), "low_ram_safe".to_string())];
//! let settings = Settings::resolve(&explicit, env, None)?;
//! assert_eq!(settings.preset, Preset::LowRamSafe); // the environment beats the preset's default
//! assert_eq!(settings.prefetch_depth, 2); // explicit beats everything
//! assert_eq!(settings.origin("preset"), Origin::Environment("OFFLOAD_PRESET".into()));
//! # Ok::<(), offload_core::plan::PlanError>(())
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::plan::budget::FULL_PIN_RATIO;
use crate::plan::capacity::Recommendation;
use crate::plan::error::{Origin, PlanError};
use crate::plan::preset::Preset;
use crate::size::parse_size;

/// The prefix of every environment variable the settings read.
pub const ENV_PREFIX: &str = "OFFLOAD_";

/// The environment variable naming the TOML settings file (`Settings::from_process`, feature `io`); not a setting itself.
pub const CONFIG_VARIABLE: &str = "OFFLOAD_CONFIG";

/// The type of a setting's value, which decides how it is parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A preset name.
    Preset,
    /// A size: `"6GiB"`, `"3GB"` or a byte count; a TOML integer is bytes.
    Size,
    /// `true`/`false` (also `1/0`, `yes/no`, `on/off` in the environment).
    Bool,
    /// A whole number, 1 or more.
    Count,
    /// A prefetch depth: a whole number from 1 to [`MAX_PREFETCH_DEPTH`].
    Depth,
    /// Where host copies live: `auto` (the planner chooses from the host budget), `ram` or `file`.
    HostTier,
    /// A filesystem path.
    Path,
    /// Non-empty text.
    Text,
    /// A number, 0 or more.
    Ratio,
}

impl Kind {
    /// The type as the documentation names it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Preset => "preset",
            Kind::Size => "size",
            Kind::Bool => "bool",
            Kind::Count => "integer >= 1",
            Kind::Depth => "integer 1 to 64",
            Kind::HostTier => "auto, ram or file",
            Kind::Path => "path",
            Kind::Text => "text",
            Kind::Ratio => "number >= 0",
        }
    }

    /// What a value must look like, for error messages.
    pub fn expected(self) -> &'static str {
        match self {
            Kind::Preset => {
                "one of auto, one_shot_fast, low_ram_safe, warm_process, diffusers_offload_compat, \
                 diffusers_leaf_offload_compat, no_pin, off"
            }
            Kind::Size => "a size such as \"6GiB\", \"3GB\" or a byte count (KB/MB/GB decimal, KiB/MiB/GiB binary)",
            Kind::Bool => "true or false (the environment also takes 1/0, yes/no, on/off)",
            Kind::Count => "a whole number, 1 or more",
            Kind::Depth => "a whole number from 1 to 64 (each is a group held on the device; 1 is usually best)",
            Kind::HostTier => "auto (the planner chooses from the host budget), ram or file",
            Kind::Path => "a path",
            Kind::Text => "non-empty text of letters, digits, '-', '_' or '.'",
            Kind::Ratio => "a number, 0 or more (0 disables)",
        }
    }
}

/// One setting: its key, type, default and meaning. [`KEYS`] lists them all; the documentation's table is
/// [`settings_table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyInfo {
    /// The key, as written in TOML and passed to [`SettingsLayer::set`].
    pub key: &'static str,
    /// The value's type.
    pub kind: Kind,
    /// The default, in words.
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
}

impl KeyInfo {
    /// The environment variable: `OFFLOAD_` and the key in capitals.
    pub fn variable(&self) -> String {
        format!("{ENV_PREFIX}{}", self.key.to_ascii_uppercase())
    }
}

/// Every setting, in the documented order.
pub const KEYS: &[KeyInfo] = &[
    KeyInfo { key: "preset", kind: Kind::Preset, default: "auto", doc: "the routing policy; see the preset table" },
    KeyInfo {
        key: "reserve",
        kind: Kind::Size,
        default: "activation estimate + margin, per component",
        doc: "device bytes kept free for activations while a component runs; replaces the estimate",
    },
    KeyInfo {
        key: "resident_budget",
        kind: Kind::Size,
        default: "planned (preset)",
        doc: "bytes of a block-offloaded component's blocks that stay on the device",
    },
    KeyInfo {
        key: "pinned_budget",
        kind: Kind::Size,
        default: "available host RAM less the margin",
        doc: "most host bytes pinned, over the whole pipeline",
    },
    KeyInfo {
        key: "prefetch",
        kind: Kind::Bool,
        default: "true (no_pin: false)",
        doc: "upload the next groups on a worker thread",
    },
    KeyInfo { key: "prefetch_depth", kind: Kind::Depth, default: "1", doc: "groups uploaded ahead of the running one" },
    KeyInfo {
        key: "blocks_per_group",
        kind: Kind::Count,
        default: "1",
        doc: "consecutive blocks uploaded as one group",
    },
    KeyInfo {
        key: "disk_store_dir",
        kind: Kind::Path,
        default: "none (host memory)",
        doc: "keep streamed host copies that differ from their checkpoint files (quantized, LoRA-fused) as files here when host RAM is short",
    },
    KeyInfo {
        key: "low_host_memory",
        kind: Kind::Bool,
        default: "false (low_ram_safe: true)",
        doc: "spare host RAM: pin nothing, read every copy that moves from its checkpoint file, or from disk_store_dir when it differs from the file",
    },
    KeyInfo {
        key: "retry_on_oom",
        kind: Kind::Bool,
        default: "true",
        doc: "retry an out-of-memory onload after offloading another component",
    },
    KeyInfo {
        key: "profile_name",
        kind: Kind::Text,
        default: "none",
        doc: "named calibration: the first run measures, later runs reuse its resident budget",
    },
    KeyInfo {
        key: "profile_dir",
        kind: Kind::Path,
        default: "<data dir>/offload/profiles",
        doc: "where capacity profiles are stored",
    },
    KeyInfo { key: "calibrate", kind: Kind::Bool, default: "false", doc: "run the named profile's calibration again" },
    KeyInfo {
        key: "full_pin_ratio",
        kind: Kind::Ratio,
        default: "4.0",
        doc: "model-to-card ratio from which one_shot_fast and warm_process pin all and keep nothing resident; 0 disables",
    },
    KeyInfo {
        key: "host_available",
        kind: Kind::Size,
        default: "read from the OS",
        doc: "host RAM available to the plan, replacing the OS reading",
    },
    KeyInfo {
        key: "host_tier",
        kind: Kind::HostTier,
        default: "auto",
        doc: "where host copies live: ram (every copy in RAM), file (every file-backed copy read from its checkpoint file), or auto (the planner chooses from the host budget)",
    },
];

/// The documentation's settings table, in Markdown: key, type, default, variable, meaning.
pub fn settings_table() -> String {
    let mut out = String::from("| key | type | default | variable | meaning |\n|---|---|---|---|---|\n");
    for key in KEYS {
        out.push_str(&format!(
            "| `{}` | {} | {} | `{}` | {} |\n",
            key.key,
            key.kind.name(),
            key.default,
            key.variable(),
            key.doc
        ));
    }
    out
}

fn key_names() -> String {
    KEYS.iter().map(|k| k.key).collect::<Vec<_>>().join(", ")
}

fn variable_names() -> String {
    let mut names: Vec<String> = KEYS.iter().map(KeyInfo::variable).collect();
    names.push(CONFIG_VARIABLE.to_string());
    names.join(", ")
}

/// One layer of settings: every field `None` unless that layer sets it. The explicit layer is built by the
/// program, the others are parsed from the environment and the TOML file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SettingsLayer {
    /// `preset`.
    pub preset: Option<Preset>,
    /// `reserve`, bytes.
    pub reserve: Option<u64>,
    /// `resident_budget`, bytes.
    pub resident_budget: Option<u64>,
    /// `pinned_budget`, bytes.
    pub pinned_budget: Option<u64>,
    /// `prefetch`.
    pub prefetch: Option<bool>,
    /// `prefetch_depth`.
    pub prefetch_depth: Option<usize>,
    /// `blocks_per_group`.
    pub blocks_per_group: Option<usize>,
    /// `disk_store_dir`.
    pub disk_store_dir: Option<PathBuf>,
    /// `low_host_memory`.
    pub low_host_memory: Option<bool>,
    /// `retry_on_oom`.
    pub retry_on_oom: Option<bool>,
    /// `profile_name`.
    pub profile_name: Option<String>,
    /// `profile_dir`.
    pub profile_dir: Option<PathBuf>,
    /// `calibrate`.
    pub calibrate: Option<bool>,
    /// `full_pin_ratio`.
    pub full_pin_ratio: Option<f64>,
    /// `host_available`, bytes.
    pub host_available: Option<u64>,
    /// `host_tier`.
    pub host_tier: Option<HostTierSetting>,
}

/// The `host_tier` setting: where host copies live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HostTierSetting {
    /// The planner chooses each component's tier from the host budget (the default).
    #[default]
    Auto,
    /// Every copy stays in RAM; a plan the RAM cannot hold is refused.
    Ram,
    /// Every file-backed copy is read from its checkpoint file, whatever the RAM could hold.
    File,
}

impl HostTierSetting {
    /// The setting's value as written: `auto`, `ram`, `file`.
    pub fn name(self) -> &'static str {
        match self {
            HostTierSetting::Auto => "auto",
            HostTierSetting::Ram => "ram",
            HostTierSetting::File => "file",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text.to_ascii_lowercase().as_str() {
            "auto" => Some(HostTierSetting::Auto),
            "ram" => Some(HostTierSetting::Ram),
            "file" => Some(HostTierSetting::File),
            _ => None,
        }
    }
}

/// A parsed value, before it is stored in a layer.
enum Value {
    Preset(Preset),
    Bytes(u64),
    Bool(bool),
    Count(usize),
    Path(PathBuf),
    Text(String),
    Ratio(f64),
    HostTier(HostTierSetting),
}

fn find_key(key: &str, origin: &Origin) -> Result<&'static KeyInfo, PlanError> {
    KEYS.iter().find(|k| k.key == key).ok_or_else(|| PlanError::UnknownKey {
        key: key.to_string(),
        origin: origin.clone(),
        accepted: key_names(),
    })
}

fn invalid(info: &KeyInfo, value: &str, origin: &Origin) -> PlanError {
    PlanError::InvalidValue {
        key: info.key,
        value: value.to_string(),
        origin: origin.clone(),
        expected: info.kind.expected(),
    }
}

/// Whether a whole number is in range for `kind` ([`Kind::Count`] or [`Kind::Depth`]).
fn in_range(kind: Kind, n: usize) -> bool {
    match kind {
        Kind::Depth => (1..=MAX_PREFETCH_DEPTH).contains(&n),
        _ => n >= 1,
    }
}

fn valid_text(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The most groups a streamed model may have uploaded ahead of the running one. Each is a group's bytes held on
/// the device, and depths past 1 buy little (sglang measured 56.60 s at depth 1 and 56.12 s at 16), so a depth past
/// this is a mistake rather than a plan: every layer that takes a depth (the settings, `GroupOptions`, the group
/// offloader's config) refuses it, naming this bound.
pub const MAX_PREFETCH_DEPTH: usize = 64;

/// Parses a value given as text (an explicit string or an environment variable).
fn parse_text(info: &KeyInfo, text: &str, origin: &Origin) -> Result<Value, PlanError> {
    let bad = || invalid(info, text, origin);
    let trimmed = text.trim();
    Ok(match info.kind {
        Kind::Preset => Value::Preset(Preset::parse(trimmed).map_err(|_| bad())?),
        Kind::Size => Value::Bytes(parse_size(trimmed).map_err(|_| bad())?),
        Kind::Bool => Value::Bool(match trimmed.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => true,
            "0" | "false" | "no" | "off" => false,
            _ => return Err(bad()),
        }),
        Kind::Count | Kind::Depth => match trimmed.parse::<usize>() {
            Ok(n) if in_range(info.kind, n) => Value::Count(n),
            _ => return Err(bad()),
        },
        Kind::Path if trimmed.is_empty() => return Err(bad()),
        Kind::Path => Value::Path(PathBuf::from(trimmed)),
        Kind::Text if !valid_text(trimmed) => return Err(bad()),
        Kind::Text => Value::Text(trimmed.to_string()),
        Kind::HostTier => Value::HostTier(HostTierSetting::parse(trimmed).ok_or_else(bad)?),
        Kind::Ratio => match trimmed.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => Value::Ratio(x),
            _ => return Err(bad()),
        },
    })
}

/// Parses a value from the TOML file: strings as in the environment, TOML integers for sizes (bytes), counts
/// and ratios, TOML booleans for booleans.
#[cfg(feature = "io")]
fn parse_toml(info: &KeyInfo, value: &toml::Value) -> Result<Value, PlanError> {
    let origin = Origin::File;
    let bad = || invalid(info, &value.to_string(), &origin);
    match (info.kind, value) {
        (Kind::Bool, toml::Value::Boolean(b)) => Ok(Value::Bool(*b)),
        (Kind::Bool, _) => Err(bad()),
        (Kind::Size, toml::Value::Integer(n)) => u64::try_from(*n).map(Value::Bytes).map_err(|_| bad()),
        (Kind::Count | Kind::Depth, toml::Value::Integer(n)) => match usize::try_from(*n) {
            Ok(n) if in_range(info.kind, n) => Ok(Value::Count(n)),
            _ => Err(bad()),
        },
        (Kind::Ratio, toml::Value::Integer(n)) if *n >= 0 => Ok(Value::Ratio(*n as f64)),
        (Kind::Ratio, toml::Value::Float(x)) if x.is_finite() && *x >= 0.0 => Ok(Value::Ratio(*x)),
        (Kind::Preset | Kind::Size | Kind::Path | Kind::Text | Kind::HostTier, toml::Value::String(s)) => {
            parse_text(info, s, &origin)
        }
        _ => Err(bad()),
    }
}

impl SettingsLayer {
    /// Sets one key from text, as a command line would (`--set resident_budget=6GiB`). The value is parsed as an
    /// environment variable's would be; an unknown key or a bad value is an error naming the accepted ones.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), PlanError> {
        let info = find_key(key.trim(), &Origin::Explicit)?;
        let value = parse_text(info, value, &Origin::Explicit)?;
        self.store(info.key, value);
        Ok(())
    }

    /// Reads the `OFFLOAD_*` variables among `vars`; other variables are ignored, an unknown `OFFLOAD_*` one is
    /// an error. `OFFLOAD_CONFIG` names the settings file and is skipped here.
    pub fn from_env<I, K, V>(vars: I) -> Result<Self, PlanError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut layer = Self::default();
        for (name, value) in vars {
            let name = name.as_ref();
            let Some(suffix) = name.strip_prefix(ENV_PREFIX) else { continue };
            if name == CONFIG_VARIABLE {
                continue;
            }
            let key = suffix.to_ascii_lowercase();
            let info = KEYS
                .iter()
                .find(|k| k.key == key)
                .ok_or_else(|| PlanError::UnknownVariable { name: name.to_string(), accepted: variable_names() })?;
            let value = parse_text(info, value.as_ref(), &Origin::Environment(name.to_string()))?;
            layer.store(info.key, value);
        }
        Ok(layer)
    }

    /// Reads a TOML settings file's text: top-level keys named as in [`KEYS`] (feature `io`).
    ///
    /// ```
    /// use offload_core::plan::{Preset, Settings, SettingsLayer};
    /// let env = [("OFFLOAD_PRESET".to_string(), "low_ram_safe".to_string())];
    /// let file = "preset = \"one_shot_fast\"\nresident_budget = \"4GiB\"\n";
    /// assert_eq!(SettingsLayer::from_toml(file)?.resident_budget, Some(4 << 30));
    /// let settings = Settings::resolve(&SettingsLayer::default(), env, Some(file))?;
    /// assert_eq!(settings.preset, Preset::LowRamSafe); // the environment beats the file
    /// assert_eq!(settings.resident_budget, Some(4 << 30)); // the file beats the preset default
    /// # Ok::<(), offload_core::plan::PlanError>(())
    /// ```
    #[cfg(feature = "io")]
    pub fn from_toml(text: &str) -> Result<Self, PlanError> {
        let table: toml::Table =
            text.parse().map_err(|e: toml::de::Error| PlanError::InvalidToml { message: e.message().to_string() })?;
        let mut layer = Self::default();
        for (key, value) in &table {
            let info = find_key(key, &Origin::File)?;
            let value = parse_toml(info, value)?;
            layer.store(info.key, value);
        }
        Ok(layer)
    }

    fn store(&mut self, key: &'static str, value: Value) {
        match (key, value) {
            ("preset", Value::Preset(v)) => self.preset = Some(v),
            ("reserve", Value::Bytes(v)) => self.reserve = Some(v),
            ("resident_budget", Value::Bytes(v)) => self.resident_budget = Some(v),
            ("pinned_budget", Value::Bytes(v)) => self.pinned_budget = Some(v),
            ("prefetch", Value::Bool(v)) => self.prefetch = Some(v),
            ("prefetch_depth", Value::Count(v)) => self.prefetch_depth = Some(v),
            ("blocks_per_group", Value::Count(v)) => self.blocks_per_group = Some(v),
            ("disk_store_dir", Value::Path(v)) => self.disk_store_dir = Some(v),
            ("low_host_memory", Value::Bool(v)) => self.low_host_memory = Some(v),
            ("retry_on_oom", Value::Bool(v)) => self.retry_on_oom = Some(v),
            ("profile_name", Value::Text(v)) => self.profile_name = Some(v),
            ("profile_dir", Value::Path(v)) => self.profile_dir = Some(v),
            ("calibrate", Value::Bool(v)) => self.calibrate = Some(v),
            ("full_pin_ratio", Value::Ratio(v)) => self.full_pin_ratio = Some(v),
            ("host_available", Value::Bytes(v)) => self.host_available = Some(v),
            ("host_tier", Value::HostTier(v)) => self.host_tier = Some(v),
            // `parse_text` and `parse_toml` produce the value of the key's kind, so nothing else arrives here.
            _ => {}
        }
    }

    /// Checks the values a program can set directly on the explicit layer (the parsed layers are checked while
    /// parsing).
    fn validate(&self, origin: &Origin) -> Result<(), PlanError> {
        let check = |key: &'static str, ok: bool, shown: String| -> Result<(), PlanError> {
            if ok {
                return Ok(());
            }
            let info = find_key(key, origin)?;
            Err(invalid(info, &shown, origin))
        };
        if let Some(n) = self.prefetch_depth {
            check("prefetch_depth", in_range(Kind::Depth, n), n.to_string())?;
        }
        if let Some(n) = self.blocks_per_group {
            check("blocks_per_group", n >= 1, n.to_string())?;
        }
        if let Some(x) = self.full_pin_ratio {
            check("full_pin_ratio", x.is_finite() && x >= 0.0, x.to_string())?;
        }
        if let Some(name) = &self.profile_name {
            check("profile_name", valid_text(name), name.clone())?;
        }
        Ok(())
    }
}

/// The resolved settings: every key's value, and where each came from.
///
/// Build it with [`Settings::resolve`], `Settings::from_process` (feature `io`), or from a preset alone
/// (`Settings::from(Preset::Auto)`).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The routing policy.
    pub preset: Preset,
    /// Device bytes kept free for activations; `None`: each component's activation estimate plus a margin.
    pub reserve: Option<u64>,
    /// Resident bytes of block-offloaded components; `None`: the planner decides.
    pub resident_budget: Option<u64>,
    /// Most host bytes pinned; `None`: bounded by available host RAM only.
    pub pinned_budget: Option<u64>,
    /// Whether streamed groups are prefetched.
    pub prefetch: bool,
    /// Groups uploaded ahead.
    pub prefetch_depth: usize,
    /// Blocks per group.
    pub blocks_per_group: usize,
    /// Where streamed host copies may be kept as files.
    pub disk_store_dir: Option<PathBuf>,
    /// Whether host RAM is to be spared: nothing pinned, every host copy a checkpoint file or the disk store can
    /// serve read from it.
    pub low_host_memory: bool,
    /// Whether out-of-memory onloads are retried.
    pub retry_on_oom: bool,
    /// The named calibration profile.
    pub profile_name: Option<String>,
    /// Where capacity profiles are stored; `None`: the platform's data directory.
    pub profile_dir: Option<PathBuf>,
    /// Whether the named profile is calibrated again.
    pub calibrate: bool,
    /// The full-pin rule's model-to-card ratio; 0 disables it.
    pub full_pin_ratio: f64,
    /// Host RAM available to the plan, replacing the OS reading.
    pub host_available: Option<u64>,
    /// Where host copies live: the planner's choice (`Auto`), or every one in RAM or from its file.
    pub host_tier: HostTierSetting,
    /// The named profile's stored recommendation, once loaded
    /// (`ProfileStore::apply_calibration`, feature `io`); not a key.
    pub calibration: Option<Recommendation>,
    origins: BTreeMap<&'static str, Origin>,
}

impl Settings {
    /// Resolves the settings: `explicit` beats the `OFFLOAD_*` variables among `env`, which beat the TOML
    /// `file` text, which beats the preset's defaults. The preset itself is resolved the same way first. A file
    /// is read only with the `io` feature; without it a given file is refused with the feature to enable.
    pub fn resolve<I, K, V>(explicit: &SettingsLayer, env: I, file: Option<&str>) -> Result<Self, PlanError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        explicit.validate(&Origin::Explicit)?;
        let env = SettingsLayer::from_env(env)?;
        let file = match file {
            #[cfg(feature = "io")]
            Some(text) => SettingsLayer::from_toml(text)?,
            #[cfg(not(feature = "io"))]
            Some(_) => {
                return Err(PlanError::InvalidToml {
                    message: "reading a settings file needs offload-core's `io` feature; enable it, or pass \
                              the settings as explicit values"
                        .into(),
                });
            }
            None => SettingsLayer::default(),
        };
        Ok(Self::from_layers(explicit, &env, &file))
    }

    /// Resolves against the process: its environment, and the TOML file named by `OFFLOAD_CONFIG` if set
    /// (feature `io`).
    #[cfg(feature = "io")]
    pub fn from_process(explicit: &SettingsLayer) -> Result<Self, PlanError> {
        let env: Vec<(String, String)> = std::env::vars_os()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
            .collect();
        let file = match env.iter().find(|(k, _)| k == CONFIG_VARIABLE) {
            Some((_, path)) => {
                let path = PathBuf::from(path);
                Some(std::fs::read_to_string(&path).map_err(|source| PlanError::ConfigFile { path, source })?)
            }
            None => None,
        };
        Self::resolve(explicit, env, file.as_deref())
    }

    fn from_layers(explicit: &SettingsLayer, env: &SettingsLayer, file: &SettingsLayer) -> Self {
        let mut origins = BTreeMap::new();
        let env_origin = |key: &str| Origin::Environment(format!("{ENV_PREFIX}{}", key.to_ascii_uppercase()));
        macro_rules! pick {
            ($field:ident) => {{
                let key = stringify!($field);
                if let Some(v) = explicit.$field.clone() {
                    origins.insert(key, Origin::Explicit);
                    Some(v)
                } else if let Some(v) = env.$field.clone() {
                    origins.insert(key, env_origin(key));
                    Some(v)
                } else if let Some(v) = file.$field.clone() {
                    origins.insert(key, Origin::File);
                    Some(v)
                } else {
                    None
                }
            }};
        }
        let preset = pick!(preset).unwrap_or_default();
        let defaults = preset.defaults();
        Self {
            preset,
            reserve: pick!(reserve),
            resident_budget: pick!(resident_budget),
            pinned_budget: pick!(pinned_budget),
            prefetch: pick!(prefetch).unwrap_or(defaults.prefetch),
            prefetch_depth: pick!(prefetch_depth).unwrap_or(defaults.prefetch_depth),
            blocks_per_group: pick!(blocks_per_group).unwrap_or(defaults.blocks_per_group),
            disk_store_dir: pick!(disk_store_dir),
            low_host_memory: pick!(low_host_memory).unwrap_or(defaults.low_host_memory),
            retry_on_oom: pick!(retry_on_oom).unwrap_or(true),
            profile_name: pick!(profile_name),
            profile_dir: pick!(profile_dir),
            calibrate: pick!(calibrate).unwrap_or(false),
            full_pin_ratio: pick!(full_pin_ratio).unwrap_or(FULL_PIN_RATIO),
            host_available: pick!(host_available),
            host_tier: pick!(host_tier).unwrap_or_default(),
            calibration: None,
            origins,
        }
    }

    /// Where a key's value came from; [`Origin::Default`] when nobody set it (or the key is unknown).
    pub fn origin(&self, key: &str) -> Origin {
        self.origins.get(key).cloned().unwrap_or(Origin::Default)
    }

    /// Whether a layer set the key (as opposed to the preset default).
    pub fn is_set(&self, key: &str) -> bool {
        self.origins.contains_key(key)
    }
}

impl From<Preset> for Settings {
    fn from(preset: Preset) -> Self {
        Self::from_layers(
            &SettingsLayer { preset: Some(preset), ..SettingsLayer::default() },
            &SettingsLayer::default(),
            &SettingsLayer::default(),
        )
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self::from(Preset::Auto)
    }
}

// Where the settings point the profile store: written here, beside the settings, so the store's module needs
// nothing of this one.
#[cfg(feature = "io")]
impl crate::plan::capacity::ProfileStore {
    /// The store the settings name: `profile_dir`, or [`default_dir`](Self::default_dir).
    pub fn from_settings(settings: &Settings) -> Result<Self, PlanError> {
        match &settings.profile_dir {
            Some(dir) => Ok(Self::at(dir)),
            None => Self::default_dir().map(Self::at),
        }
    }

    /// Loads the recommendation of `settings.profile_name` into `settings.calibration`, unless `calibrate` asks
    /// for a new calibration. Returns what was loaded.
    pub fn apply_calibration(&self, settings: &mut Settings) -> Result<Option<Recommendation>, PlanError> {
        settings.calibration = match (&settings.profile_name, settings.calibrate) {
            (Some(name), false) => self.calibration(name)?,
            _ => None,
        };
        Ok(settings.calibration)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without planning's I/O a settings file is refused by name, never silently skipped.
    #[cfg(not(feature = "io"))]
    #[test]
    fn a_settings_file_needs_the_io_feature() {
        let no_env: [(&str, &str); 0] = [];
        let error = Settings::resolve(&SettingsLayer::default(), no_env, Some("prefetch = true")).expect_err("refused");
        assert!(error.to_string().contains("`io` feature"), "{error}");
        assert!(Settings::resolve(&SettingsLayer::default(), no_env, None).is_ok());
    }

    #[cfg(feature = "io")]
    #[test]
    fn a_settings_file_is_read_with_the_io_feature() {
        let no_env: [(&str, &str); 0] = [];
        let settings = Settings::resolve(&SettingsLayer::default(), no_env, Some("prefetch = false")).expect("read");
        assert!(!settings.prefetch);
    }
}
