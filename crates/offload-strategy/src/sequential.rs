//! [`Sequential`]: offload every other resident component before each onload (model CPU offload).

use crate::{OffloadStrategy, OffloadView};

/// Offloads every candidate before each onload, whatever the memory reading says.
///
/// This is model CPU offload, and the docs' `OffloadEverything` example: at most one offloadable component is
/// resident at a time, so peak memory is the largest component plus activations, at the price of a transfer for
/// every change of component. Components that are not candidates (under group offload, or in use on another
/// thread) stay where they are.
///
/// ```
/// use offload_strategy::{ComponentView, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent, Sequential};
///
/// let incoming = ComponentView::new("vae", "vae", 1 << 20);
/// let resident = [
///     ResidentComponent::new("text_encoder", "text_encoder", 7 << 30),
///     ResidentComponent::new("transformer", "transformer", 11 << 30),
/// ];
/// let view = OffloadView {
///     incoming: &incoming,
///     resident: &resident,
///     // Plenty of room: Sequential offloads all the same.
///     reading: MemoryReading { available: 60 << 30, total: 80 << 30, peak: 20 << 30 },
///     reserve: 0,
///     device: "cuda:0",
///     use_index: 3,
/// };
/// assert_eq!(Sequential.decide(&view), ["text_encoder", "transformer"]);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Sequential;

impl OffloadStrategy for Sequential {
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String> {
        view.candidates().map(|r| r.id().to_string()).collect()
    }

    fn name(&self) -> &str {
        "sequential"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ComponentView, MemoryReading, ResidentComponent};

    #[test]
    fn offloads_every_candidate_and_only_candidates() {
        let incoming = ComponentView::new("d", "d", 1);
        let decide = |flags: [(bool, bool); 3]| {
            let resident: Vec<ResidentComponent> = ["a", "b", "c"]
                .into_iter()
                .zip(flags)
                .map(|(id, (grouped, in_use))| {
                    let mut r = ResidentComponent::new(id, id, 5);
                    r.evictable = !grouped;
                    r.in_use = in_use;
                    r
                })
                .collect();
            let view = OffloadView {
                incoming: &incoming,
                resident: &resident,
                reading: MemoryReading { available: 1_000, total: 1_000, peak: 0 },
                reserve: 0,
                device: "cpu",
                use_index: 1,
            };
            Sequential.decide(&view)
        };
        assert_eq!(decide([(false, false); 3]), ["a", "b", "c"]);
        assert_eq!(decide([(false, false), (true, false), (false, false)]), ["a", "c"]);
        assert_eq!(decide([(false, false), (true, false), (false, true)]), ["a"]);
        assert_eq!(decide([(true, false), (true, true), (false, true)]), Vec::<String>::new());
    }
}
