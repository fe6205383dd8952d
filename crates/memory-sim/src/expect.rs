//! Card expectations: what a pipeline must do on a card (offload counts, OOM retries, final devices), declared
//! in TOML and checked against any run through a `ComponentsManager`, simulated or real.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use offload_core::{Action, DeviceName, OffloadEvent, Reason};
use serde::Deserialize;

use crate::error::SimError;

/// The Z-Image-Turbo declarations of the anchor's integration test.
pub const Z_IMAGE_TURBO: &str = include_str!("../expectations/z-image-turbo.toml");

/// What one card must show.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CardExpectation {
    /// Offload events per component name, `offloading_disabled` excluded.
    #[serde(default)]
    pub offload: BTreeMap<String, usize>,
    /// OOM retries per component name (the one that ran out of memory).
    #[serde(default)]
    pub oom: BTreeMap<String, usize>,
    /// Final device kind (`cuda`, `cpu`) per component name.
    #[serde(default)]
    pub final_device: BTreeMap<String, String>,
}

/// A pipeline's declarations for several cards.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expectations {
    /// The pipeline they are for.
    pub pipeline: String,
    /// The reserve the declarations assume, as a size string.
    pub reserve: String,
    /// Denoising steps the declarations assume.
    pub steps: usize,
    /// Declarations by card label.
    pub cards: BTreeMap<String, CardExpectation>,
}

impl Expectations {
    /// Reads declarations from TOML.
    pub fn parse(text: &str) -> Result<Self, SimError> {
        toml::from_str(text).map_err(|e| SimError::Expectations(e.to_string()))
    }

    /// The declarations shipped for Z-Image-Turbo.
    pub fn z_image_turbo() -> Self {
        // The embedded file is checked by a test; a parse failure here is a build defect, not user input.
        Self::parse(Z_IMAGE_TURBO).unwrap_or_else(|e| panic!("embedded expectations are invalid: {e}"))
    }

    /// The declaration for a card label, compared by the size it names when both parse as sizes.
    pub fn for_card(&self, label: &str) -> Option<&CardExpectation> {
        let wanted = offload_core::parse_size(label).ok();
        self.cards
            .iter()
            .find(|(key, _)| *key == label || (wanted.is_some() && offload_core::parse_size(key).ok() == wanted))
            .map(|(_, e)| e)
    }
}

/// The component name of an id (`transformer_2` → `transformer`).
pub fn name_of(id: &str) -> &str {
    id.rsplit_once('_').map_or(id, |(name, _)| name)
}

/// What a run showed, in the shape of a declaration: events taken before auto offload was disabled, and the
/// final placement.
pub fn observed(events: &[OffloadEvent], placement: &[(String, DeviceName)]) -> CardExpectation {
    let mut seen = CardExpectation::default();
    for event in events.iter().filter(|e| e.action == Action::Offload) {
        match &event.reason {
            Some(Reason::OffloadingDisabled) => continue,
            Some(Reason::OomRetry(culprit)) => *seen.oom.entry(name_of(culprit).to_string()).or_insert(0) += 1,
            _ => {}
        }
        *seen.offload.entry(name_of(&event.id).to_string()).or_insert(0) += 1;
    }
    for (id, device) in placement {
        seen.final_device.insert(name_of(id).to_string(), device.kind().to_string());
    }
    seen
}

/// A readable diff between a declaration and what was observed, or `None` when they agree.
pub fn diff(expected: &CardExpectation, observed: &CardExpectation) -> Option<String> {
    let mut out = String::new();
    let mut section = |title: &str, e: &BTreeMap<String, String>, o: &BTreeMap<String, String>| {
        let keys: std::collections::BTreeSet<&String> = e.keys().chain(o.keys()).collect();
        for key in keys {
            let (want, got) = (e.get(key), o.get(key));
            if want != got {
                let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(none)".into());
                let _ = writeln!(out, "  {title}.{key}: expected {}, observed {}", show(want), show(got));
            }
        }
    };
    let strings = |m: &BTreeMap<String, usize>| {
        m.iter().filter(|(_, v)| **v > 0).map(|(k, v)| (k.clone(), v.to_string())).collect()
    };
    section("offload", &strings(&expected.offload), &strings(&observed.offload));
    section("oom", &strings(&expected.oom), &strings(&observed.oom));
    section("final_device", &expected.final_device, &observed.final_device);
    if out.is_empty() { None } else { Some(out) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_declarations_parse() {
        let expectations = Expectations::z_image_turbo();
        assert_eq!(expectations.cards.len(), 4);
        assert_eq!(expectations.for_card("16GB").unwrap().offload.get("transformer"), Some(&1));
        assert_eq!(expectations.for_card("16000000000").unwrap().offload.get("transformer"), Some(&1));
        assert!(expectations.for_card("12GB").is_none());
    }

    #[test]
    fn bad_declarations_are_typed_errors() {
        assert!(matches!(Expectations::parse("pipeline = 3"), Err(SimError::Expectations(_))));
        let unknown = "pipeline = \"p\"\nreserve = \"0\"\nsteps = 1\n[cards.\"8GB\"]\noffloads = {}\n";
        assert!(matches!(Expectations::parse(unknown), Err(SimError::Expectations(_))));
    }

    #[test]
    fn diffs_name_each_difference() {
        let expected = Expectations::z_image_turbo().for_card("24GB").unwrap().clone();
        let mut observed = expected.clone();
        assert_eq!(diff(&expected, &observed), None);
        observed.offload.insert("transformer".into(), 1);
        observed.final_device.insert("vae".into(), "cpu".into());
        let text = diff(&expected, &observed).unwrap();
        assert_eq!(
            text,
            "  offload.transformer: expected (none), observed 1\n  final_device.vae: expected cuda, observed cpu\n"
        );
    }
}
