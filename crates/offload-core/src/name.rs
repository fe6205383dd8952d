//! Device names: a device as the manager, the record and every error name it (`cuda:0`, `cpu`).

use std::fmt;

/// A normalised device name, as the anchor normalises `torch.device`: an accelerator always carries an index
/// (`cuda` becomes `cuda:0`), the CPU never does (`cpu:0` becomes `cpu`).
///
/// ```
/// use offload_core::DeviceName;
/// assert_eq!(DeviceName::parse("cuda").unwrap().as_str(), "cuda:0");
/// assert_eq!(DeviceName::parse("CUDA:1").unwrap().as_str(), "cuda:1");
/// assert_eq!(DeviceName::parse("cpu:0").unwrap().as_str(), "cpu");
/// assert!(DeviceName::parse("cuda:x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceName(String);

/// A device string that is not of the form `kind` or `kind:index`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot read device {input:?}: write a kind and an optional index, such as \"cpu\", \"cuda\" or \"cuda:1\"")]
pub struct DeviceNameError {
    /// The string as given.
    pub input: String,
}

impl DeviceName {
    /// Parses and normalises a device string.
    pub fn parse(input: &str) -> Result<Self, DeviceNameError> {
        let err = || DeviceNameError { input: input.to_string() };
        let lower = input.trim().to_ascii_lowercase();
        let (kind, index) = match lower.split_once(':') {
            Some((kind, index)) => (kind.to_string(), Some(index.parse::<u32>().map_err(|_| err())?)),
            None => (lower.clone(), None),
        };
        if kind.is_empty() || !kind.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(err());
        }
        if kind == "cpu" {
            return Ok(Self(kind));
        }
        Ok(Self(format!("{kind}:{}", index.unwrap_or(0))))
    }

    /// The host: where offloaded components live.
    pub fn cpu() -> Self {
        Self("cpu".into())
    }

    /// The normalised name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The kind without the index (`cuda` for `cuda:1`).
    pub fn kind(&self) -> &str {
        self.0.split(':').next().unwrap_or(&self.0)
    }

    /// Whether this is the host.
    pub fn is_cpu(&self) -> bool {
        self.0 == "cpu"
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

impl std::str::FromStr for DeviceName {
    type Err = DeviceNameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}
