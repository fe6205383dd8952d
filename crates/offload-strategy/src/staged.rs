//! [`Staged`]: the strategy of a phase-staged plan.

use crate::{OffloadStrategy, OffloadView};

/// The manager strategy of a phase-staged plan: when a component comes onto the device, every other resident
/// component leaves except those the plan keeps resident.
///
/// This is the planner's staging model as an [`OffloadStrategy`]: each phase's component runs with the device
/// to itself and the resident components. Like every strategy it only returns candidates (a component running on
/// another thread, or one under non-releasable group offload, stays).
///
/// ```
/// use offload_strategy::{ComponentView, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent, Staged};
///
/// let incoming = ComponentView::new("vae_3", "vae", 1 << 20);
/// let resident = [
///     ResidentComponent::new("text_encoder_1", "text_encoder", 7 << 30),
///     ResidentComponent::new("transformer_4", "transformer", 1 << 30),
/// ];
/// let view = OffloadView {
///     incoming: &incoming,
///     resident: &resident,
///     reading: MemoryReading { available: 60 << 30, total: 80 << 30, peak: 20 << 30 },
///     reserve: 0,
///     device: "cuda:0",
///     use_index: 3,
/// };
/// let staged = Staged::keeping(["text_encoder_1".to_string()]);
/// assert_eq!(staged.decide(&view), ["transformer_4"]);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Staged {
    keep: Vec<String>,
}

impl Staged {
    /// A staged strategy that never offloads the components with these ids.
    pub fn keeping(ids: impl IntoIterator<Item = String>) -> Self {
        Self { keep: ids.into_iter().collect() }
    }

    /// The ids it keeps.
    pub fn kept(&self) -> &[String] {
        &self.keep
    }
}

impl OffloadStrategy for Staged {
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String> {
        view.candidates().filter(|r| !self.keep.iter().any(|k| k == r.id())).map(|r| r.id().to_string()).collect()
    }

    fn name(&self) -> &str {
        "staged"
    }
}
